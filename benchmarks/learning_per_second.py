"""Learning per CPU-second, before / after, on one machine in one run (benchmarks/README.md, "Learning per CPU-second").

    python benchmarks/learning_per_second.py --draft dspark --data data/regenerated/smollm2_mix_4696.jsonl \
        [--baseline-rev 5f2fd28] [--variants base vocab16k vocab8k anchors32 recipe] [--out runs/lps]

1. The baseline: the experiment's shipped config at `--baseline-rev` (a git worktree of that commit, today's main
   when the change was made) for its `--baseline-steps` (400), timed: wall time W of its training steps.
2. Every variant (this checkout, the same experiment plus its overrides) is timed on `--timing-steps` steps, then
   trained for as many steps as fit in W / `--speedup` (3) at that pace, warmup + cosine over those steps.
3. A table: s/step, loss tokens/s (valid loss rows / s), steps, training seconds, held-out tau_prob and
   agreement at position 0, for every run; written into the output folder (a markdown table and its JSON, table.*) as the
   runs finish.
Every run is resumable (rerun the command: finished runs are read back, a killed one resumes from its last.ckpt).
Runs use trainer.precision=bf16-mixed where the CPU has bf16 units (AVX512-BF16 / AMX), else 32-true.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> overrides on top of the experiment (this checkout); "base" is the shipped config on this checkout
VARIANTS = {
    "init": ["draft.final_norm_init=0.25"],
    "base": [],
    "vocab16k": ["draft.draft_vocab_size=16384"],
    "vocab8k": ["draft.draft_vocab_size=8192"],
    "anchors32": ["train.num_anchors=32"],
    "recipe": ["draft.draft_vocab_size=16384", "train.num_anchors=32", "draft.final_norm_init=0.25"],
}


def precision() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return "bf16-mixed" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "32-true"


def train(cwd: Path, run: Path, overrides: list[str]) -> dict:
    """One train.py run (resumed when it has a last.ckpt, skipped when finished) -> its metrics.json."""
    if not (run / "draft" / "model.safetensors").is_file():
        resume = ["resume=last"] if (run / "checkpoints" / "last.ckpt").exists() else []
        cmd = [sys.executable, "train.py", *overrides, f"run_dir={run}", "trainer.enable_progress_bar=false",
               *resume]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=cwd, check=True)
    return json.loads((run / "metrics.json").read_text())


def row(name: str, steps: int, m: dict) -> dict:
    thr, final = m.get("throughput", {}), m.get("final", {})
    s = thr.get("s_per_step")
    return {"run": name, "steps": steps, "s_per_step": s, "train_s": None if s is None else round(s * steps, 1),
            "loss_tokens_per_s": thr.get("loss_tokens_per_s"), "flops_per_step": thr.get("flops_per_step"),
            "mfu": thr.get("mfu"), "tau_prob": final.get("val/tau_prob"), "agree_0": final.get("val/agree_0"),
            "step0_ce": m.get("step0", {}).get("val/ce")}


def write_table(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    fmt = lambda v, p=3: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| run | steps | s/step | loss tokens/s | training s | held-out tau_prob | agree pos 0 | step-0 CE |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['steps']} | {fmt(r['s_per_step'])} | {fmt(r['loss_tokens_per_s'], 0)} | "
                     f"{fmt(r['train_s'], 0)} | "
                     f"{fmt(r['tau_prob'])} | {fmt(r['agree_0'])} | {fmt(r['step0_ce'], 2)} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", choices=("dspark", "dflash"), default="dspark")
    p.add_argument("--data", required=True, help="data.path of every run (the feature cache is shared)")
    p.add_argument("--baseline-rev", default="5f2fd28")
    p.add_argument("--baseline-steps", type=int, default=400)
    p.add_argument("--speedup", type=float, default=3.0, help="variants get the baseline's time / this")
    p.add_argument("--timing-steps", type=int, default=12)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lps")
    p.add_argument("extra", nargs="*", help="more train.py overrides for every run (after --)")
    a = p.parse_args(argv)
    out = (a.out / a.draft).resolve()
    common = [f"experiment={a.draft}_smollm2", f"data.path={Path(a.data).resolve()}",
              f"trainer.precision={precision()}", *a.extra]
    rows: list[dict] = []

    tree = out / "baseline_tree"
    if not tree.is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), a.baseline_rev], cwd=ROOT, check=True)
    steps = a.baseline_steps
    base = train(tree, out / "baseline", [*common, f"trainer.max_steps={steps}",
                                           f"trainer.val_check_interval={steps // 4}"])
    rows.append(row(f"main@{a.baseline_rev}", steps, base))
    write_table(out, rows)
    budget = base["throughput"]["s_per_step"] * steps / a.speedup

    for name in a.variants:
        over = VARIANTS[name]
        timing = train(ROOT, out / f"{name}_timing", [*common, *over, f"trainer.max_steps={a.timing_steps}",
                                                       f"trainer.val_check_interval={a.timing_steps}",
                                                       "validate_at_start=false"])
        n = max(4, int(budget / timing["throughput"]["s_per_step"]))
        m = train(ROOT, out / name, [*common, *over, f"trainer.max_steps={n}",
                                     f"trainer.val_check_interval={max(1, n // 4)}"])
        rows.append(row(name, n, m))
        write_table(out, rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
