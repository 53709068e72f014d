"""The tiny dense target (target=tiny_llama): a 4-layer Llama (hidden 64, head_dim 32: vLLM's CPU attention needs
>= 32) with the tiny V4 tokenizer and ChatML template, trained on English ShareGPT like the tiny V4 / HY V4 targets, so
that the dense drafts' tiny experiments (dflash2_tiny, eagle3_tiny, xpress_tiny) measure a draft against a model of
text, not against noise. (The vLLM parity checks' sampled tests need a flat target: they build a random one,
dspark.serving.tiny_dense.build_random_tiny_llama.)

The assets (config, bf16-stored safetensors, the tiny_v4 tokenizer, README with the build recipe and measured numbers,
build_info.json) live in ``dspark/assets/tiny_llama/`` and are rebuilt with ``python scripts/build_tiny_llama.py``
(about 5 minutes on one core). Loading is fully offline.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dspark.targets.assets import TinyTarget
from dspark.targets.hf_target import FrozenTarget

TINY_LLAMA = TinyTarget("tiny_llama", "tiny dense Llama target", "python scripts/build_tiny_llama.py", "~5 min")
TINY_LLAMA_DIR: Path = TINY_LLAMA.dir
check_tiny_llama_assets = TINY_LLAMA.check
# (model, tokenizer): a LlamaForCausalLM and the tiny_v4 tokenizer
load_tiny_llama = TINY_LLAMA.load


def load_tiny_llama_target(path: str | Path = TINY_LLAMA_DIR, layer_ids: list[int] | None = None,
                           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> FrozenTarget:
    """The tiny dense Llama as a FrozenTarget; layer_ids (aux features) default to [0, 2], the dense drafts' taps."""
    model, tokenizer = load_tiny_llama(path, dtype, device)
    return FrozenTarget(model, [0, 2] if layer_ids is None else list(layer_ids), tokenizer)


def tiny_llama_folder() -> Path:
    """The tiny dense Llama as a target folder (target=tiny_llama): the shipped one, checked complete."""
    return check_tiny_llama_assets()


def build_tiny_llama(path: Path) -> Path:
    """A copy of the shipped tiny dense Llama in `path` (a folder of its own: the serving checks and tests write next to
    it or change it); the same bytes on every machine, so the same weight fingerprint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in sorted(tiny_llama_folder().iterdir()):
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


__all__ = ["TINY_LLAMA", "TINY_LLAMA_DIR", "build_tiny_llama", "check_tiny_llama_assets", "load_tiny_llama",
           "load_tiny_llama_target", "tiny_llama_folder"]
