"""The tiny dense target (target=tiny_llama): a seeded random 4-layer Llama (hidden 64, head_dim 32: vLLM's CPU
attention needs >= 32), vocabulary 2048, with the shipped tiny V4 tokenizer and ChatML template, saved as an HF
folder. Random weights: its next-token distribution is near-uniform (train and eval say so, dspark.targets.health);
it is the target of the serving parity checks and of experiment=dflash2_tiny, not a model of text."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from dspark.targets.tiny_v4 import TINY_V4_DIR

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(TINY_V4_DIR) / f, path / f)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, initializer_range=0.05,
                      max_position_embeddings=2048, bos_token_id=0, eos_token_id=[3, 0], pad_token_id=1,
                      tie_word_embeddings=False)
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # built silently on first use (a config check may trigger it before refusing)
    try:
        LlamaForCausalLM(cfg).save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()
    GenerationConfig(do_sample=False, eos_token_id=[3, 0], pad_token_id=1).save_pretrained(path)
    return path


def tiny_llama_folder(cache_dir: Path | None = None) -> Path:
    """The tiny dense Llama as a target folder (target=tiny_llama): built once, seed 0, into the dspark cache
    ($DSPARK_CACHE or ~/.cache/dspark)/tiny_llama, through a staging folder renamed into place (a killed build leaves
    nothing half-written). The build is deterministic, so every machine gets the same weights (and fingerprint)."""
    from dspark.targets.gguf_convert import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "tiny_llama"
    if (final / "config.json").is_file():
        return final
    staging = root / f".tiny_llama.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_llama(staging)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(staging, ignore_errors=True)
    return final
