"""Real-size DeepSeek-V4 Flash / Pro DSpark drafts on the meta device: shapes, names, parameter counts."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dspark.models.registry import config_values as draft_fields
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "draft"


def _values(name: str) -> dict:
    """The draft group YAML as DSparkV4Config keyword arguments (draft keys + arch), as train.py reads it."""
    return draft_fields(OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"), resolve=True))


def _load(name: str) -> DSparkV4Config:
    return DSparkV4Config.from_dict(_values(name)).validate()


def _formula_count(c: dict) -> int:
    """Parameter count written out from the DeepSeek-V4 block structure (independent of the model code)."""
    H, hc, nh, D = c["hidden_size"], c["hc_mult"], c["num_attention_heads"], c["head_dim"]
    E, I, r, V = c["n_routed_experts"], c["moe_intermediate_size"], c["markov_rank"], c["vocab_size"]
    q_lora, groups, o_lora = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    mhc = (2 + hc) * hc * (hc * H) + (2 + hc) * hc + 3  # fn + base + scale
    attention = (
        H * q_lora + q_lora  # wq_a, q_norm
        + q_lora * nh * D  # wq_b
        + H * D + D  # wkv, kv_norm
        + groups * o_lora * (nh * D // groups)  # wo_a (block diagonal)
        + groups * o_lora * H  # wo_b
        + nh  # attn_sink
    )
    moe = E * H + E + E * 3 * H * I + c["n_shared_experts"] * 3 * H * I
    layer = attention + moe + 2 * H + 2 * mhc
    model_level = (
        len(c["target_layer_ids"]) * H * H + H  # main_proj, main_norm
        + H  # norm
        + hc * hc * H + hc + 1  # hc_head
        + V * r + V * r  # markov w1, w2
        + (H + r)  # confidence (no bias)
    )
    return c["num_layers"] * layer + model_level


@pytest.mark.parametrize(
    "name,expect",
    [
        ("dspark_v4_flash", dict(hidden_size=4096, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
                                 n_routed_experts=256, moe_intermediate_size=2048, markov_rank=256,
                                 target_layer_ids=[40, 41, 42], mask_token_id=128799, block_size=5)),
        ("dspark_v4_pro", dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
                               n_routed_experts=384, moe_intermediate_size=3072, markov_rank=512,
                               target_layer_ids=[58, 59, 60])),
    ],
)
def test_real_size_on_meta(name, expect):
    cfg = _load(name)
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key
    with torch.device("meta"):
        draft = DSparkV4Draft(cfg)
    shapes = {n: tuple(p.shape) for n, p in draft.state_dict().items()}
    H, hc, nh, D, E = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim, cfg.n_routed_experts
    r, V, G, R, I = cfg.markov_rank, cfg.vocab_size, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    expected_shapes = {
        "main_proj.weight": (H, 3 * H),
        "main_norm.weight": (H,),
        "norm.weight": (H,),
        "hc_head_fn": (hc, hc * H),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
        "markov_head.markov_w1.weight": (V, r),
        "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r),
        "layers.2.attn.wq_a.weight": (cfg.q_lora_rank, H),
        "layers.2.attn.q_norm.weight": (cfg.q_lora_rank,),
        "layers.2.attn.wq_b.weight": (nh * D, cfg.q_lora_rank),
        "layers.2.attn.wkv.weight": (D, H),
        "layers.2.attn.kv_norm.weight": (D,),
        "layers.2.attn.wo_a.weight": (G * R, nh * D // G),
        "layers.2.attn.wo_b.weight": (H, G * R),
        "layers.2.attn.attn_sink": (nh,),
        "layers.2.attn_norm.weight": (H,),
        "layers.2.ffn_norm.weight": (H,),
        "layers.2.hc_attn_fn": ((2 + hc) * hc, hc * H),
        "layers.2.hc_attn_base": ((2 + hc) * hc,),
        "layers.2.hc_attn_scale": (3,),
        "layers.2.hc_ffn_fn": ((2 + hc) * hc, hc * H),
        "layers.2.ffn.gate.weight": (E, H),
        "layers.2.ffn.gate.bias": (E,),
        f"layers.2.ffn.experts.{E - 1}.w1.weight": (I, H),
        f"layers.2.ffn.experts.{E - 1}.w2.weight": (H, I),
        f"layers.2.ffn.experts.{E - 1}.w3.weight": (I, H),
        "layers.2.ffn.shared_experts.w1.weight": (I, H),
        "layers.2.ffn.shared_experts.w2.weight": (H, I),
        "layers.2.ffn.shared_experts.w3.weight": (I, H),
    }
    for key, shape in expected_shapes.items():
        assert shapes[key] == shape, key
    assert "layers.3.attn.wkv.weight" not in shapes and f"layers.0.ffn.experts.{E}.w1.weight" not in shapes
    assert not any("embed" in n or "lm_head" in n for n in shapes)
    # Every layer tensor is one of the serving names.
    layer_suffixes = {n.split(".", 2)[2] for n in shapes if n.startswith("layers.")}
    serving = {
        "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight",
        "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink", "attn_norm.weight", "ffn_norm.weight",
        "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
        "ffn.gate.weight", "ffn.gate.bias",
        *(f"ffn.shared_experts.w{k}.weight" for k in (1, 2, 3)),
        *(f"ffn.experts.{e}.w{k}.weight" for e in range(E) for k in (1, 2, 3)),
    }
    assert layer_suffixes == serving
    # fp32 tensors as in the checkpoint.
    assert draft.layers[0].hc_attn_fn.dtype == torch.float32 and draft.layers[0].ffn.gate.bias.dtype == torch.float32

    n_params = sum(p.numel() for p in draft.parameters())
    assert n_params == _formula_count(_values(name))
    assert n_params == sum(t.numel() for t in draft.state_dict().values())


def test_yaml_keys_are_exactly_the_config_fields():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(DSparkV4Config)}
    for name in ("dspark_v4_flash", "dspark_v4_pro"):
        assert set(_values(name)) == fields, name


def test_from_dict_rejects_unknown_and_missing_keys():
    values = _values("dspark_v4_flash")
    with pytest.raises(ValueError, match="markov_rnak"):
        DSparkV4Config.from_dict({**values, "markov_rnak": 3})
    values.pop("hidden_size")
    with pytest.raises(ValueError, match="hidden_size"):
        DSparkV4Config.from_dict(values)
