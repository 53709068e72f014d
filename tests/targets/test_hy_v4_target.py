"""Tiny HY V4 target (shipped, trained on text) and the real-size Hy4 config on the meta device."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import HYV4Config, HYV4ForCausalLM
from transformers.models.hy_v4.modeling_hy_v4 import HYV4DecoderLayer

from dspark.models import hy_v4_names
from dspark.models.hy_v4_mtp import HYV4MTPConfig, HYV4MTPDraft
from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR, check_tiny_hy_v4_assets, load_tiny_hy_v4_target
from dspark.targets.tiny_v4 import TINY_V4_DIR


@pytest.fixture(scope="module")
def target():
    return load_tiny_hy_v4_target()


def test_assets_offline_and_shared_tokenizer(target):
    cfg = target.model.config
    assert cfg.model_type == "hy_v4" and type(target.model).__name__ == "HYV4ForCausalLM"
    assert cfg.hc_mult > 1  # the target itself runs iHC
    tok_v4 = json.loads((TINY_V4_DIR / "tokenizer.json").read_text())
    tok_hy = json.loads((TINY_HY_V4_DIR / "tokenizer.json").read_text())
    assert tok_hy["model"]["vocab"] == tok_v4["model"]["vocab"]  # loaded, not retrained
    assert target.tokenizer.mask_token == "<|mask|>" and target.tokenizer.mask_token_id == cfg.dspark_noise_token_id
    assert (TINY_HY_V4_DIR / "model.safetensors").stat().st_size < 8e6


def test_missing_assets_name_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/build_tiny_hy_v4.py"):
        check_tiny_hy_v4_assets(tmp_path)


def test_trained_on_text(target):
    """Recorded held-out loss well below uniform, and the model predicts real held-out-style text better than
    shuffled tokens of the same text (a direct measurement, not the recorded number)."""
    info = json.loads((TINY_HY_V4_DIR / "build_info.json").read_text())
    ln_v = math.log(info["vocab_size"])
    assert info["heldout"]["loss"] < ln_v - 2.0
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Can you explain how a computer works?"},
                                    {"role": "assistant", "content": "Sure! A computer is a machine that "
                                     "processes information. It has a processor, memory and storage."}],
                                   tokenize=False)
    ids = torch.tensor(tok(text)["input_ids"])[None]  # [1, S]
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]

    def nll(x):
        logits = target.logits(x)[0, :-1]
        return torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()

    real, rand = nll(ids), nll(shuffled)
    assert real < ln_v - 2.0 and real < rand - 1.0, (real, rand)


def test_frozen_target_final_is_after_hc_head_and_norm(target):
    """TargetFeatures.final == norm(hc_head(last layer's iHC streams)) computed by hand from a hook, and the LM head
    of it reproduces the model's logits."""
    captured = {}
    handle = target.model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.__setitem__("h", o[0]))
    ids = torch.randint(5, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        feats = target.features(ids)
    finally:
        handle.remove()
    streams = captured["h"]  # [B, S, hc, H]
    assert streams.shape == (2, 9, target.model.config.hc_mult, target.hidden_size)
    base = target.model.model
    with torch.no_grad():
        manual = base.norm(base.hc_head(streams))
    assert torch.allclose(feats.final, manual, atol=1e-6)
    assert not torch.allclose(feats.final, base.norm(streams.mean(-2)), atol=1e-3)  # not a plain average
    assert torch.allclose(target.logits_from_final(feats.final), target.logits(ids), atol=1e-4)
    assert torch.allclose(feats.aux, streams.mean(-2), atol=1e-6)  # aux: hc-averaged last layer (default layer_ids)


def test_init_from_target_copies_last_layer(target):
    cfg = HYV4MTPConfig.from_target_config(target.model.config)
    draft = HYV4MTPDraft(cfg).init_from_target(target.model)
    last = target.model.model.layers[-1]
    own = draft.mtp_layers[0].state_dict()
    assert torch.equal(own["self_attn.linear_gate.weight"], last.self_attn.gate_proj.weight)
    assert torch.equal(own["self_attn.learnable_sink_param"], last.self_attn.sinks)
    assert torch.equal(own["mlp.experts.gate_up_proj"], last.mlp.experts.gate_up_proj)
    assert torch.equal(own["final_layernorm.weight"], target.model.model.norm.weight)
    donor = next(lay for lay in reversed(target.model.model.layers) if lay.self_attn.indexer is not None)
    assert cfg.use_indexer and torch.equal(own["self_attn.indexer.wk.weight"], donor.self_attn.indexer.wk.weight)


def mtp_layer_params(c: HYV4MTPConfig) -> int:
    """Hand count of one MTP layer from the Hy4 architecture description."""
    h, nh, qd = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    attn = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * nh * qd  # q_a, q_a_norm, q_b
            + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a (+rope), kv_a_norm
            + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b
            + nh * c.v_head_dim * h + h * nh * c.v_head_dim + nh)  # o_proj, elementwise gate, sinks
    indexer = c.q_lora_rank * c.index_n_heads * c.index_head_dim + h * c.index_head_dim + 2 * c.index_head_dim \
        + h * c.index_n_heads
    moe = c.n_routed_experts * h + 3 * h * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts)
    return attn + indexer + moe + 2 * h + 3 * h + 2 * h * h  # block norms; enorm, hnorm, final_layernorm; eh_proj


def test_real_size_hy4_on_meta():
    """The released Hy4 config (transformers defaults = tencent/Hy4-preview) builds target and MTP draft on meta; the
    draft block has exactly the shapes of transformers' decoder layer (minus iHC) under checkpoint names."""
    hf = HYV4Config()
    with torch.device("meta"):
        model = HYV4ForCausalLM(hf)
        cfg = HYV4MTPConfig.from_target_config(hf)
        draft = HYV4MTPDraft(cfg)
        ref_layer = HYV4DecoderLayer(hf, hf.num_hidden_layers - 1)
    n_target = sum(p.numel() for p in model.parameters())
    assert n_target > 50e9  # a real-size MoE, not a tiny stand-in
    assert cfg.hidden_size == 2816 and cfg.n_routed_experts == 256 and cfg.use_indexer and cfg.mlp_type == "sparse"
    assert cfg.mtp_start_layer == hf.num_hidden_layers
    layer = draft.mtp_layers[0]
    assert all(p.is_meta for p in layer.parameters())
    own = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in hy_v4_names.block_from_hf(ref_layer.state_dict()).items()}
    assert ref == {k: s for k, s in own.items() if not k.startswith(hy_v4_names.LAYER_LEVEL)}
    assert own["eh_proj.weight"] == (2816, 2 * 2816)
    assert sum(p.numel() for p in layer.parameters()) == mtp_layer_params(cfg)


def test_init_from_target_refuses_a_mismatched_block(target):
    draft = HYV4MTPDraft(HYV4MTPConfig.from_target_config(target.model.config, mlp_type="dense"))
    with pytest.raises(ValueError, match="mlp_type='dense'"):
        draft.init_from_target(target.model)
