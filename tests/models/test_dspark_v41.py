"""DeepSeek-V4.1 DSpark draft and tiny V4.1 target against direct transcriptions of vLLM 0.33.0's V4.1 formulas
(docs/v41.md): the delayed mHC pre (kernels/mhc/torch.py:6-45), the draft forward (models/deepseek_v41/nvidia/
dspark.py:224-244), the target's streams / final collapse (models/deepseek_v41/nvidia/model.py:486-662, 1146-1149)
and the config keys (dspark_target_layer_ids entry-stream ids, dspark_n_routed_experts)."""
from __future__ import annotations

import pytest
import torch
from conftest import FP32_CROSS_SHAPE_ATOL, tiny_v4_config

from dspark.models.common import FieldError
from dspark.models.dspark_v4 import DSparkV4Draft
from dspark.models.dspark_v41 import DSparkV41Config, DSparkV41Draft, served_layer_ids
from dspark.ops.mhc import HcSettings, hc_pre_delayed

EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20


# ---- direct transcription of vLLM's mhc_pre_delayed_torch (kernels/mhc/torch.py:6-45) --------------------------
def vllm_pre_delayed(residual, fn, scale, base, pre_mix, hc):
    """residual [T, hc, H] -> (post [T, hc], comb [T, hc, hc], layer_input [T, H], pre [T, hc])."""
    x = residual.flatten(1).double()
    mixes = (x @ fn.double().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)
    base, scale = base.double(), scale.double()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + EPS
    post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]) * 2.0
    comb = mixes[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    layer_input = residual[:, 0].double() if pre_mix is None else (pre_mix.double().unsqueeze(-1)
                                                                     * residual.double()).sum(dim=1)
    return post, comb, layer_input, pre


def vllm_post(x, residual, post, comb):
    """mhc_post_torch (kernels/mhc/torch.py:135-147): comb^T residual + post * x."""
    return torch.einsum("tij,tih->tjh", comb.double(), residual.double()) + post.double().unsqueeze(-1) * \
        x.double().unsqueeze(-2)


def _rand_hc(hc=2, h=8, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    return (torch.randn(t, hc, h, generator=g), torch.randn(mix, hc * h, generator=g) * 0.3,
            torch.randn(mix, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5, torch.rand(t, hc, generator=g))


@pytest.mark.parametrize("carried", [False, True])
def test_delayed_pre_is_vllms_reference(carried):
    x, fn, base, scale, prev = _rand_hc()
    prev = prev if carried else None
    y, post, comb, pre = hc_pre_delayed(x, prev, fn, base, scale, HcSettings(2, ITERS, EPS, NORM_EPS))
    r_post, r_comb, r_y, r_pre = vllm_pre_delayed(x, fn, scale, base, prev, 2)
    for got, ref in ((y, r_y), (post, r_post), (comb, r_comb), (pre, r_pre)):
        torch.testing.assert_close(got.double(), ref, atol=FP32_CROSS_SHAPE_ATOL, rtol=0)
    if carried:  # the delayed collapse is not the sublayer's own pre-mix (V4's hc_pre)
        own = (pre.unsqueeze(-1) * x).sum(1)
        assert (own - y).abs().max() > 1e-3


def _v41_cfg(**keys):
    hf = tiny_v4_config()
    base = dict(num_layers=2, block_size=3, mask_token_id=3, target_layer_ids=[0, 2], markov_rank=4,
                sliding_window=4)
    return DSparkV41Config.from_target_config(hf, **{**base, **keys})


def _hand_backbone(draft, ids, positions, ctx, mask):
    """dspark.py:224-244 transcribed: embed -> hc copies; per layer delayed attn / ffn sublayers (the layer's own
    attention / MoE / norms); mhc_post; collapse with the last FFN pre-mix."""
    c = draft.config
    b, t = ids.shape
    x = draft.embed(ids).unsqueeze(-2).repeat(1, 1, c.hc_mult, 1).reshape(b * t, c.hc_mult, -1)
    carried = None
    for layer, kv in zip(draft.layers, ctx):
        for which in ("attn", "ffn"):
            fn, base, scale = (getattr(layer, f"hc_{which}_{p}") for p in ("fn", "base", "scale"))
            post, comb, y, pre = vllm_pre_delayed(x, fn, scale, base, carried, c.hc_mult)
            y = y.float().view(b, t, -1)
            out = (layer.attn(layer.attn_norm(y), positions, kv, mask) if which == "attn"
                   else layer.ffn(layer.ffn_norm(y)))
            x = vllm_post(out.reshape(b * t, -1), x, post, comb).float()
            carried = pre
    return (carried.unsqueeze(-1) * x.double()).sum(1).float().view(b, t, -1)


def _inputs(draft, b=2, s=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = draft.config
    t = c.block_size
    aux = torch.randn(b, s, len(c.target_layer_ids) * c.hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (b, t), generator=g)
    ctx = draft.context_kv(draft.combine(aux), torch.arange(s).expand(b, s))
    mask = torch.rand(b, t, s + t, generator=g) > 0.3
    mask[..., s] = True
    return ids, torch.arange(s, s + t).expand(b, t), ctx, mask


def _draft(cfg, seed=0):
    torch.manual_seed(seed)
    draft = DSparkV41Draft(cfg)
    for p in draft.parameters():  # mixes far from their init so that the pre-mix order matters
        p.data.add_(torch.randn_like(p) * 0.2)
    hf = tiny_v4_config()
    g = torch.Generator().manual_seed(7)
    draft.share_target_weights(torch.randn(hf.vocab_size, hf.hidden_size, generator=g),
                               torch.randn(hf.vocab_size, hf.hidden_size, generator=g))
    return draft


def test_backbone_is_the_served_forward():
    draft = _draft(_v41_cfg())
    ids, pos, ctx, mask = _inputs(draft)
    with torch.no_grad():
        got = draft.backbone(ids, pos, ctx, mask)
        ref = _hand_backbone(draft, ids, pos, ctx, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the V4 forward over the same weights (own pre-mix, hc_head) gives other hidden states
    v4 = DSparkV4Draft(draft.config)
    v4.load_state_dict(draft.state_dict(), strict=False)
    v4.share_target_weights(draft._embed_weight, draft._lm_head_weight)
    with torch.no_grad():
        assert (v4.backbone(ids, pos, ctx, mask) - got).abs().max() > 1e-2


def test_no_hc_head_and_names_are_v4s_otherwise():
    draft = DSparkV41Draft(_v41_cfg())
    v4 = DSparkV4Draft(draft.config)
    names, v4_names = set(dict(draft.named_parameters())), set(dict(v4.named_parameters()))
    assert v4_names - names == {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert names <= v4_names


def test_config_reads_v41_target_keys():
    hf = tiny_v4_config(n_routed_experts=4, num_experts_per_tok=2)
    hf.dspark_target_layer_ids = [1, 3]
    hf.dspark_n_routed_experts = 2
    hf.dspark_num_experts_per_tok = 1
    hf.num_nextn_predict_layers = 2
    cfg = DSparkV41Config.from_target_config(hf, block_size=3, mask_token_id=3, markov_rank=4)
    assert cfg.target_layer_ids == [0, 2] and served_layer_ids(cfg) == [1, 3]
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_layers) == (2, 1, 2)
    assert len(DSparkV41Draft(cfg).layers[0].ffn.experts) == 2
    hf.dspark_target_layer_ids = [0, 3]
    with pytest.raises(FieldError, match="embedding stream"):
        DSparkV41Config.from_target_config(hf, block_size=3, mask_token_id=3, markov_rank=4)


# ---- the V4.1 target ---------------------------------------------------------------------------------------------
def _v41_target(seed=0):
    from dspark.targets.v41 import DeepseekV41Config, DeepseekV41ForCausalLM

    values = tiny_v4_config().to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(**values)).eval()
    for name, p in model.named_parameters():
        if "_hc." in name:
            p.data.add_(torch.randn_like(p) * 0.3)
    return model


def test_target_streams_follow_v41s_delayed_mhc():
    """Every hyper-connection's collapsed input = vLLM's delayed collapse of its input stream with the previous
    sublayer's pre-mix (stream 0 first), and the final hidden = norm(collapse(last stream, last FFN pre-mix))."""
    model = _v41_target()
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0], out)))
             for layer in model.model.layers for m in (layer.attn_hc, layer.ffn_hc)]
    last = []
    hooks.append(model.model.layers[-1].register_forward_hook(lambda mod, inp, out: last.append(out)))
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * len(model.model.layers)
    carried = None
    modules = [m for layer in model.model.layers for m in (layer.attn_hc, layer.ffn_hc)]
    for (streams, (post, comb, collapsed)), mod in zip(seen, modules):
        flat = streams.reshape(-1, *streams.shape[-2:])
        r_post, r_comb, r_y, r_pre = vllm_pre_delayed(flat, mod.fn, mod.scale, mod.base, carried, 2)
        torch.testing.assert_close(collapsed.reshape(-1, collapsed.shape[-1]).double(), r_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(post.reshape(-1, 2).double(), r_post, atol=1e-5, rtol=1e-5)
        carried = r_pre
    stream = last[0].reshape(-1, *last[0].shape[-2:])
    ref = model.model.norm((carried.unsqueeze(-1) * stream.double()).sum(1).float()).view_as(final)
    torch.testing.assert_close(final, ref, atol=1e-5, rtol=1e-5)
    assert not [k for k in model.state_dict() if "hc_head" in k]  # V4.1 has no learned hc_head


def test_shipped_tiny_v41_target_loads_through_transformers_auto_classes():
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark.targets.tiny_v41 import TINY_V41_DIR
    from dspark.targets.v41 import DeepseekV41ForCausalLM

    assert AutoConfig.from_pretrained(TINY_V41_DIR).model_type == "deepseek_v41"
    model = AutoModelForCausalLM.from_pretrained(TINY_V41_DIR, dtype=torch.float32)
    assert isinstance(model, DeepseekV41ForCausalLM)
    assert isinstance(model.model.layers[0].attn_hc, type(model.model.layers[1].ffn_hc))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()


def test_init_from_target_copies_the_last_v41_layers():
    model = _v41_target()
    draft = DSparkV41Draft(_v41_cfg(num_layers=2))
    assert draft.init_from_target(model) == [1, 2]
    src = model.model.layers[2]
    assert torch.equal(draft.layers[1].hc_ffn_fn, src.ffn_hc.fn)
    assert torch.equal(draft.layers[1].attn.wkv.weight, src.self_attn.kv_proj.weight)
