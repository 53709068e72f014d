"""Sizes for training a DeepSeek-V4-Flash DSpark draft from an offline feature cache (README "Training against
DeepSeek-V4-Flash"): feature-cache bytes per token and per 1M tokens for every cache layout, and the draft's size,
all from the real config (configs/draft/dspark_v4_flash.yaml: the V4-Flash target sizes + the released DSpark keys),
the draft built on the meta device (no memory, no weights).

    python benchmarks/v4_flash_sizes.py [--draft dspark_v4_flash] [--assistant-fraction 0.68] [--tokens-per-example 1024]

--assistant-fraction: share of positions whose next token is an assistant token (teacher rows kept by
teacher_rows=assistant); 0.68 is the SmolLM2 regenerated set's (benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="dspark_v4_flash")
    ap.add_argument("--assistant-fraction", type=float, default=0.68)
    ap.add_argument("--tokens-per-example", type=int, default=1024)
    args = ap.parse_args()

    from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
    from dspark.models.registry import config_values

    root = Path(__file__).resolve().parents[1]
    cfg = DSparkV4Config.from_dict(config_values(OmegaConf.load(root / "configs" / "draft" / f"{args.draft}.yaml")))
    cfg.validate()
    with torch.device("meta"):
        draft = DSparkV4Draft(cfg)
    n_params = sum(p.numel() for p in draft.parameters())
    H, n = int(cfg.hidden_size), len(cfg.target_layer_ids)
    f = args.assistant_fraction
    # per-example safetensors header entries (~80 bytes per stored tensor name), spread over its tokens
    hdr = lambda k: 80 * k / args.tokens_per_example  # noqa: E731
    layouts = {
        "plain bfloat16 (default)": (n * H + H) * 2 + hdr(2),
        "plain float32": (n * H + H) * 4 + hdr(2),
        "fp8_e4m3 (scale per row and layer)": (n * H + 4 * n) + (H + 4) + hdr(4),
        "bf16, teacher_rows=assistant": n * H * 2 + f * (H * 2 + 4) + hdr(4),
        "fp8_e4m3, teacher_rows=assistant": (n * H + 4 * n) + f * (H + 4 + 4) + hdr(6),
    }
    out = {
        "draft": args.draft, "hidden_size": H, "target_layer_ids": list(cfg.target_layer_ids),
        "aux_values_per_token": n * H, "final_values_per_token": H,
        "draft_parameters": n_params,
        "draft_bytes_bf16": n_params * 2,
        "draft_training_state_bytes_adamw_fp32_master": n_params * (2 + 4 + 4 + 4),
        "cache": {k: {"bytes_per_token": round(v, 1), "GB_per_1M_tokens": round(v * 1e6 / 1e9, 2)}
                  for k, v in layouts.items()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
