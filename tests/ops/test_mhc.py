"""mHC reference math vs a loop-by-loop transcription of docs/CONTRACTS.md §4 and vs transformers' modules."""

import math

import pytest
import torch

from dspark.ops.mhc import HcSettings, hc_head, hc_post, hc_pre, sinkhorn

HC, H = 3, 4
EPS, NORM_EPS = 1e-6, 1e-6


def _params(seed: int, hc: int = HC, hidden: int = H):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * hidden, generator=g) * 0.5
    base = torch.randn(mix, generator=g) * 0.3
    scale = torch.rand(3, generator=g) + 0.5
    return fn, base, scale


# ---- docs/CONTRACTS.md §4 written out with Python loops, one token x [hc][H] at a time -------------------------
def _spec_mix(x_tok, fn):
    f = [x_tok[j][d].item() for j in range(len(x_tok)) for d in range(len(x_tok[0]))]
    inv = 1.0 / math.sqrt(sum(v * v for v in f) / len(f) + NORM_EPS)
    return [sum(fn[m][i].item() * f[i] for i in range(len(f))) * inv for m in range(fn.shape[0])]


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _spec_sinkhorn(logits, hc, iters):
    comb = []
    for j in range(hc):  # softmax over each row, + eps
        row = logits[j]
        mx = max(row)
        ex = [math.exp(v - mx) for v in row]
        comb.append([e / sum(ex) + EPS for e in ex])

    def col_norm(c):
        sums = [sum(c[j][k] for j in range(hc)) for k in range(hc)]
        return [[c[j][k] / (sums[k] + EPS) for k in range(hc)] for j in range(hc)]

    def row_norm(c):
        return [[c[j][k] / (sum(c[j]) + EPS) for k in range(hc)] for j in range(hc)]

    comb = col_norm(comb)
    for _ in range(iters - 1):
        comb = col_norm(row_norm(comb))
    return comb


def _spec_hc_pre(x_tok, fn, base, scale, hc, iters):
    m = _spec_mix(x_tok, fn)
    pre = [_sigmoid(m[j] * scale[0].item() + base[j].item()) + EPS for j in range(hc)]
    post = [2 * _sigmoid(m[hc + j] * scale[1].item() + base[hc + j].item()) for j in range(hc)]
    logits = [
        [m[2 * hc + j * hc + k] * scale[2].item() + base[2 * hc + j * hc + k].item() for k in range(hc)]
        for j in range(hc)
    ]
    comb = _spec_sinkhorn(logits, hc, iters)
    y = [sum(pre[j] * x_tok[j][d].item() for j in range(hc)) for d in range(len(x_tok[0]))]
    return y, post, comb


def test_hc_pre_matches_spec_loops():
    fn, base, scale = _params(0)
    x = torch.randn(2, 3, HC, H, generator=torch.Generator().manual_seed(1))  # [B, T, hc, H]
    y, post, comb = hc_pre(x, fn, base, scale, HcSettings(HC, 7, EPS, NORM_EPS))
    assert y.shape == (2, 3, H) and post.shape == (2, 3, HC) and comb.shape == (2, 3, HC, HC)
    for b in range(2):
        for t in range(3):
            y_ref, post_ref, comb_ref = _spec_hc_pre(x[b, t], fn, base, scale, HC, 7)
            torch.testing.assert_close(y[b, t], torch.tensor(y_ref), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(post[b, t], torch.tensor(post_ref), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(comb[b, t], torch.tensor(comb_ref), atol=1e-5, rtol=1e-5)


def test_hc_post_matches_spec_loops():
    g = torch.Generator().manual_seed(2)
    block = torch.randn(2, 3, H, generator=g)
    res = torch.randn(2, 3, HC, H, generator=g)
    post = torch.rand(2, 3, HC, generator=g) * 2
    comb = torch.rand(2, 3, HC, HC, generator=g)  # deliberately not symmetric
    out = hc_post(block, res, post, comb)
    for b in range(2):
        for t in range(3):
            for k in range(HC):
                for d in range(H):
                    ref = post[b, t, k] * block[b, t, d] + sum(comb[b, t, j, k] * res[b, t, j, d] for j in range(HC))
                    assert abs(out[b, t, k, d].item() - ref.item()) < 1e-5


def test_hc_head_matches_spec_loops():
    g = torch.Generator().manual_seed(3)
    fn = torch.randn(HC, HC * H, generator=g)
    base = torch.randn(HC, generator=g)
    scale = torch.rand(1, generator=g) + 0.5
    x = torch.randn(2, 3, HC, H, generator=g)
    y = hc_head(x, fn, base, scale, EPS, NORM_EPS)
    for b in range(2):
        for t in range(3):
            m = _spec_mix(x[b, t], fn)
            pre = [_sigmoid(m[j] * scale[0].item() + base[j].item()) + EPS for j in range(HC)]
            ref = [sum(pre[j] * x[b, t, j, d].item() for j in range(HC)) for d in range(H)]
            torch.testing.assert_close(y[b, t], torch.tensor(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hc", [2, 4])
def test_sinkhorn_doubly_stochastic(hc):
    logits = torch.randn(5, hc, hc, generator=torch.Generator().manual_seed(4))
    comb = sinkhorn(logits, iters=100, eps=EPS)
    ones = torch.ones(5, hc)
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-1), ones, atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-4, rtol=0)
    # One iteration only normalises columns: rows are generally off.
    one = sinkhorn(logits, iters=1, eps=EPS)
    torch.testing.assert_close(one.sum(-2), ones, atol=1e-4, rtol=0)
    assert (one.sum(-1) - 1).abs().max() > 1e-2  # so the check above is not vacuous


def test_dtype_roundtrip_bf16():
    fn, base, scale = _params(5)
    x = torch.randn(2, 3, HC, H).to(torch.bfloat16)
    y, post, comb = hc_pre(x, fn, base, scale, HcSettings(HC, 5, EPS, NORM_EPS))
    assert y.dtype == torch.bfloat16 and post.dtype == torch.float32 and comb.dtype == torch.float32
    assert hc_post(y, x, post, comb).dtype == torch.bfloat16


# ---- against transformers --------------------------------------------------------------------------
def _hf_config(hc: int, hidden: int):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=32, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
        hc_mult=hc, hc_sinkhorn_iters=20, hc_eps=EPS, rms_norm_eps=NORM_EPS,
        layer_types=["sliding_attention"], mlp_layer_types=["moe"],
    )


def test_matches_transformers_hyper_connection_and_head():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    hc, hidden = 4, 8
    cfg = _hf_config(hc, hidden)
    fn, base, scale = _params(6, hc, hidden)
    hf_hc = DeepseekV4HyperConnection(cfg)
    with torch.no_grad():
        hf_hc.fn.copy_(fn)
        hf_hc.base.copy_(base)
        hf_hc.scale.copy_(scale)
    x = torch.randn(2, 5, hc, hidden, generator=torch.Generator().manual_seed(7))
    post_ref, comb_ref, y_ref = hf_hc(x)
    y, post, comb = hc_pre(x, fn, base, scale, HcSettings(hc, 20, EPS, NORM_EPS))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post, post_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comb, comb_ref, atol=1e-5, rtol=1e-5)

    g = torch.Generator().manual_seed(8)
    head = DeepseekV4HyperHead(cfg)
    hfn = torch.randn(hc, hc * hidden, generator=g)
    hbase = torch.randn(hc, generator=g)
    hscale = torch.rand(1, generator=g) + 0.5
    with torch.no_grad():
        head.hc_fn.copy_(hfn)
        head.hc_base.copy_(hbase)
        head.hc_scale.copy_(hscale)
    torch.testing.assert_close(hc_head(x, hfn, hbase, hscale, EPS, NORM_EPS), head(x), atol=1e-5, rtol=1e-5)
