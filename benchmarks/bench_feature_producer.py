"""Feature-cache producer speed, HF (transformers in this process) vs vLLM (extract_hidden_states in its venv), in
ONE run on the same rows, and the largest difference between the two caches.

    python benchmarks/bench_feature_producer.py --target ~/.cache/dspark/smollm2-135m-instruct \
        --layers 1 8 15 22 29 --rows 64 --threads 2 [--dataset DIR_OF_A_TOKENIZED_DATASET]

Rows: the first --rows of a tokenized dataset saved by `datasets` (`input_ids` column), else random token ids of the
same lengths as --lengths. Prints one JSON line: tokens, seconds and tokens/s per producer (vLLM also without its
engine start), their ratio, and max |vLLM - HF| per tensor.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--layers", type=int, nargs="+", required=True)
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--vllm-batch", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--python", default=None)
    args = ap.parse_args()

    import datasets

    from dspark.data.feature_cache import FeatureCache, build_feature_cache
    from dspark.serving.vllm_features import build_feature_cache_vllm
    from dspark.targets.hf_target import load_hf_target

    torch.set_num_threads(args.threads)
    if args.dataset:
        rows = datasets.load_from_disk(args.dataset).select(range(args.rows)).select_columns(["input_ids"])
    else:
        g = torch.Generator().manual_seed(0)
        rows = datasets.Dataset.from_dict({"input_ids": [torch.randint(10, 1000, (int(n),), generator=g).tolist()
                                                         for n in torch.randint(64, 512, (args.rows,), generator=g)]})
    tokens = sum(len(r) for r in rows["input_ids"])
    out: dict = {"target": args.target, "rows": len(rows), "tokens": tokens, "threads": args.threads,
                 "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        target = load_hf_target(args.target, args.layers, args.dtype)
        t1 = time.perf_counter()
        build_feature_cache(target, rows, Path(tmp) / "hf", batch_size=args.hf_batch, dtype=torch.float32)
        t2 = time.perf_counter()
        out["hf"] = {"load_s": round(t1 - t0, 2), "features_s": round(t2 - t1, 2),
                     "tokens_per_s": round(tokens / (t2 - t1), 1)}
        del target
        stats: dict = {}
        t3 = time.perf_counter()
        build_feature_cache_vllm(args.target, args.layers, rows, Path(tmp) / "vllm", target_dtype=args.dtype,
                                 dtype=torch.float32, batch_size=args.vllm_batch, python=args.python,
                                 threads=args.threads, stats=stats)
        t4 = time.perf_counter()
        out["vllm"] = {"total_s": round(t4 - t3, 2), "engine_start_s": round(stats["engine_s"], 2),
                       "extract_s": round(stats["extract_s"], 2),
                       "tokens_per_s_extract": round(tokens / stats["extract_s"], 1),
                       "tokens_per_s_total": round(tokens / (t4 - t3), 1)}
        out["vllm_over_hf_tokens_per_s"] = round(out["vllm"]["tokens_per_s_extract"] / out["hf"]["tokens_per_s"], 3)
        a, b = FeatureCache(Path(tmp) / "hf"), FeatureCache(Path(tmp) / "vllm")
        d_aux = d_fin = m_aux = m_fin = 0.0
        ulps = {"aux": 0.0, "final": 0.0}  # max over examples of max|diff| / (eps32 * max|ref|) of that example
        eps = torch.finfo(torch.float32).eps
        for i in range(len(a)):
            (x1, f1), (x2, f2) = a.get(i), b.get(i)
            d_aux, d_fin = max(d_aux, (x1 - x2).abs().max().item()), max(d_fin, (f1 - f2).abs().max().item())
            m_aux, m_fin = max(m_aux, x1.abs().max().item()), max(m_fin, f1.abs().max().item())
            ulps["aux"] = max(ulps["aux"], (x1 - x2).abs().max().item() / (eps * x1.abs().max().item()))
            ulps["final"] = max(ulps["final"], (f1 - f2).abs().max().item() / (eps * f1.abs().max().item()))
        out["max_abs_diff"] = {"aux": d_aux, "final": d_fin}
        out["max_abs_ref"] = {"aux": m_aux, "final": m_fin}
        out["max_diff_in_ulps_of_example_scale"] = {k: round(v, 1) for k, v in ulps.items()}
        out["same_key"] = a.meta["key"] == b.meta["key"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
