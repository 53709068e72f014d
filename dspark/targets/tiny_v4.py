"""The embedded default target: a tiny DeepSeek-V4 trained on English ShareGPT, shipped in the package.

The assets (config, bf16-stored safetensors, tokenizer with a ChatML template, README with the
build recipe and measured numbers) live in ``dspark/assets/tiny_v4/`` and are rebuilt with
``python scripts/build_tiny_target.py``. Loading is fully offline.
"""

from __future__ import annotations

from pathlib import Path

from dspark.targets.assets import TinyTarget

MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKEN = "<|im_end|>"
TINY_V4 = TinyTarget("tiny_v4", "tiny DeepSeek-V4 target", "python scripts/build_tiny_target.py", "~7 min")
TINY_V4_DIR: Path = TINY_V4.dir
check_tiny_v4_assets = TINY_V4.check
# (model, tokenizer): a DeepseekV4ForCausalLM (model.model.layers[i] outputs [B, S, hc_mult, H]) and its tokenizer
load_tiny_v4 = TINY_V4.load
