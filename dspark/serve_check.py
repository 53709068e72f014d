"""Serving check: `python -m dspark.serve_check run_dir=RUN target=smollm2 [export=DIR] [eval.py keys ...]`.

Decodes eval.py's benchmarks (same prompts, same chat-template token ids, T, gamma, max_new_tokens, eos ids)
with the project's engine and with vLLM serving the exported draft, and writes one side-by-side report
(dspark.serving.parity): `<out>/serve_check.T<T>.g<gamma>.json` + the table on stdout. `out` defaults to
<run_dir>/serve_check. Without `export=` the run's draft is exported first, in float32, with
`python -m dspark.export dense|v4|mtp` into <out>/export. vLLM runs in its own venv (`bash scripts/setup_vllm.sh`,
or `vllm_python=` / $DSPARK_VLLM_PYTHON). DeepSeek-V4 DSpark and MTP drafts are exported merged into a copy of
the target (`--merge-into`), which vLLM then serves as the target. Exit status 0 only when parity is shown (T=0:
outputs, every verify step, AL within `al_tolerance`; T>0: ALs within `al_z_max` standard errors, both engines drafting
with eval.py's `draft_sample_method`, default greedy = vLLM's); otherwise 1 with one line saying why (vLLM refused the
export, its load audit failed, a benchmark missed parity); `strict=false` only reports. vLLM's own error text, often
many KB, goes to `<out>/vllm_error.log`; the console gets its one telling line.

What vLLM serves on which machine: README "vLLM in the loop".
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from dspark.console import quiet_console  # noqa: E402
from dspark.errors import ConfigError, one_line_errors  # noqa: E402
from dspark.evaluation import run_eval as ev  # noqa: E402
from dspark.evaluation.run_eval import target_given  # noqa: E402
from dspark.evaluation.speculative import plain_generate, speculative_generate_batch  # noqa: E402
from dspark.export.__main__ import main as export_main  # noqa: E402
from dspark.export.adapter import adapter_for_folder, primary_adapter  # noqa: E402
from dspark.io import atomic_write_json  # noqa: E402
from dspark.schema import ServeCheckKeys, eval_config  # noqa: E402
from dspark.serving import engine as vllm_engine  # noqa: E402 (VLLMWorker, vllm_python: per call, tests swap them)
from dspark.serving.audit import describe, judge  # noqa: E402
from dspark.serving.engine import VLLMWorkerError  # noqa: E402
from dspark.serving.parity import Request, VLLMRun, compare, format_table, request_order  # noqa: E402
from dspark.targets.source import target_folder  # noqa: E402

log = logging.getLogger("dspark.serve_check")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ERROR_LOG = "vllm_error.log"  # vLLM's refusals in full, in the report folder
SHORT = 300  # characters of an error kept on the console and in the report


def error_line(text: str) -> str:
    """The one telling line of a long vLLM error (a pydantic ValidationError echoes every engine argument, ~23 KB):
    its "Value error, ..." reason, else a "no model class registered ..." line, else the last "...Error: ..." line,
    else the first line; cut to SHORT characters."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    picked = next((ln.split("Value error, ", 1)[1].split(" [type=", 1)[0] for ln in lines if "Value error, " in ln),
                  None)
    picked = picked or next((ln for ln in lines if "no model class registered" in ln), None)
    picked = picked or next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)), None)
    picked = picked or (lines[0] if lines else "")
    return picked if len(picked) <= SHORT else picked[:SHORT] + " ..."


def keep_error(out_dir: Path, what: str, exc: Exception) -> tuple[str, Path]:
    """(one short line naming the log, the log): vLLM's whole error text appended to <out_dir>/vllm_error.log."""
    path = Path(out_dir) / ERROR_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    detail = getattr(exc, "detail", "")
    with path.open("a", encoding="utf-8") as fh:
        fh.write(f"==== {what} ====\n{exc}\n" + (f"{detail}\n" if detail else ""))
    return f"{error_line(str(exc))} (full text: {path})", path


def no_parity_reason(summary: dict) -> str | None:
    """Why a serve_check summary shows no parity, in one line; None when it shows parity."""
    if summary.get("parity"):
        return None
    if summary.get("serve_error"):
        return f"vLLM did not serve the export: {summary['serve_error']}"
    if not summary.get("load_ok", True):
        load = summary.get("load_audit") or {}
        return f"vLLM's load audit failed: {load.get('error') or 'parameters unloaded or partly loaded (see report)'}"
    missed = [name for name, r in (summary.get("benchmarks") or {}).items() if not r.get("parity")]
    if missed:
        return f"no parity on {', '.join(missed)} (the report names the first differing token or step)"
    return "no benchmark was compared"


def served_as(export_dir: Path) -> tuple[str, bool]:
    """(vLLM's speculative method, merged) of an exported folder, from its format's adapter
    (dspark.export.adapter): the method its draft config names, and whether vLLM reads the draft from a target copy."""
    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"export: {path} not found: `export` must be a folder written by `python -m dspark.export`")
    found = adapter_for_folder(Path(export_dir))
    if found is None:
        raise ConfigError(f"export: {export_dir} holds no format dspark exports (python -m dspark.export verify "
                          f"{export_dir} says why); set `method` explicitly")
    adapter, config = found
    return adapter.draft_config(config).vllm_method, adapter.vllm_reads_merged


def export_run(cfg: ServeCheckKeys, run_dir: Path, kind: str, target_dir: str, out: Path) -> Path:
    """The run's draft exported in float32 through the export CLI, as a user would: dense drafts as a draft
    folder; DeepSeek-V4 DSpark and MTP drafts merged into a copy of the target (how vLLM loads them)."""
    adapter = primary_adapter(kind)
    fmt = adapter.cli
    args = [fmt, "--run-dir", str(run_dir), "--target", str(cfg.target.kind), "--out", str(out), "--dtype", "float32"]
    if cfg.target.path:
        args += ["--target-path", str(cfg.target.path)]
    if adapter.vllm_reads_merged:
        args += ["--merge-into", str(target_dir)]
    code = export_main(args)
    if code:
        raise RuntimeError(f"python -m dspark.export {' '.join(args)} exited {code}")
    return out


def project_decode(cfg: ServeCheckKeys, target, draft, draft_group, convs: list[list[str]]):
    """eval.py's decoding of one benchmark's conversations -> (parity.Request list in vLLM order, eval.py's
    report, gamma, eos ids)."""
    dcfg = draft.config
    g = int(cfg.num_drafts) if cfg.num_drafts is not None else int(dcfg.block_size)  # MTP: block_size = num_steps
    temperature, eos, max_new = float(cfg.temperature), ev.eos_ids(cfg, target), int(cfg.max_new_tokens)
    sample = cfg.draft_sample_method  # eval.yaml: vLLM's draft_sample_method
    prompts_seen: list[list[int]] = []

    def spec_decode(prompts, gens):
        prompts_seen.extend(p.tolist() for p in prompts)
        return speculative_generate_batch(target, draft, prompts, max_new_tokens=max_new, num_drafts=g,
                                          temperature=temperature, eos_token_id=eos, generators=gens,
                                          draft_sample_method=sample)  # mask token, layout, window: the draft's config

    def plain_decode(prompts, gens):
        return plain_generate(target, prompts, max_new, temperature, eos, gens)

    run = dict(batch_size=int(cfg.batch_size), all_turns=str(cfg.turns) == "all", seed=int(cfg.seed))
    spec = ev.decode_conversations(target.tokenizer, convs, spec_decode, **run)
    plain = ev.decode_conversations(target.tokenizer, convs, plain_decode, **run) if cfg.compare_target else None
    steps = [s for d in spec.batches for s in d.steps]
    order = request_order(convs, run["all_turns"])
    assert len(order) == len(steps) == len(prompts_seen)
    requests = [Request(c, t, p, spec.outputs[c][t].tolist(), None if plain is None else plain.outputs[c][t].tolist(),
                        [s.num_accepted for s in st], [s.num_drafts for s in st])
                for (c, t), p, st in zip(order, prompts_seen, steps)]
    report = ev.benchmark_report(spec, plain, temperature)
    return requests, report, g, eos


def run_serve_check(cfg: DictConfig | ServeCheckKeys, target_from_run: bool = False) -> dict:
    """Both engines on every benchmark; writes and returns the report (module docstring). target_from_run: against
    the target the run recorded (draft/target.json), as eval.py does when the command line names no target."""
    cfg = eval_config(cfg, ServeCheckKeys)  # the typed config, every key checked
    ev._validate(cfg)
    vllm_engine.vllm_python(cfg.vllm_python)  # fail before any decoding when vLLM is missing
    source = ev.draft_source(cfg)
    if target_from_run:
        cfg = ev.with_run_target(cfg, source[2])
    ev.check_target_fits(cfg, source[0], source[2])  # another architecture: one line, before any model loads
    temperature = float(cfg.temperature)
    if temperature == 0 and str(cfg.target.dtype) != "float32":
        log.warning("target.dtype=%s: exact greedy parity needs float32 on both sides (vLLM runs float32)",
                    cfg.target.dtype)
    benchmarks = ev.read_benchmarks(cfg)  # checked before any model loads
    target, draft, draft_group, weights, run_dir = ev.build(cfg, source)
    tpath = target_folder(cfg.target)
    out_dir = ev.resolve_path(cfg.out) if cfg.out else run_dir / "serve_check"
    export_dir = (ev.resolve_path(cfg.export) if cfg.export
                  else export_run(cfg, run_dir, str(draft_group.kind), tpath, out_dir / "export"))
    served_method, merged = served_as(export_dir)
    method = cfg.method or served_method
    # a merged export is a target copy: vLLM serves it as the target and reads the draft from it
    vllm_target, vllm_draft = (str(export_dir), None) if merged else (tpath, str(export_dir))

    decoded = {}
    for name, convs in benchmarks.items():
        t0 = time.perf_counter()
        requests, report, g, eos = project_decode(cfg, target, draft, draft_group, convs)
        decoded[name] = (requests, report, time.perf_counter() - t0)
        log.info("%s: eval.py AL %s (%d requests)", name, report["mean_acceptance_length"], len(requests))
    longest = max(len(r.prompt_ids) for reqs, _, _ in decoded.values() for r in reqs)
    max_len = int(cfg.max_model_len or (longest + int(cfg.max_new_tokens) + g + 16))
    del target, draft

    vllm = serve_with_vllm(cfg, decoded, vllm_target=vllm_target, vllm_draft=vllm_draft, plain_target=tpath,
                           method=method, gamma=g, eos=eos, max_len=max_len, export_dir=export_dir, out_dir=out_dir)
    reports = {}
    tol, z_max = cfg.al_tolerance, cfg.al_z_max
    for name, (requests, eval_report, eval_s) in decoded.items():
        r = vllm["runs"][name]
        if "spec" not in r:  # vLLM refused to serve it: the eval side alone, the refusal in the summary
            reports[name] = {"benchmark": name, "eval": eval_report, "vllm": None, "parity": False}
            continue
        rep = compare(requests, r["spec"].requests(r.get("plain")), r["spec"].counters, temperature, tol, z_max)
        if "spec_greedy_drafts" in r:  # what vLLM serves by default at T > 0
            rep["vllm_greedy_drafts"] = compare(requests, r["spec_greedy_drafts"].requests(),
                                                r["spec_greedy_drafts"].counters, temperature, tol, z_max)["vllm"]
        rep.update(benchmark=name, gamma=g, max_new_tokens=int(cfg.max_new_tokens), method=method,
                   draft_sample_method=cfg.draft_sample_method if temperature > 0 else None,
                   export=str(export_dir), draft_weights=str(weights), eval_report=eval_report,
                   seconds={"eval_py_spec_and_plain": eval_s, "vllm_spec": r["spec"].seconds,
                            "vllm_plain": r["plain"].seconds if "plain" in r else None})
        reports[name] = rep
    load, engine = vllm["load"], vllm["engine"]
    served_audits = [a for e in engine.values() for a in e.get("load_audit", [])]
    load_ok = bool(load.get("ok")) and all(a["ok"] for a in served_audits)
    summary = {"engines": {"eval": ev.ENGINE, "vllm": vllm["versions"]}, "method": method, "export": str(export_dir),
               "target": tpath, "vllm_target": vllm_target, "vllm_draft": vllm_draft, "engine": engine,
               "benchmarks": reports, "load_audit": load, "load_ok": load_ok, "serve_error": vllm["serve_error"],
               "serve_error_log": None if vllm["serve_error_log"] is None else str(vllm["serve_error_log"]),
               "parity": load_ok and vllm["serve_error"] is None and all(r["parity"] for r in reports.values()),
               "note": _check_note(draft_group)}
    tag = f"T{temperature:g}.g{g}"
    atomic_write_json(out_dir / f"serve_check.{tag}.json", summary)
    print_summary(summary, out_dir / f"serve_check.{tag}.json", temperature, g)
    return summary


def _check_note(draft_group) -> str | None:
    """What a passing check does and does not establish for this draft kind (its adapter says)."""
    return primary_adapter(str(draft_group.kind)).check_note(draft_group)


def serve_with_vllm(cfg: ServeCheckKeys, decoded: dict, *, vllm_target: str, vllm_draft: str | None, plain_target: str,
                    method: str, gamma: int, eos: list[int], max_len: int, export_dir: Path, out_dir: Path) -> dict:
    """Load audit, then the draft served (and, at T=0, the plain target) on every benchmark's prompt ids.
    A refusal by vLLM (load or serve) is recorded, not raised: it is the result of the check."""
    temperature = float(cfg.temperature)
    out = {"runs": {name: {} for name in decoded}, "engine": {}, "serve_error": None, "serve_error_log": None,
           "versions": None}
    with vllm_engine.VLLMWorker(cfg.vllm_python, log_path=out_dir / "vllm_worker.log") as w:
        try:  # vLLM's own draft class and load_weights on the export, before serving it
            out["load"] = judge(w.load_check(target=vllm_target, draft=vllm_draft, method=method,
                                             num_speculative_tokens=gamma, max_model_len=max_len,
                                             per_tensor=vllm_draft is not None), export_dir,
                                merged=vllm_draft is None)
        except VLLMWorkerError as exc:
            short, out["serve_error_log"] = keep_error(out_dir, "load audit", exc)
            out["load"] = {"ok": False, "error": short, "class": None}
        log.info("vLLM load audit: %s", out["load"].get("error") or describe(out["load"]))
        spec = dict(draft=vllm_draft, method=method, num_speculative_tokens=gamma)
        sample = cfg.draft_sample_method
        # at T > 0 both engines draft the same way (eval.yaml draft_sample_method = vLLM's: greedy = argmax drafts
        # accepted with probability p(y), vLLM's default; probabilistic = drafts sampled from q, min(1, p/q));
        # with probabilistic, vLLM's default is served as well and its AL reported beside
        configs = [("spec", vllm_target, {**spec, "speculative_extra": {"draft_sample_method": sample}}
                    if temperature > 0 else spec)]
        if cfg.vllm_plain and temperature == 0:
            configs.append(("plain", plain_target, {}))
        if temperature > 0 and sample != "greedy" and cfg.vllm_default_drafting:
            configs.append(("spec_greedy_drafts", vllm_target,
                            {**spec, "speculative_extra": {"draft_sample_method": "greedy"}}))
        for label, target, extra in configs:
            try:
                info = w.init(target=target, dtype="float32", max_model_len=max_len, seed=int(cfg.seed),
                              kv_cache_gib=cfg.kv_cache_gib, fix_cpu_float_expand=cfg.vllm_fix_cpu_float_expand,
                              **extra)
            except VLLMWorkerError as exc:
                out["serve_error"], out["serve_error_log"] = keep_error(out_dir, f"engine ({label})", exc)
                log.error("vLLM refused to serve it: %s", out["serve_error"])
                break
            out["engine"][label] = {"init_s": info["init_s"], "engine_kwargs": info["engine_kwargs"]}
            if info.get("load_audit"):  # the same audit, on the model the engine serves
                out["engine"][label]["load_audit"] = [judge(a, export_dir) for a in info["load_audit"]]
            for name, (requests, _, _) in decoded.items():
                res = w.generate([r.prompt_ids for r in requests], max_tokens=int(cfg.max_new_tokens),
                                 temperature=temperature, seed=int(cfg.seed), stop_token_ids=eos)
                out["runs"][name][label] = VLLMRun(res["outputs"], res["spec_counters"], res["generate_s"])
        out["versions"] = w.versions
    return out


def print_summary(summary: dict, path: Path, temperature: float, gamma: int) -> None:
    served = {n: r for n, r in summary["benchmarks"].items() if r.get("vllm") is not None}
    if served:
        print(format_table(served))
        for name, rep in served.items():
            for line in rep["explanation"]:
                print(f"  {name}: {line}")
            greedy = rep.get("vllm_greedy_drafts")
            if greedy:
                print(f"  {name}: vLLM's default drafting (draft_sample_method=greedy: argmax drafts, accepted with "
                      f"probability p(y)) serves AL {greedy['mean_acceptance_length']:.3f}; the table compares "
                      f"draft_sample_method={rep['draft_sample_method']} (eval.py's scheme)")
    load = summary["load_audit"]
    print(f"vLLM load: {load.get('error') or describe(load)}")
    if summary["serve_error"]:
        print(f"vLLM did not serve it: {summary['serve_error']}")
    if summary["note"]:
        print(f"note: {summary['note']}")
    versions = summary["engines"]["vllm"] or {}
    print(f"T={temperature:g} gamma={gamma} method={summary['method']} vllm={versions.get('vllm')}; "
          f"parity={'yes' if summary['parity'] else 'NO'}; report {path}")


@hydra.main(config_path=str(CONFIGS), config_name="serve_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    quiet_console()
    with one_line_errors("serve_check"):  # the run's own target unless the command line names one (as eval.py)
        summary = run_serve_check(cfg, target_from_run=not target_given(HydraConfig.get().overrides.task))
    why = no_parity_reason(summary)
    if why is not None and cfg.strict:  # a gate: no parity shown, no exit 0 (strict=false: report only)
        print(f"serve_check: parity not shown: {why}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
