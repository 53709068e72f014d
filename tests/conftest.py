"""Shared fixtures: Hydra config composition for end-to-end runs, an isolated dataset cache."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: see train.py

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Small enough for 2 CPU cores: a handful of steps on ~100 ShareGPT conversations.
TINY_RUN = [
    "data.limit=160", "data.val_examples=8", "data.max_length=128",
    "train.batch_size=4", "train.val_batch_size=8", "train.num_anchors=4",
    "train.max_steps=6", "train.val_every_steps=3", "train.ckpt_every_steps=1",
    "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "validate_at_start=false",
    "draft.num_layers=1",
]


@pytest.fixture(scope="session", autouse=True)
def _dataset_cache(tmp_path_factory):
    """One tokenized-dataset cache per test session (never the user's ~/.cache)."""
    if "DSPARK_CACHE" not in os.environ:
        os.environ["DSPARK_CACHE"] = str(tmp_path_factory.mktemp("dspark_cache"))
    yield


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def tiny_v4_config(**overrides):
    """A 3-layer DeepSeek-V4 small enough for hand-sized tests (sliding attention + MoE, hc 2, topk_method
    "noaux_tc" as released V4 configs: vLLM builds the gate bias only then)."""
    from transformers import DeepseekV4Config

    keys = dict(vocab_size=50, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=2,
                head_dim=8, partial_rotary_factor=0.5, q_lora_rank=8, o_groups=1, o_lora_rank=4, n_routed_experts=2,
                num_experts_per_tok=1, hc_mult=2, sliding_window=4, layer_types=["sliding_attention"] * 3,
                mlp_layer_types=["moe"] * 3, topk_method="noaux_tc")
    keys.update(overrides)
    return DeepseekV4Config(**keys)
