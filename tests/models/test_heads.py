"""Markov heads (vanilla / gated / RNN) teacher-forced vs step-by-step, and the confidence head."""

import pytest
import torch

from dspark.models.heads import ConfidenceHead, build_markov_head

V, VD, R, HID = 11, 11, 4, 6


def _head(kind="vanilla", vd=VD):
    head = build_markov_head(V, vd, R, HID, kind=kind)
    head.reset_parameters(std=0.5)  # larger than the 0.02 default so every path moves the numbers
    return head


def _inputs(seed=0, b=2, a=3, g=5):
    gen = torch.Generator().manual_seed(seed)
    prev = torch.randint(0, V, (b, a, g), generator=gen)
    h = torch.randn(b, a, g, HID, generator=gen)
    return prev, h


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_forward_equals_step_by_step(kind):
    torch.manual_seed(1)
    head = _head(kind)
    prev, h = _inputs()
    bias, feat = head(prev, h)
    assert bias.shape == (2, 3, 5, VD) and feat.shape == (2, 3, 5, R)
    n = prev.shape[0] * prev.shape[1]
    flat_prev, flat_h = prev.reshape(n, -1), h.reshape(n, 5, HID)
    state = None  # every block starts fresh
    for k in range(5):
        b_k, f_k, state = head.step(flat_prev[:, k], flat_h[:, k], state)
        torch.testing.assert_close(b_k, bias.reshape(n, 5, VD)[:, k], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(f_k, feat.reshape(n, 5, R)[:, k], atol=1e-6, rtol=1e-6)
        assert (state is None) == (kind != "rnn")


def test_rnn_state_resets_per_block_and_carries_within():
    torch.manual_seed(2)
    head = _head("rnn")
    prev, h = _inputs(seed=3, b=1, a=2)
    bias, _ = head(prev, h)
    # Block 1 alone equals block 1 in the batch (no state leaks from block 0).
    alone, _ = head(prev[:, 1:], h[:, 1:])
    torch.testing.assert_close(alone[:, 0], bias[:, 1], atol=1e-6, rtol=1e-6)
    # Within a block, position 2 depends on the token fed at position 0 (through the state).
    prev2 = prev.clone()
    prev2[0, 0, 0] = (prev[0, 0, 0] + 1) % V
    bias2, _ = head(prev2, h)
    assert (bias2[0, 0, 2] - bias[0, 0, 2]).abs().max() > 1e-6


def test_vanilla_bias_by_hand():
    torch.manual_seed(4)
    head = _head()
    prev, h = _inputs(seed=5)
    bias, feat = head(prev, h)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V, r], [V_draft, r]
    for idx in [(0, 0, 0), (1, 2, 4), (0, 1, 3)]:
        e = w1[prev[idx]]
        torch.testing.assert_close(feat[idx], e)
        torch.testing.assert_close(bias[idx], torch.stack([w2[v] @ e for v in range(VD)]), atol=1e-6, rtol=1e-6)


def test_gated_by_hand():
    torch.manual_seed(6)
    head = _head("gated")
    prev, h = _inputs(seed=7)
    bias, _ = head(prev, h)
    idx = (1, 0, 2)
    e = head.markov_w1.weight[prev[idx]]
    gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([h[idx], e]) + head.gate_proj.bias)
    torch.testing.assert_close(bias[idx], head.markov_w2.weight @ (gate * e), atol=1e-6, rtol=1e-6)


def test_parameter_names_and_bad_kind():
    names = {n for n, _ in build_markov_head(V, 7, R, HID).named_parameters()}
    assert names == {"markov_w1.weight", "markov_w2.weight"}
    assert build_markov_head(V, 7, R, HID).markov_w2.weight.shape == (7, R)
    with pytest.raises(ValueError, match="markov_head_type"):
        build_markov_head(V, V, R, HID, kind="lstm")


@pytest.mark.parametrize("bias", [False, True])
def test_confidence_head(bias):
    torch.manual_seed(8)
    head = ConfidenceHead(HID + R, bias=bias)
    assert (head.proj.bias is not None) == bias
    h, feat = torch.randn(2, 5, HID), torch.randn(2, 5, R)
    logit = head(h, feat)
    ref = torch.cat([h, feat], -1) @ head.proj.weight[0] + (head.proj.bias[0] if bias else 0.0)
    assert logit.shape == (2, 5) and logit.dtype == torch.float32
    torch.testing.assert_close(logit, ref, atol=1e-6, rtol=1e-6)
