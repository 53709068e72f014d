#!/usr/bin/env python
"""Regeneration speed, HF backend vs vLLM, on the same prompts in one run: records/min and generated tokens/s.

    python benchmarks/bench_regenerate.py --target smollm2 --limit 48 --max-new-tokens 192 --out /tmp/regen_bench

Both engines answer the same first `--limit` ShareGPT first user turns (English, <= --max-prompt-chars) with the
same sampling (T, top-p, seed) through `regenerate()` (the same bookkeeping), each into its own fresh file; the
HF backend in batches of --hf-batch-size, vLLM with --vllm-batch-size records per call. Engine start-up (model
load; for vLLM the worker and engine) is timed separately from generation. Prints and appends one JSON line to
OUT/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _records(limit: int, max_chars: int) -> list[dict]:
    from dspark.data.sharegpt import iter_sharegpt

    out = []
    for rec in iter_sharegpt(english_only=True):
        users = [m for m in rec["messages"] if m["role"] == "user"][:1]
        if users and len(users[0]["content"]) <= max_chars:
            out.append({"id": rec["id"], "messages": users})
        if len(out) == limit:
            return out
    return out


def _tokens(path: Path, tokenizer) -> int:
    from dspark.data.regenerate import read_jsonl_state

    return sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
               for r in read_jsonl_state(path, repair=False) for m in r["messages"] if m["role"] == "assistant")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-prompt-chars", type=int, default=1200)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--vllm-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both engines (default: torch's)")
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--out", type=Path, default=Path("regen_bench"))
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark.data.hf_generator import HFGenerator
    from dspark.data.regenerate import regenerate

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.target
    if folder == "smollm2":
        from dspark.targets.gguf_convert import prepare_smollm2

        folder = str(prepare_smollm2())
    records = _records(args.limit, args.max_prompt_chars)
    tok = AutoTokenizer.from_pretrained(folder)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result = {"target": folder, "records": len(records), "sampling": sampling, "threads": torch.get_num_threads(),
              "engines": {}}
    for engine in args.engines:
        out = args.out / f"{engine}.{stamp}.jsonl"
        t0 = time.perf_counter()
        if engine == "hf":
            gen = HFGenerator(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tok, device="cpu")
            batch = args.hf_batch_size
        else:
            from dspark.serving.vllm_generator import VLLMGenerator

            gen = VLLMGenerator(folder, python=None, log_path=args.out / f"vllm.{stamp}.log",
                                max_model_len=2048 + args.max_new_tokens, threads=args.threads)
            batch = args.vllm_batch_size
        start_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        stats = regenerate(records, gen, out, batch_size=batch, **sampling)
        gen_s = time.perf_counter() - t1
        if hasattr(gen, "close"):
            gen.close()
        n_tok = _tokens(out, tok)
        result["engines"][engine] = {"batch_size": batch, "startup_s": round(start_s, 1), "generate_s": round(gen_s, 1),
                                     "done": stats.done, "failed": stats.failed,
                                     "records_per_min": round(60 * stats.done / gen_s, 2),
                                     "tokens_per_s": round(n_tok / gen_s, 1), "answer_tokens": n_tok,
                                     "versions": getattr(gen, "versions", None), "file": str(out)}
        print(engine, json.dumps(result["engines"][engine]), flush=True)
    if {"hf", "vllm"} <= set(result["engines"]):
        h, v = result["engines"]["hf"], result["engines"]["vllm"]
        result["vllm_over_hf_records_per_min"] = round(v["records_per_min"] / h["records_per_min"], 2)
    with open(args.out / "results.jsonl", "a") as fh:
        fh.write(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "engines"}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
