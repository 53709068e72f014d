"""Compact feature-cache layouts on SmolLM2 features: bytes per token of each layout, and held-out tau_prob after the
same training budget on the plain bf16 cache vs a compact one.

    python benchmarks/bench_compact_cache.py --dataset DIR --rows 400 --steps 300 --out /tmp/compact \
        [--producer vllm|hf] [--train plain_bf16 fp8_rows] [--seed 0] [--tag _x]

DIR: a tokenized dataset saved by `datasets` (input_ids + loss_mask rows, e.g. the SmolLM2 regenerated set under
$DSPARK_CACHE/chat_datasets/); its first --rows rows are used as the training data (the last 64 held out). One float32
cache is computed once (by --producer), every layout is converted from it (`convert_feature_cache`, bitwise what a
build with that layout writes), then `experiment=dspark_smollm2` trains on the layouts named by --train, with the rows
handed to train.py's code directly. Prints one JSON object and writes it to OUT/compact.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

LAYOUTS = {
    "plain_f32": ({}, "float32"),
    "plain_bf16": ({}, "bfloat16"),
    "fp8": ({"encoding": "fp8_e4m3"}, "bfloat16"),
    "teacher_assistant_bf16": ({"teacher_rows": "assistant"}, "bfloat16"),
    "context_anchored_bf16": ({"context_rows": "anchored"}, "bfloat16"),
    "rows_bf16": ({"teacher_rows": "assistant", "context_rows": "anchored"}, "bfloat16"),
    "fp8_rows": ({"encoding": "fp8_e4m3", "teacher_rows": "assistant", "context_rows": "anchored"}, "bfloat16"),
}


def _losses(run_dir: Path) -> dict[int, float]:
    import csv

    out = {}
    for version in sorted((run_dir / "logs").glob("version_*")):
        with open(version / "metrics.csv") as fh:
            out.update({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", required=True)
    ap.add_argument("--producer", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--train", nargs="*", default=["plain_bf16", "fp8_rows"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the run folders and the report name")
    args = ap.parse_args()

    import datasets
    from hydra import compose, initialize_config_dir

    import dspark.factory as factory
    from dspark.data.feature_cache import CacheLayout, FeatureCache, build_feature_cache, convert_feature_cache
    from dspark.training.run import run_training

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / f"compact{args.tag}.json"
    rows = datasets.load_from_disk(args.dataset).select(range(args.rows))
    tokens = sum(len(x) for x in rows["input_ids"])
    report: dict = {"dataset": args.dataset, "rows": len(rows), "tokens": tokens,
                    "assistant_tokens": sum(sum(x) for x in rows["loss_mask"]), "layouts": {}, "training": {}}
    from dspark.data.dataset import default_cache_dir

    target_dir = default_cache_dir() / "smollm2-135m-instruct"
    layers = [1, 8, 15, 22, 29]
    src = out / "cache_plain_f32"
    t0 = time.perf_counter()
    if args.producer == "vllm":
        from dspark.serving.vllm_features import build_feature_cache_vllm

        build_feature_cache_vllm(target_dir, layers, rows, src, target_dtype="float32", dtype=torch.float32,
                                 threads=2)
    else:
        from dspark.targets.hf_target import load_hf_target

        build_feature_cache(load_hf_target(str(target_dir), layers, "float32"), rows, src, dtype=torch.float32,
                            batch_size=8)
    report["source_build_s"] = round(time.perf_counter() - t0, 1)
    for name, (lay, dt) in LAYOUTS.items():
        path = src if name == "plain_f32" else convert_feature_cache(
            src, rows, out / f"cache_{name}", layout=CacheLayout(**lay), dtype=getattr(torch, dt))
        c = FeatureCache(path)
        report["layouts"][name] = {"layout": CacheLayout(**lay).as_dict(), "dtype": dt, "bytes": c.nbytes,
                                   "bytes_per_token": round(c.nbytes / tokens, 1), "path": str(path)}
    base = report["layouts"]["plain_bf16"]["bytes_per_token"]
    for v in report["layouts"].values():
        v["vs_plain_bf16"] = round(v["bytes_per_token"] / base, 3)

    # training: train.py's code on these rows (the dataset step is handed the rows; the data file is a stub)
    factory.build_dataset = lambda data, tokenizer: rows
    stub = out / "stub.jsonl"
    stub.write_text("")
    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in args.train:
        lay, dt = LAYOUTS[name]
        overrides = ["experiment=dspark_smollm2", f"data.path={stub}", f"data.feature_cache={out / f'cache_{name}'}",
                     f"data.feature_cache_dtype={dt}", f"trainer.max_steps={args.steps}",
                     f"trainer.val_check_interval={max(1, args.steps // 3)}",
                     f"callbacks.last_checkpoint.every_n_train_steps={args.steps}",
                     "trainer.enable_progress_bar=false", f"seed={args.seed}",
                     f"run_dir={out / f'run_{name}{args.tag}'}"]
        overrides += [f"data.feature_cache_layout.{k}={v}" for k, v in lay.items()]
        with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        t1 = time.perf_counter()
        s = run_training(cfg)
        report["training"][name] = {"tau_prob": s["final"].get("val/tau_prob"),
                                    "tau_prob_step0": s.get("step0", {}).get("val/tau_prob"),
                                    "loss": s["final"].get("val/loss"), "seconds": round(time.perf_counter() - t1, 1),
                                    "steps": s["global_step"], "seed": args.seed,
                                    "train_losses": _losses(out / f"run_{name}{args.tag}")}
        report_path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    report_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
