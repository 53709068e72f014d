"""The embedded default target: a tiny DeepSeek-V4 trained on English ShareGPT, shipped in the package.

The assets (config, bf16-stored safetensors, tokenizer with a ChatML template, README with the
build recipe and measured numbers) live in ``dspark/assets/tiny_v4/`` and are rebuilt with
``python scripts/build_tiny_target.py``. Loading is fully offline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.targets.assets import asset_dir, check_assets, load_causal_lm

BUILD_COMMAND = "python scripts/build_tiny_target.py"
MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKEN = "<|im_end|>"
TINY_V4_DIR: Path = asset_dir("tiny_v4")


def check_tiny_v4_assets(path: str | Path = TINY_V4_DIR) -> Path:
    """Return ``path`` if it holds a complete tiny target, else raise FileNotFoundError with the rebuild command."""
    return check_assets(path, "tiny DeepSeek-V4 target", BUILD_COMMAND, "~7 min")


def load_tiny_v4(
    path: str | Path = TINY_V4_DIR,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Load the tiny DeepSeek-V4 target and its tokenizer, offline, in eval mode with grads off.

    Returns:
        ``(model, tokenizer)``: a ``DeepseekV4ForCausalLM`` (``model.model.layers[i]`` outputs
        ``[B, S, hc_mult, H]``) and a fast tokenizer with a ChatML ``chat_template``;
        ``tokenizer.mask_token_id`` (== ``model.config.dspark_noise_token_id``) is the DSpark noise token.
    """
    return load_causal_lm(check_tiny_v4_assets(path), dtype, device)
