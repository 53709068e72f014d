"""The tiny dense Llama target (target=tiny_llama): shipped, trained on real text like the tiny V4 / HY V4 targets, so
that the tiny dense experiments' tau_prob and AL measure a draft against a model of text, not against noise."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.targets.health import degenerate_warning, distribution_health
from dspark.targets.tiny_llama import TINY_LLAMA_DIR, build_tiny_llama, check_tiny_llama_assets, load_tiny_llama_target
from dspark.targets.tiny_v4 import TINY_V4_DIR

CHAT = [{"role": "user", "content": "Can you explain how a computer works?"},
        {"role": "assistant", "content": "Sure! A computer is a machine that processes information. It has a "
                                         "processor, memory and storage, and it runs programs that tell it what to do."}]


@pytest.fixture(scope="module")
def target():
    return load_tiny_llama_target()


def test_assets_offline_shared_tokenizer_and_small(target):
    cfg = target.model.config
    assert cfg.model_type == "llama" and (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (4, 64, 32)
    tok_v4 = json.loads((TINY_V4_DIR / "tokenizer.json").read_text())
    assert json.loads((TINY_LLAMA_DIR / "tokenizer.json").read_text())["model"]["vocab"] == tok_v4["model"]["vocab"]
    assert target.tokenizer.mask_token_id == cfg.dspark_noise_token_id == 4
    assert (TINY_LLAMA_DIR / "model.safetensors").stat().st_size < 2e6


def test_missing_assets_name_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/build_tiny_llama.py"):
        check_tiny_llama_assets(tmp_path)


def test_trained_on_text(target):
    """Recorded held-out loss well below uniform; measured here: real text scores far better than the same tokens
    shuffled, and the target's distribution on it is not near-uniform (no degenerate-target warning)."""
    info = json.loads((TINY_LLAMA_DIR / "build_info.json").read_text())
    ln_v = math.log(info["vocab_size"])
    assert info["heldout"]["loss"] < ln_v - 2.0
    tok = target.tokenizer
    ids = torch.tensor(tok(tok.apply_chat_template(CHAT, tokenize=False))["input_ids"])[None]  # [1, S]
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]

    def nll(x):
        return torch.nn.functional.cross_entropy(target.logits(x)[0, :-1], x[0, 1:]).item()

    real, rand = nll(ids), nll(shuffled)
    assert real < ln_v - 2.0 and real < rand - 1.0, (real, rand)
    assert degenerate_warning(distribution_health(target.logits(ids)[0])) is None


def test_build_copies_the_shipped_target(tmp_path):
    """build_tiny_llama(path) (the serving checks' and tests' way to get a target folder of their own) gives the
    shipped weights, byte for byte."""
    folder = build_tiny_llama(tmp_path / "t")
    assert (folder / "model.safetensors").read_bytes() == (TINY_LLAMA_DIR / "model.safetensors").read_bytes()
    assert (folder / "config.json").is_file() and (folder / "generation_config.json").is_file()
