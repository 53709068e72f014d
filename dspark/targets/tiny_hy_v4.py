"""The embedded tiny HY V4 (Hy4, transformers `hy_v4`) target, trained on English ShareGPT, shipped in the package.

The assets (config, bf16-stored safetensors, the tiny_v4 tokenizer, README with the build recipe and
measured numbers, build_info.json) live in ``dspark/assets/tiny_hy_v4/`` and are rebuilt with
``python scripts/build_tiny_hy_v4.py``. Loading is fully offline.

FrozenTarget works unchanged for hy_v4: `features().final` is HYV4Model's last_hidden_state =
norm(hc_head(last layer's iHC streams)), exactly the hidden the HY V4 MTP draft consumes; the decoder
layers output [B, S, hc_mult, H] (a tuple with the DSA top-k indices), which the hooks average over hc.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.targets.assets import TinyTarget
from dspark.targets.hf_target import FrozenTarget

TINY_HY_V4 = TinyTarget("tiny_hy_v4", "tiny HY V4 target", "python scripts/build_tiny_hy_v4.py", "~10 min")
TINY_HY_V4_DIR: Path = TINY_HY_V4.dir
check_tiny_hy_v4_assets = TINY_HY_V4.check
# (model, tokenizer): an HYV4ForCausalLM and the tiny_v4 tokenizer
load_tiny_hy_v4 = TINY_HY_V4.load


def load_tiny_hy_v4_target(
    path: str | Path = TINY_HY_V4_DIR,
    layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> FrozenTarget:
    """The tiny HY V4 as a FrozenTarget. layer_ids (aux features) default to the last layer; an MTP draft reads
    only `final`."""
    model, tokenizer = load_tiny_hy_v4(path, dtype, device)
    ids = [model.config.num_hidden_layers - 1] if layer_ids is None else list(layer_ids)
    return FrozenTarget(model, ids, tokenizer)


__all__ = ["TINY_HY_V4", "TINY_HY_V4_DIR", "check_tiny_hy_v4_assets", "load_tiny_hy_v4", "load_tiny_hy_v4_target"]
