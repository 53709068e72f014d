"""The GPU half of scripts/gpu_check.sh (issue 17): vLLM 0.33.0 serves every tiny export, on a CUDA machine.

    pip install vllm==0.33.0            # on the GPU machine; nothing here runs without CUDA
    python scripts/vllm_serve_check.py --out gpu_out/vllm [--cases dspark_v4 dsv4_mtp hyv4_mtp dense_dspark dflash]

Per case: a short GPU training run of the tiny default draft (train.py ... trainer=gpu), its export through
`python -m dspark.export` (+ the verifier), then, each in its own process (vLLM holds the GPU until exit):
  plain  vLLM LLM(target), greedy, on the first turn of `--num-prompts` prompts of each benchmark
  spec   vLLM LLM(target, speculative_config=...) greedy: outputs must equal `plain`; AL = 1 + accepted / drafts
         from the engine's spec-decode counters (v1/spec_decode/metrics.py)
  eval   eval.py on the same prompt token ids (turns=first, T=0, num_drafts = num_speculative_tokens): its AL
Cases: dspark_v4 (DeepSeek-V4 DSpark merged into the tiny target), dsv4_mtp / hyv4_mtp (MTP merged into the tiny
DeepSeek-V4 / HY V4 targets), dense_dspark / dflash (vLLM-format folders against a tiny RANDOM Qwen3 target this
script writes: greedy equality is meaningful, the AL of a draft of a random target is not).
Results: <out>/results.jsonl (one row per case) and <out>/summary.txt. Exit 1 when a greedy output differs or
an export fails verification; AL differences are reported (bf16 vLLM vs fp32 eval.py can flip near-ties).
Not run on the development machines (no GPU): never executed end to end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("dspark_v4", "dsv4_mtp", "hyv4_mtp", "dense_dspark", "dflash")
BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")


def run(cmd: list[str], log: Path, timeout: int) -> int:
    with log.open("w") as fh:
        return subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO)}).returncode


def make_dense_target(out: Path) -> Path:
    """A tiny random Qwen3 with the tiny_v4 tokenizer and chat template (vLLM serves Qwen3 DSpark / DFlash drafts
    against a Qwen3-family target)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from dspark.targets.tiny_v4 import TINY_V4_DIR

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(str(TINY_V4_DIR))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    for name in ("chat_template.jinja", "generation_config.json"):
        if (TINY_V4_DIR / name).is_file():
            shutil.copy(TINY_V4_DIR / name, out / name)
    return out


def case_plan(case: str, out: Path, steps: int) -> dict:
    """train overrides, export args, served target folder, speculative_config, eval overrides."""
    run_dir, export = out / case / "run", out / case / "export"
    common = ["trainer=gpu", f"trainer.max_steps={steps}", "trainer.val_check_interval=1000", "validate_at_start=false",
              "trainer.enable_progress_bar=false", f"run_dir={run_dir}"]
    if case in ("dspark_v4", "dsv4_mtp", "hyv4_mtp"):
        from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR
        from dspark.targets.tiny_v4 import TINY_V4_DIR

        hy = case == "hyv4_mtp"
        target_dir, target_kind = (TINY_HY_V4_DIR, "tiny_hy_v4") if hy else (TINY_V4_DIR, "tiny_v4")
        fmt = "v4" if case == "dspark_v4" else "mtp"
        g = 4 if case == "dspark_v4" else 3  # the tiny defaults: block_size 4, num_steps 3
        spec = ({"method": "dspark", "model": str(export), "num_speculative_tokens": g} if case == "dspark_v4"
                else {"method": "mtp", "num_speculative_tokens": g})
        return {"train": [f"experiment={case}", *common],
                "export": [fmt, "--run-dir", str(run_dir), "--target", target_kind, "--merge-into", str(target_dir),
                           "--out", str(export)],
                "target": str(export), "spec": spec, "g": g,
                "eval": [f"target={target_kind}", f"run_dir={run_dir}"]}
    dense_target = make_dense_target(out / "dense_target")
    exp = "dspark_smollm2" if case == "dense_dspark" else "dflash_smollm2"
    g = 6  # the smollm2 drafts' block_size
    target = ["target=hf", f"target.path={dense_target}", "target.dtype=float32"]
    return {"train": [f"experiment={exp}", *target, "data=sharegpt_tiny", "draft.target_layer_ids=[0,2,3]",
                      "draft.mask_token_id=4", "draft.num_layers=1", *common],
            "export": ["dense", "--run-dir", str(run_dir), "--target", "hf", "--target-path", str(dense_target),
                       "--out", str(export)],
            "target": str(dense_target), "g": g,
            "spec": {"method": "dspark" if case == "dense_dspark" else "dflash", "model": str(export),
                     "num_speculative_tokens": g},
            "eval": [*target, f"run_dir={run_dir}"]}


def write_prompts(out: Path, data_dir: Path, n: int, tokenizer_dir: str) -> Path:
    """First turns of each benchmark, rendered as eval.py renders them -> prompts.json {benchmark: [[ids]]}; also
    a data folder of those first turns only, so eval.py decodes exactly these requests."""
    from transformers import AutoTokenizer

    from dspark.evaluation.run_eval import read_benchmark, render_prompt

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts, first = {}, out / "first_turns"
    first.mkdir(parents=True, exist_ok=True)
    for name in BENCHMARKS:
        convs = read_benchmark(data_dir / f"{name}.jsonl", n)
        prompts[name] = [render_prompt(tok, c[0]) for c in convs]
        (first / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [c[0]]}) + "\n" for c in convs))
    path = out / f"prompts_{Path(tokenizer_dir).name}.json"
    path.write_text(json.dumps(prompts))
    return path


def serve(target: str, spec: str, prompts: str, max_new: str, out: str) -> None:
    """One vLLM engine (plain when spec == "none"): greedy token ids per benchmark + spec-decode counters."""
    from vllm import LLM, SamplingParams

    kwargs = {} if spec == "none" else {"speculative_config": json.loads(spec)}
    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True, disable_log_stats=False, max_model_len=2048,
              gpu_memory_utilization=0.5, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_new))
    result = {"outputs": {}}
    for name, ids in json.loads(Path(prompts).read_text()).items():
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        result["outputs"][name] = [list(o.outputs[0].token_ids) for o in outs]
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num"):
            counters[m.name] = counters.get(m.name, 0) + (getattr(m, "value", None) or sum(getattr(m, "values", [])))
    result["counters"] = counters
    Path(out).write_text(json.dumps(result))


def al_from(counters: dict) -> float | None:
    drafts = sum(v for k, v in counters.items() if k.startswith("vllm:spec_decode_num_drafts"))
    acc = sum(v for k, v in counters.items() if k.startswith("vllm:spec_decode_num_accepted_tokens")
              and "per_pos" not in k)
    return None if not drafts else 1 + acc / drafts


def check_case(case: str, args, out: Path) -> dict:
    plan = case_plan(case, out, args.steps)
    case_dir = out / case
    case_dir.mkdir(parents=True, exist_ok=True)
    row: dict = {"case": case, "speculative_config": plan["spec"]}
    if run([sys.executable, "train.py", *plan["train"]], case_dir / "train.log", 1800):
        return {**row, "error": "training failed (train.log)"}
    rc = run([sys.executable, "-m", "dspark.export", *plan["export"]], case_dir / "export.log", 600)
    row["verified"] = rc == 0
    if rc:
        return {**row, "error": "export or verification failed (export.log)"}
    prompts = write_prompts(out, Path(args.data_dir), args.num_prompts, plan["target"])
    for mode in ("plain", "spec"):
        spec = "none" if mode == "plain" else json.dumps(plan["spec"])
        cmd = [sys.executable, __file__, "serve", plan["target"], spec, str(prompts), str(args.max_new_tokens),
               str(case_dir / f"{mode}.json")]
        if run(cmd, case_dir / f"vllm_{mode}.log", 1800):
            return {**row, "error": f"vLLM {mode} failed (vllm_{mode}.log)"}
    plain = json.loads((case_dir / "plain.json").read_text())
    spec = json.loads((case_dir / "spec.json").read_text())
    same = sum(a == b for name in plain["outputs"] for a, b in zip(plain["outputs"][name], spec["outputs"][name]))
    total = sum(len(v) for v in plain["outputs"].values())
    row.update(greedy_equal=f"{same}/{total}", al_vllm=al_from(spec["counters"]), vllm_counters=spec["counters"])
    eval_out = case_dir / "eval"
    rc = run([sys.executable, "eval.py", *plan["eval"], f"data_dir={out / 'first_turns'}", "turns=first",
              f"num_prompts={args.num_prompts}", f"max_new_tokens={args.max_new_tokens}", f"num_drafts={plan['g']}",
              "temperature=0", "device=cuda", "plots=false", "confidence=false", f"out={eval_out}"],
             case_dir / "eval.log", 1800)
    if rc == 0:
        reports = json.loads((eval_out / f"summary.T0.g{plan['g']}.json").read_text())["reports"]
        drafts = sum(r["num_drafts"] for r in reports.values())
        accepted = sum(r["num_accepted_tokens"] for r in reports.values())
        row["al_eval"] = 1 + accepted / drafts if drafts else None
    else:
        row["error"] = "eval.py failed (eval.log)"
    if row.get("al_vllm") and row.get("al_eval"):
        row["al_rel_diff"] = abs(row["al_vllm"] - row["al_eval"]) / row["al_eval"]
    return row


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(*sys.argv[2:6], sys.argv[6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_out/vllm"))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--steps", type=int, default=300, help="training steps of each tiny draft (GPU)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "eval"))
    args = ap.parse_args()
    try:
        import vllm
    except ImportError:
        print("vLLM is not installed: pip install vllm==0.33.0 (CUDA machine)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.cases:
        try:
            row = check_case(case, args, args.out)
        except Exception as err:  # one broken case must not hide the others
            row = {"case": case, "error": f"{type(err).__name__}: {err}"}
        row["vllm"] = vllm.__version__
        rows.append(row)
        with (args.out / "results.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("case", "greedy_equal", "al_vllm", "al_eval", "error")}))
    bad = [r for r in rows if r.get("error") or r.get("greedy_equal", "0/1").split("/")[0] !=
           r.get("greedy_equal", "0/1").split("/")[1]]
    lines = [f"{r['case']:<13} greedy==plain {r.get('greedy_equal')}  AL vLLM {r.get('al_vllm')}  AL eval.py "
             f"{r.get('al_eval')}  {r.get('error') or ''}" for r in rows]
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
