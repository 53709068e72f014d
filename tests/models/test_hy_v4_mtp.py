"""HY V4 MTP draft: the block against transformers' HYV4DecoderLayer (iHC off) with copied weights, both RoPE
conventions; the MTP combine / final norm against a naive composition; the position-0 flag; serving names."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import HYV4Config
from transformers.models.hy_v4 import modeling_hy_v4
from transformers.models.hy_v4.modeling_hy_v4 import HYV4DecoderLayer, HYV4RotaryEmbedding

from dspark.export.hy_v4_mtp import HYV4MTPAdapter, from_serving_names, to_serving_names
from dspark.models import hy_v4_names
from dspark.models.hy_v4_mtp import HYV4MTPConfig, HYV4MTPDraft
from dspark.ops.rope import apply_rope

V = 50
# transformers >= 5.25 rotates HY V4's rope dims in interleaved pairs, as vLLM does; earlier releases rotate halves.
# test_block_matches_transformers_layer checks that this probe names the convention transformers' layer really has.
HF_ROPE_INTERLEAVED = hasattr(modeling_hy_v4, "apply_rotary_pos_emb_interleave")


def tiny_hy_config(**overrides) -> HYV4Config:
    keys = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_topk=3,
                index_head_dim=8, index_n_heads=2, hc_mult=2, routed_scaling_factor=1.7, swiglu_limit=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 100.0}, max_position_embeddings=64)
    keys.update(overrides)
    cfg = HYV4Config(**keys)
    cfg._attn_implementation = "eager"
    return cfg


class IdentityHC(nn.Module):
    """iHC off in transformers' layer: one stream, pre = post = 1 -> x1 = x + f(x), a plain residual."""

    def forward(self, streams: torch.Tensor):  # [B, S, 1, H]
        return streams.new_ones(streams.shape[:-1]), streams[:, :, 0]


def hf_layer(cfg: HYV4Config, layer_idx: int, seed: int = 0) -> HYV4DecoderLayer:
    """transformers' decoder layer with random (non-default) weights everywhere and iHC replaced by identity."""
    torch.manual_seed(seed)
    layer = HYV4DecoderLayer(cfg, layer_idx).float()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5) + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    layer.attn_hc, layer.ffn_hc = IdentityHC(), IdentityHC()
    return layer.eval()


def rope_permutation(r: int) -> torch.Tensor:
    """Index map p with neox_rope(x[p]) == interleaved_rope(x)[p]: even dims first, then odd dims."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


def permute_rope_rows(block: dict[str, torch.Tensor], cfg: HYV4MTPConfig, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Permute the rows (and k_norm entries) of every tensor that produces rope dims. With perm =
    rope_permutation(r), an interleaved-RoPE block with W equals a rotate-half block with the permuted W; with its
    inverse, a rotate-half block with W equals an interleaved block with the permuted W. q.k products are unchanged
    by a permutation common to q and k."""
    out = dict(block)
    r = cfg.qk_rope_head_dim

    def permute_tail(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
        w = w.view(n_heads, head_dim, *w.shape[1:]).clone()
        w[:, head_dim - r:] = w[:, head_dim - r:][:, perm]
        return w.view(n_heads * head_dim, *w.shape[2:])

    nh = cfg.num_attention_heads
    out["self_attn.q_b_proj.weight"] = permute_tail(block["self_attn.q_b_proj.weight"], nh, cfg.qk_head_dim)
    kv_a = block["self_attn.kv_a_proj_with_mqa.weight"]
    out["self_attn.kv_a_proj_with_mqa.weight"] = permute_tail(kv_a, 1, kv_a.shape[0])
    if cfg.use_indexer:
        d, n = cfg.index_head_dim, cfg.index_n_heads
        out["self_attn.indexer.wq_b.weight"] = permute_tail(block["self_attn.indexer.wq_b.weight"], n, d)
        for key in ("self_attn.indexer.wk.weight", "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias"):
            out[key] = permute_tail(block[key].unsqueeze(-1) if block[key].ndim == 1 else block[key], 1, d).reshape(
                block[key].shape)
    return out


def hf_forward(layer: HYV4DecoderLayer, cfg: HYV4Config, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, S, H] -> transformers layer output [B, S, H] (one stream, causal)."""
    s = x.shape[1]
    mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None].expand(x.shape[0], 1, s, s)
    cos_sin = HYV4RotaryEmbedding(cfg)(x, pos)
    out, _ = layer(x.unsqueeze(2), attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return out[:, :, 0]


def draft_for(cfg: HYV4Config, **overrides) -> HYV4MTPDraft:
    keys = dict(lora_norm_eps=1e-6, index_norm_eps=cfg.rms_norm_eps)  # transformers' eps conventions
    keys.update(overrides)
    return HYV4MTPDraft(HYV4MTPConfig.from_target_config(cfg, **keys)).eval()


def test_rope_permutation_identity():
    """The two RoPE conventions differ by a fixed permutation of the rope dims (what permute_rope_rows relies on)."""
    torch.manual_seed(0)
    r = 8
    x = torch.randn(2, 5, 3, r)
    pos = torch.arange(5).expand(2, 5) + 2
    inv = 1.0 / (100.0 ** (torch.arange(0, r, 2).float() / r))
    ang = pos[..., None].float() * inv
    cos, sin = ang.cos().unsqueeze(2), ang.sin().unsqueeze(2)
    perm = rope_permutation(r)
    assert torch.allclose(apply_rope(x, cos, sin, True)[..., perm], apply_rope(x[..., perm], cos, sin, False), atol=1e-6)
    # naive interleaved rotation of pair (2i, 2i+1) by angle pos * inv_i
    ref = x.clone()
    for i in range(r // 2):
        c, s_ = cos[..., 0, i, None], sin[..., 0, i, None]
        ref[..., 2 * i] = x[..., 2 * i] * c - x[..., 2 * i + 1] * s_
        ref[..., 2 * i + 1] = x[..., 2 * i + 1] * c + x[..., 2 * i] * s_
    assert torch.allclose(apply_rope(x, cos, sin, True), ref, atol=1e-6)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("layer_idx,index_topk", [(1, 3), (1, 64), (0, 3)])  # MoE + sparse DSA, MoE dense, dense MLP
def test_block_matches_transformers_layer(interleave, layer_idx, index_topk):
    cfg = tiny_hy_config(index_topk=index_topk)
    ref_layer = hf_layer(cfg, layer_idx)
    draft = draft_for(cfg, rope_interleave=interleave, mlp_type=cfg.mlp_layer_types[layer_idx])
    layer = draft.mtp_layers[0]
    block = hy_v4_names.block_from_hf(ref_layer.state_dict())
    own = layer.state_dict()
    assert set(block) == {k for k in own if not k.startswith(hy_v4_names.LAYER_LEVEL)}
    layer.load_state_dict({**own, **block})
    if interleave != HF_ROPE_INTERLEAVED:  # transformers' layer has the other convention: permute its rope rows
        perm = rope_permutation(draft.config.qk_rope_head_dim)
        perm = perm if interleave else torch.argsort(perm)
        ref_layer.load_state_dict(hy_v4_names.block_to_hf(permute_rope_rows(block, draft.config, perm)), strict=False)

    torch.manual_seed(1)
    x = torch.randn(2, 7, cfg.hidden_size)
    pos = torch.arange(7).expand(2, 7) + torch.tensor([[0], [5]])
    with torch.no_grad():
        ours, ref = layer.block(x, pos), hf_forward(ref_layer, cfg, x, pos)
    assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-5), (ours - ref).abs().max()
    # the comparison can fail: a wrong convention (interleave flag flipped) changes the output
    layer.cfg.rope_interleave = not interleave
    with torch.no_grad():
        assert not torch.allclose(layer.block(x, pos), ref, atol=1e-3)


def test_sparse_indexer_changes_the_output():
    """index_topk 3 < S really restricts attention (else the sparse case above would test nothing extra)."""
    cfg = tiny_hy_config()
    ref_layer = hf_layer(cfg, 1)
    block = hy_v4_names.block_from_hf(ref_layer.state_dict())
    x, pos = torch.randn(1, 7, cfg.hidden_size), torch.arange(7)[None]
    outs = []
    for topk in (3, 64):
        layer = draft_for(cfg, index_topk=topk, rope_interleave=False).mtp_layers[0]
        layer.load_state_dict({**layer.state_dict(), **block})
        with torch.no_grad():
            outs.append(layer.block(x, pos))
    assert torch.allclose(outs[0][:, :3], outs[1][:, :3], atol=1e-6)  # rows with <= 3 keys: identical
    assert not torch.allclose(outs[0][:, 3:], outs[1][:, 3:], atol=1e-4)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("zero0", [True, False])
def test_step_matches_naive_composition(zero0):
    """step = final_layernorm(layer(eh_proj([enorm(Emb(t_{p+1})) ; hnorm(h_p)]))), embedding zeroed at position 0."""
    cfg = tiny_hy_config()
    ref_layer = hf_layer(cfg, 1, seed=3)
    draft = draft_for(cfg, rope_interleave=HF_ROPE_INTERLEAVED, zero_position0_embedding=zero0)
    layer = draft.mtp_layers[0]
    torch.manual_seed(4)
    with torch.no_grad():
        for name in ("enorm.weight", "hnorm.weight", "final_layernorm.weight"):
            layer.get_parameter(name).copy_(1 + 0.3 * torch.randn(cfg.hidden_size))
    layer.load_state_dict({**layer.state_dict(), **hy_v4_names.block_from_hf(ref_layer.state_dict())})
    embed, head = torch.randn(V, cfg.hidden_size), torch.randn(V, cfg.hidden_size)
    draft.share_target_weights(embed, head)

    ids = torch.randint(0, V, (2, 6))
    hidden = torch.randn(2, 6, cfg.hidden_size)
    pos = torch.stack([torch.arange(6), torch.arange(6) + 4])  # row 0 starts at position 0, row 1 does not
    eps = cfg.rms_norm_eps
    e = embed[ids].clone()
    if zero0:
        e[0, 0] = 0.0
    x = torch.cat([rms(e, layer.enorm.weight, eps), rms(hidden, layer.hnorm.weight, eps)], -1) @ layer.eh_proj.weight.T
    with torch.no_grad():
        ref = rms(hf_forward(ref_layer, cfg, x, pos), layer.final_layernorm.weight, eps)
        out = draft.step(ids, hidden, pos, 0)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), (out - ref).abs().max()
        assert torch.allclose(draft.logits(out), ref @ head.T, atol=1e-4)


def test_position0_flag():
    """Flag on: the token at position 0 has no influence at all; off: it changes the outputs. Default = vLLM (on)."""
    cfg = tiny_hy_config()
    assert HYV4MTPConfig.from_target_config(cfg).zero_position0_embedding is True
    torch.manual_seed(0)
    embed = torch.randn(V, cfg.hidden_size)
    hidden = torch.randn(1, 5, cfg.hidden_size)
    pos = torch.arange(5)[None]
    ids_a = torch.tensor([[3, 7, 9, 11, 13]])
    ids_b = ids_a.clone()
    ids_b[0, 0] = 21
    for flag in (True, False):
        torch.manual_seed(1)
        draft = draft_for(cfg, zero_position0_embedding=flag, initializer_range=0.3)
        draft.share_target_weights(embed, embed)
        with torch.no_grad():
            a, b = draft.step(ids_a, hidden, pos, 0), draft.step(ids_b, hidden, pos, 0)
        assert torch.equal(a, b) if flag else not torch.allclose(a[0, 0], b[0, 0], atol=1e-4)
    # shifted positions (steps k >= 1): no row is at position 0, nothing is zeroed
    with torch.no_grad():
        a, b = draft.step(ids_a, hidden, pos + 1, 1), draft.step(ids_b, hidden, pos + 1, 1)
    assert not torch.allclose(a[0, 0], b[0, 0], atol=1e-4)


def test_layer_reuse_and_weight_sharing():
    """Step k uses layer k % num_layers; shared target weights are neither parameters nor state."""
    cfg = tiny_hy_config()
    draft = draft_for(cfg, num_layers=2, initializer_range=0.3)
    embed = torch.randn(V, cfg.hidden_size)
    draft.share_target_weights(embed, embed)
    assert all(k.startswith("mtp_layers.") for k in draft.state_dict())
    assert not any(p is embed for p in draft.parameters())
    ids, hidden, pos = torch.randint(0, V, (1, 4)), torch.randn(1, 4, cfg.hidden_size), torch.arange(4)[None] + 1
    with torch.no_grad():
        assert torch.equal(draft.step(ids, hidden, pos, 2), draft.step(ids, hidden, pos, 0))
        assert not torch.allclose(draft.step(ids, hidden, pos, 1), draft.step(ids, hidden, pos, 0))
    with pytest.raises(ValueError, match="share_target_weights: embed_weight"):
        draft.share_target_weights(embed[:, :4], embed)
    with pytest.raises(RuntimeError, match="share_target_weights"):
        draft_for(cfg).step(ids, hidden, pos, 0)


def test_serving_names_roundtrip():
    cfg = tiny_hy_config(num_nextn_predict_layers=2)
    draft = draft_for(cfg, initializer_range=0.3)
    assert draft.config.num_layers == 2 and draft.config.mtp_start_layer == 3
    sd = draft.state_dict()
    serving = to_serving_names(draft.state_dict())
    assert all(k.startswith(("model.mtp_layers.0.", "model.mtp_layers.1.")) for k in serving)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight", "input_layernorm.weight",
                 "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.linear_gate.weight",
                 "self_attn.learnable_sink_param", "self_attn.indexer.wk.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.gate_up_proj", "mlp.shared_experts.down_proj.weight"):
        assert f"model.mtp_layers.1.{name}" in serving, name
    assert serving["model.mtp_layers.1.eh_proj.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)

    def same(a, b):
        return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    assert same(HYV4MTPAdapter().from_serving(serving, draft), sd)
    # split per-expert layout and the model.layers.{N+i} form, plus shared copies / target layers that are skipped
    split = to_serving_names(draft.state_dict(), split_experts=True)
    gate_up = sd["mtp_layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(split["model.mtp_layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, cfg.moe_intermediate_size:])
    layered = {k.replace("model.mtp_layers.0.", "model.layers.3.").replace("model.mtp_layers.1.", "model.layers.4."): v
               for k, v in split.items()}
    layered["model.layers.3.embed_tokens.weight"] = torch.zeros(V, cfg.hidden_size)
    layered["model.layers.3.shared_head.head.weight"] = torch.zeros(V, cfg.hidden_size)
    layered["model.layers.2.mlp.gate.weight"] = torch.zeros(4, cfg.hidden_size)  # a target layer
    assert same(HYV4MTPAdapter().from_serving(layered, draft), sd)
    fresh = draft_for(cfg)
    fresh.load_state_dict(HYV4MTPAdapter().from_serving(serving, fresh), strict=True)
    assert same(fresh.state_dict(), sd)
    with pytest.raises(ValueError, match="mtp_layers"):
        to_serving_names({"layers.0.x": torch.zeros(1)})
    with pytest.raises(ValueError, match="no model.mtp_layers"):
        from_serving_names({"lm_head.weight": torch.zeros(1)})


def test_config_errors_name_the_key():
    cfg = tiny_hy_config()
    with pytest.raises(ValueError, match="HYV4MTPConfig.num_layers"):
        HYV4MTPConfig.from_target_config(cfg, num_layers=0)
    with pytest.raises(ValueError, match="HYV4MTPConfig.gating_type"):
        HYV4MTPConfig.from_target_config(cfg, gating_type="rowwise")
    with pytest.raises(ValueError, match="unknown keys"):
        HYV4MTPConfig.from_target_config(cfg, num_drafts=3)
    with pytest.raises(ValueError, match="rope_type"):
        HYV4MTPConfig.from_target_config(tiny_hy_config(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                         "rope_theta": 1e4,
                                                                         "original_max_position_embeddings": 16}))


def test_gradients_reach_the_trainable_block():
    """Every MTP parameter except the DSA indexer (scored under no_grad, as in transformers) gets a gradient;
    the shared target weights get none."""
    cfg = tiny_hy_config()
    draft = draft_for(cfg, initializer_range=0.3).train()
    embed = torch.randn(V, cfg.hidden_size, requires_grad=True)
    draft.share_target_weights(embed, embed)
    ids, pos = torch.randint(0, V, (2, 6)), torch.arange(6).expand(2, 6)
    hidden = draft.step(ids, torch.randn(2, 6, cfg.hidden_size), pos, 0)
    F.cross_entropy(draft.logits(hidden).flatten(0, 1), torch.randint(0, V, (12,))).backward()
    missing = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing and all(".indexer." in n for n in missing), missing
    assert embed.grad is None
