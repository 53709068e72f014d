"""The tiny DeepSeek-V4.1 target: the tiny V4's weights run with V4.1's mHC (dspark.targets.v41), shipped in
``dspark/assets/tiny_v41/`` and rebuilt with ``python scripts/build_tiny_v41_target.py``. Loading is offline."""

from __future__ import annotations

from pathlib import Path

from dspark.targets.assets import TinyTarget

TINY_V41 = TinyTarget("tiny_v41", "tiny DeepSeek-V4.1 target", "python scripts/build_tiny_v41_target.py", "~10 s")
TINY_V41_DIR: Path = TINY_V41.dir
load_tiny_v41 = TINY_V41.load  # (DeepseekV41ForCausalLM, tokenizer)
