#!/usr/bin/env python
"""Regeneration speed of every engine on the same prompts in one run: records/min, answer tokens/s, and the
fraction of this CPU's decode limit.

    python benchmarks/bench_regenerate.py --target smollm2 --limit 128 --max-new-tokens 128 --threads 1 \
        --engines hf native --out /tmp/regen_bench

Every engine answers the same first `--limit` ShareGPT first user turns (English, <= --max-prompt-chars) with the
same sampling (T, top-p, seed) through `regenerate()` (the same bookkeeping), each into its own fresh file:
`hf` = transformers' generate in float32, batches of --hf-batch-size (the README's command before the native
engine), `hf-bf16` the same in bfloat16, `native` = scripts/regenerate.py's default (dspark.data.fast_decode,
dtype from the CPU, --native-rows rows), `vllm` / `vllm-bf16` = vLLM's offline engine (its own venv) in
float32 / bfloat16. Start-up (model load, the
kernel build) is timed apart from generation. The decode limit: one pass of the model's GEMMs at
[--native-rows, H] (every layer's fused QKV, O, gate/up and down, and the LM head) in the native engine's dtype,
timed in-process: rows / that time is the tokens/s no decoder of this model can beat on this core at that batch;
the native engine's step is also profiled (--profile-steps) to say where its time goes. Prints and appends one JSON
line to OUT/results.jsonl.
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


def decode_limit(model, rows: int, repeats: int = 5) -> dict:
    """Tokens/s of the model's GEMMs alone at [rows, H] (no attention, norms or sampling): the decode ceiling."""
    import torch
    import torch.nn.functional as F

    from dspark.data.fast_decode import _layer_of

    layers = [_layer_of(block) for block in model.model.layers]
    dtype = model.lm_head.weight.dtype
    x = torch.randn(rows, model.config.hidden_size, dtype=dtype)
    inter = torch.randn(rows, model.config.intermediate_size, dtype=dtype)

    def one_pass():
        for layer in layers:
            q = F.linear(x, layer.qkv)
            F.linear(q[:, : layer.o.shape[1]], layer.o)
            F.linear(x, layer.gate_up)
            F.linear(inter, layer.down)
        F.linear(x, model.lm_head.weight)

    flop = 2 * rows * (sum(layer.qkv.numel() + layer.o.numel() + layer.gate_up.numel() + layer.down.numel()
                           for layer in layers) + model.lm_head.weight.numel())
    with torch.inference_mode():
        one_pass()
        t0 = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        dt = (time.perf_counter() - t0) / repeats
    return {"rows": rows, "dtype": str(dtype).removeprefix("torch."), "gemm_s_per_step": round(dt, 4),
            "gemm_gflops": round(flop / dt / 1e9, 1), "gflop_per_token": round(flop / rows / 1e9, 3),
            "tokens_per_s": round(rows / dt, 1)}


def profile_steps(model, tok, rows: int, steps: int) -> dict:
    """Where a native decode step's time goes: matrix products, the attention kernel, the rest (torch profiler)."""
    import torch
    from torch.profiler import profile

    from dspark.data.fast_decode import ContinuousDecoder

    dec = ContinuousDecoder(model, slots=rows, max_len=512, stop_ids=[tok.eos_token_id])
    prompt = list(range(100, 300))
    for slot in range(rows):
        dec.prefill(slot, prompt)
    tokens, pos, idx = torch.full((rows,), 500), torch.full((rows,), len(prompt)), torch.arange(rows)
    dec.step(tokens, pos, idx)
    with profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step(tokens, pos, idx)
        step_s = (time.perf_counter() - t0) / steps
    by_op = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(by_op.values())
    gemm = sum(v for k, v in by_op.items() if k in ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm"))
    attention = sum(v for k, v in by_op.items() if "decode_attention" in k)
    return {"rows": rows, "context": len(prompt), "step_s": round(step_s, 4),
            "share_gemm": round(gemm / total, 3), "share_attention_kernel": round(attention / total, 3),
            "share_other": round(1 - (gemm + attention) / total, 3),
            "top_ops": sorted(((k, round(v / total, 3)) for k, v in by_op.items()), key=lambda kv: -kv[1])[:6]}


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
    ap.add_argument("--native-rows", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--engines", nargs="+", default=["hf", "native"], choices=["hf", "hf-bf16", "native", "vllm", "vllm-bf16"])
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
        if engine in ("hf", "hf-bf16"):
            dtype = torch.float32 if engine == "hf" else torch.bfloat16
            gen = HFGenerator(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), tok, device="cpu")
            batch = args.hf_batch_size
        elif engine == "native":
            from dspark.cpu import fast_cpu_dtype
            from dspark.data.native_generator import NativeGenerator
            from dspark.ops.decode_attention import _load

            dtype = getattr(torch, fast_cpu_dtype().dtype)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            _load()  # the attention kernel's build (cached after the first run) counts as start-up
            gen = NativeGenerator(model, tok, None, slots=args.native_rows, max_model_len=2048)
            batch = args.native_rows
            result["decode_limit"] = decode_limit(model, args.native_rows)
            result["native_step_profile"] = profile_steps(model, tok, args.native_rows, args.profile_steps)
        else:
            from dspark.serving.vllm_generator import VLLMGenerator

            gen = VLLMGenerator(folder, python=None, log_path=args.out / f"{engine}.{stamp}.log",
                                max_model_len=2048 + args.max_new_tokens, threads=args.threads,
                                dtype="bfloat16" if engine == "vllm-bf16" else "float32")
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
    engines = result["engines"]
    for name, entry in engines.items():
        if "hf" in engines:
            entry["tokens_per_s_over_hf"] = round(entry["tokens_per_s"] / engines["hf"]["tokens_per_s"], 2)
        if "decode_limit" in result:
            entry["fraction_of_decode_limit"] = round(entry["tokens_per_s"] / result["decode_limit"]["tokens_per_s"], 3)
    with open(args.out / "results.jsonl", "a") as fh:
        fh.write(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "engines"}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
