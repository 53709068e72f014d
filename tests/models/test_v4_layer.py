"""DSpark-V4 draft layer vs transformers' DeepseekV4DecoderLayer, context KV, and the draft interface."""

import pytest
import torch

from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft, DSparkV4Layer
from dspark.models.v4_names import draft_layer_to_hf_state, hf_layer_to_draft_state, init_draft_layers_from_target

HC, HIDDEN, HEAD_DIM, WINDOW = 3, 32, 16, 4


def _hf_config(num_layers=1):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=HIDDEN, moe_intermediate_size=16, num_hidden_layers=num_layers,
        num_attention_heads=4, head_dim=HEAD_DIM, q_lora_rank=12, partial_rotary_factor=0.5,
        num_experts_per_tok=2, n_routed_experts=4, routed_scaling_factor=1.5, swiglu_limit=0.5,
        hc_mult=HC, hc_sinkhorn_iters=20, o_groups=2, o_lora_rank=8, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * num_layers, mlp_layer_types=["moe"] * num_layers, topk_method="noaux_tc",
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def _draft_config(hf_cfg, **kw):
    keys = dict(block_size=4, mask_token_id=5, target_layer_ids=[0, 1], markov_rank=8, num_layers=1)
    keys.update(kw)
    return DSparkV4Config.from_target_config(hf_cfg, **keys)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere: sinks, gate bias, norms, hc base/scale all away from their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
            if name.endswith("norm.weight") or name.endswith("_scale"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("attn_sink") or name.endswith("gate.bias") or name.endswith("_base"):
                p.copy_(noise)
            else:
                p.copy_(0.3 * noise)


def _sliding_mask(s: int, w: int) -> torch.Tensor:
    """[S, S] bool: key j visible to query i iff i - w < j <= i."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    return (j <= i) & (j > i - w)


def _layers(seed=0):
    hf_cfg = _hf_config()
    layer = DSparkV4Layer(_draft_config(hf_cfg))
    _randomise(layer, seed)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    hf_layer = DeepseekV4DecoderLayer(hf_cfg, 0)
    hf_layer.load_state_dict(draft_layer_to_hf_state(layer.state_dict()), strict=True)
    return hf_cfg, layer, hf_layer


def _hf_forward(hf_cfg, hf_layer, x, pos, visible):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rope = DeepseekV4RotaryEmbedding(hf_cfg)
    pe = {kind: rope(x, pos, layer_type=kind) for kind in ("main", "compress")}
    additive = torch.zeros(visible.shape, dtype=torch.float32).masked_fill(~visible, torch.finfo(torch.float32).min)
    return hf_layer(x, position_embeddings=pe, position_ids=pos, attention_mask=additive[:, None])


def test_layer_matches_transformers_decoder_layer():
    torch.manual_seed(0)
    hf_cfg, layer, hf_layer = _layers()
    b, s = 2, 9
    x = torch.randn(b, s, HC, HIDDEN)  # [B, S, hc, H]
    pos = torch.arange(s).expand(b, s) + torch.tensor([[0], [3]])  # different offsets per row
    visible = _sliding_mask(s, WINDOW).expand(b, s, s)
    out = layer(x, pos, torch.zeros(b, 0, HEAD_DIM), visible)
    with torch.no_grad():
        ref = _hf_forward(hf_cfg, hf_layer, x, pos, visible)
    assert out.shape == (b, s, HC, HIDDEN)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The window matters: a full causal mask gives different numbers.
    wide = layer(x, pos, torch.zeros(b, 0, HEAD_DIM), _sliding_mask(s, s).expand(b, s, s))
    assert (wide - out).abs().max() > 1e-3


def test_names_roundtrip():
    _, layer, hf_layer = _layers(seed=1)
    back = hf_layer_to_draft_state(hf_layer.state_dict())
    mine = layer.state_dict()
    assert set(back) == set(mine)
    for name, tensor in mine.items():
        assert torch.equal(back[name], tensor), name


def test_context_kv_equals_attention_over_concatenation():
    """Precomputed context KV + a block == the same layer attending over the concatenated sequence."""
    torch.manual_seed(2)
    _, layer, _ = _layers(seed=2)
    b, s_ctx, t = 2, 6, 4
    s = s_ctx + t
    x = torch.randn(b, s, HC, HIDDEN)
    pos = torch.arange(s).expand(b, s) + 7
    visible = _sliding_mask(s, WINDOW + 2).expand(b, s, s).clone()
    visible[:, s_ctx:, s_ctx:] = True  # block keys are bidirectional, as in DSpark
    full = layer(x, pos, torch.zeros(b, 0, HEAD_DIM), visible)
    # Context keys as the layer itself computes them for those positions.
    ctx_in = layer.attn_input(x[:, :s_ctx])  # [B, S_ctx, H]
    ctx_kv = layer.attn.context_kv(ctx_in, pos[:, :s_ctx])  # [B, S_ctx, D]
    block = layer(x[:, s_ctx:], pos[:, s_ctx:], ctx_kv, visible[:, s_ctx:])
    torch.testing.assert_close(block, full[:, s_ctx:], atol=1e-5, rtol=1e-5)


def _tiny_draft(seed=3, **kw):
    hf_cfg = _hf_config()
    draft = DSparkV4Draft(_draft_config(hf_cfg, num_layers=2, **kw))
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, HIDDEN, generator=g)
    lm_head = torch.nn.Parameter(torch.randn(64, HIDDEN, generator=g))
    draft.share_target_weights(embed, lm_head)
    return hf_cfg, draft, embed, lm_head


def test_backbone_matches_transformers_stack_with_empty_context():
    """Empty context + bidirectional block == embed, repeat hc, transformers layers, HyperHead."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

    hf_cfg, draft, embed, _ = _tiny_draft()
    b, t = 2, 5
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(t).expand(b, t) + 11
    mask = torch.ones(b, t, t, dtype=torch.bool)
    h = draft.backbone(ids, pos, draft.empty_context(b), mask)
    x = embed[ids].unsqueeze(2).expand(b, t, HC, HIDDEN).contiguous()
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            hf_layer = DeepseekV4DecoderLayer(hf_cfg, 0)
            hf_layer.load_state_dict(draft_layer_to_hf_state(layer.state_dict()))
            x = _hf_forward(hf_cfg, hf_layer, x, pos, mask)
        head = DeepseekV4HyperHead(hf_cfg)
        head.hc_fn.copy_(draft.hc_head_fn)
        head.hc_base.copy_(draft.hc_head_base)
        head.hc_scale.copy_(draft.hc_head_scale)
        ref = head(x)
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)


def test_draft_interface_shapes_grads_and_shared_weights():
    _, draft, embed, lm_head = _tiny_draft(seed=4)
    b, s, t = 2, 6, 4
    aux = torch.randn(b, s, 2 * HIDDEN)
    main_x = draft.combine(aux)
    assert main_x.shape == (b, s, HIDDEN)
    ctx = draft.context_kv(main_x, torch.arange(s).expand(b, s))
    assert len(ctx) == 2 and ctx[0].shape == (b, s, HEAD_DIM)
    ids = torch.full((b, t), 5)
    mask = torch.ones(b, t, s + t, dtype=torch.bool)
    h = draft.backbone(ids, torch.arange(s, s + t).expand(b, t), ctx, mask)
    u = draft.base_logits(h)
    assert h.shape == (b, t, HIDDEN) and u.shape == (b, t, 64)
    torch.testing.assert_close(u, draft.norm(h) @ lm_head.detach().t())
    bias, feat = draft.markov_head(ids.view(b, 1, t), h.view(b, 1, t, HIDDEN))
    conf = draft.confidence_logit(h.view(b, 1, t, HIDDEN), feat)
    assert bias.shape == (b, 1, t, 64) and conf.shape == (b, 1, t)
    (u.sum() + bias.sum() + conf.sum()).backward()
    assert draft.main_proj.weight.grad is not None and draft.layers[0].attn.wkv.weight.grad is not None
    assert lm_head.grad is None  # shared weights stay frozen
    names = set(draft.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert all(p is not lm_head for p in draft.parameters())
    assert not any(p.data_ptr() in (embed.data_ptr(), lm_head.data_ptr()) for p in draft.parameters())


def test_set_dtype_keeps_fp32_params():
    _, draft, _, _ = _tiny_draft(seed=5)
    draft.set_dtype(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in draft.named_parameters()}
    for name in ("layers.0.hc_attn_fn", "layers.1.attn.attn_sink", "layers.0.ffn.gate.bias", "norm.weight",
                 "layers.0.attn.kv_norm.weight", "hc_head_scale", "confidence_head.proj.weight"):
        assert dtypes[name] == torch.float32, name
    for name in ("main_proj.weight", "layers.0.attn.wq_a.weight", "layers.0.ffn.experts.1.w2.weight",
                 "markov_head.markov_w1.weight"):
        assert dtypes[name] == torch.bfloat16, name


def test_init_draft_layers_from_target():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    torch.manual_seed(6)
    hf_cfg = _hf_config(num_layers=3)
    target = DeepseekV4ForCausalLM(hf_cfg)
    _randomise(target, 6)
    draft = DSparkV4Draft(_draft_config(hf_cfg, num_layers=2))
    assert init_draft_layers_from_target(draft, target) == [1, 2]
    for layer, src in zip(draft.layers, (1, 2)):
        ref = hf_layer_to_draft_state(target.model.layers[src].state_dict())
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, ref[name]), name
    with pytest.raises(ValueError, match="source"):
        init_draft_layers_from_target(draft, target, [0, 5])


@pytest.mark.parametrize(
    "key,value",
    [("rope_head_dim", 18), ("o_groups", 3), ("markov_head_type", "lstm"), ("num_experts_per_tok", 9),
     ("mask_token_id", 64), ("target_layer_ids", []), ("scoring_func", "softmax"), ("hidden_size", 0)],
)
def test_config_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        _draft_config(_hf_config(), **{key: value})


def test_bf16_forward_close_to_fp32():
    _, draft, embed, lm_head = _tiny_draft(seed=7)
    b, s, t = 1, 5, 4
    aux = torch.randn(b, s, 2 * HIDDEN)
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(b, t, s + t, dtype=torch.bool)

    def run():
        ctx = draft.context_kv(draft.combine(aux), torch.arange(s).expand(b, s))
        return draft.backbone(ids, torch.arange(s, s + t).expand(b, t), ctx, mask)

    ref = run()
    draft.set_dtype(torch.bfloat16)
    draft.share_target_weights(embed.bfloat16(), lm_head.detach().bfloat16())
    h = run()
    assert h.dtype == torch.bfloat16 and draft.base_logits(h).dtype == torch.bfloat16
    rel = (h.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel
