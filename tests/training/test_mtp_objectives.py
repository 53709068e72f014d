"""MTP objective: per-step label alignment against a naive loop, beta^k step weights, CE / KL losses and
the tau-like metrics against direct computations on hand-sized tensors."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.training.mtp_objectives import (
    MTPLossWeights, StepOutputs, kl_to_teacher, mtp_losses, recursive_forward, step_rows, step_weights,
)

K = 3


class RecordingDraft:
    """A fake MTP draft whose hidden records its history: channel 0 = context row id, channel 1 + k = the
    token step k consumed, channel 1 + K + k = the position step k used. logits = the hidden itself. Each row's
    "kv" is (step, row, position), and every step's attention mask is kept, so the keys a query sees can be read."""

    attention_window = None

    def __init__(self):
        self.config = type("Cfg", (), {"num_layers": 1})()
        self.masks: list[torch.Tensor] = []

    def step_rows(self, input_ids, hidden, position_ids, layer_idx, past, mask):
        out = hidden.clone()
        out[..., 1 + layer_idx] = input_ids.float()
        out[..., 1 + K + layer_idx] = position_ids.float()
        b, t = input_ids.shape
        kv = torch.stack([torch.full((b, t), layer_idx), torch.arange(t).expand(b, t), position_ids], -1)  # [B,T,3]
        self.masks.append((mask, kv if past is None else torch.cat([past, kv], 1)))
        return out, kv

    def logits(self, hidden_out, layer_idx=0):
        return hidden_out


def test_training_chain_attends_like_the_served_chain():
    """Chain t's depth-k row sees exactly the step-0 rows 0..t and its own rows at depths 1..k (vLLM's
    target_dependent_ar recursion: context rows built once, one appended row per step), not the depth-k rows
    of other chains (the old full-prefix recursion)."""
    b, s = 2, 7
    ids = torch.arange(b * s).view(b, s)
    draft = RecordingDraft()
    recursive_forward(draft, torch.zeros(b, s, 1 + 2 * K), ids, torch.ones_like(ids), torch.zeros(b, s, 1), K)
    assert len(draft.masks) == K
    for k, (mask, keys) in enumerate(draft.masks):
        for bi in range(b):
            for t in range(s - k - 1):
                seen = {(int(d), int(r), int(p)) for d, r, p in keys[bi][mask[bi, t]]}
                want = {(0, j, j) for j in range(t + 1)} | {(m, t, t + m) for m in range(1, k + 1)}
                assert seen == want, (k, bi, t)


def test_step_alignment_matches_naive_loop():
    b, s = 2, 8
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    ctx = torch.zeros(b, s, 1 + 2 * K)
    ctx[..., 0] = torch.arange(s).float()  # context hidden of row t is "t"
    final = torch.arange(b * s).float().view(b, s, 1)  # final[b, p] = b * s + p: identifies the teacher row
    steps = recursive_forward(RecordingDraft(), ctx, ids, loss_mask, final, K)
    assert len(steps) == K
    for k, st in enumerate(steps):
        got = {(int(bi), int(t)): (st.hidden[n].tolist(), int(st.labels[n]), float(st.teacher_final[n, 0]))
               for n, (bi, t) in enumerate(st.rows)}
        expected = {}
        for bi in range(b):
            for t in range(s):
                if t + k + 2 >= s or not loss_mask[bi, t + k + 2]:
                    continue
                h = [float(t)] + [0.0] * (2 * K)
                for j in range(k + 1):  # step j fed the true token t + j + 1 at position t + j
                    h[1 + j] = float(ids[bi, t + j + 1])
                    h[1 + K + j] = float(t + j)
                expected[(bi, t)] = (h, int(ids[bi, t + k + 2]), float(bi * s + t + k + 1))
        assert got == expected, k
        torch.testing.assert_close(st.logits, st.hidden)  # logits of exactly the scored rows


def test_step_rows_by_hand_and_short_sequences():
    ids = torch.tensor([[5, 6, 7, 8]])
    r = step_rows(ids, torch.ones_like(ids), 1)
    assert r.input_ids.tolist() == [[7, 8]] and r.positions.tolist() == [[1, 2]]
    assert r.labels.tolist() == [[8]] and r.teacher_positions.tolist() == [2]
    with pytest.raises(ValueError, match="at least 5 tokens"):
        step_rows(ids, torch.ones_like(ids), 3)
    # steps that would need longer sequences are skipped, not mis-aligned
    steps = recursive_forward(RecordingDraft(), torch.zeros(1, 4, 1 + 2 * K), ids, torch.ones_like(ids),
                              torch.zeros(1, 4, 1), K)
    assert len(steps) == 2 and [s.labels.tolist() for s in steps] == [[7, 8], [8]]


def test_step_weights_beta_powers_normalised():
    torch.testing.assert_close(step_weights(3, 0.5), torch.tensor([4 / 7, 2 / 7, 1 / 7]))
    torch.testing.assert_close(step_weights(2, 0.6), torch.tensor([1 / 1.6, 0.6 / 1.6]))
    with pytest.raises(ValueError, match="beta"):
        step_weights(3, 0.0)


def _naive_kl(d, t):
    p = [math.exp(x) for x in t]
    zp = sum(p)
    q = [math.exp(x) for x in d]
    zq = sum(q)
    return sum(pi / zp * (math.log(pi / zp) - math.log(qi / zq)) for pi, qi in zip(p, q))


def test_losses_and_metrics_against_direct_computation():
    # batch 1, 3 metric rows, K = 2. Step 0 scores rows 0, 1, 2; step 1 scores rows 0 and 2 (row 1 masked).
    d0 = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    t0 = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0]])  # rows 0, 2 identical to the draft
    d1 = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    t1 = torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])
    lab0, lab1 = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    s0 = StepOutputs(d0, lab0, torch.zeros(3, 1), torch.tensor([[0, 0], [0, 1], [0, 2]]), d0)
    s1 = StepOutputs(d1, lab1, torch.zeros(2, 1), torch.tensor([[0, 0], [0, 2]]), d1)
    beta = 0.5
    out = mtp_losses([s0, s1], [t0, t1], num_steps=2, beta=beta, weights=MTPLossWeights(ce=0.3, kl=0.7),
                     batch_rows=(1, 3))
    w0, w1 = 1 / 1.5, 0.5 / 1.5
    ce0 = sum(-F.log_softmax(d0[i], -1)[lab0[i]].item() for i in range(3)) / 3
    ce1 = sum(-F.log_softmax(d1[i], -1)[lab1[i]].item() for i in range(2)) / 2
    kl0 = sum(_naive_kl(d0[i].tolist(), t0[i].tolist()) for i in range(3)) / 3
    kl1 = sum(_naive_kl(d1[i].tolist(), t1[i].tolist()) for i in range(2)) / 2
    assert out["ce"].item() == pytest.approx(w0 * ce0 + w1 * ce1, rel=1e-5)
    assert out["kl"].item() == pytest.approx(w0 * kl0 + w1 * kl1, rel=1e-5)
    assert out["loss"].item() == pytest.approx(0.3 * (w0 * ce0 + w1 * ce1) + 0.7 * (w0 * kl0 + w1 * kl1), rel=1e-5)
    # metrics: eval mask is cumulative (row 1 stops after step 0). top-1: step 0 rows 0, 2 agree, row 1
    # not (argmax 1 vs 0); step 1 row 0 agrees, row 2 not.
    assert out["agree_count"].tolist() == [2.0, 1.0] and out["agree_total"].tolist() == [3.0, 2.0]

    def c_star(d, t):
        return max(0.0, 1 - 0.5 * (d.softmax(-1) - t.softmax(-1)).abs().sum().item())

    c = {(0, 0): 1.0, (1, 0): c_star(d0[1], t0[1]), (2, 0): 1.0, (0, 1): 1.0, (2, 1): c_star(d1[1], t1[1])}
    tau = ((1 + c[0, 0] + c[0, 0] * c[0, 1]) + (1 + c[1, 0]) + (1 + c[2, 0] + c[2, 0] * c[2, 1])) / 3
    assert out["tau_prob"].item() == pytest.approx(tau, rel=1e-5)
    # gradient flows to the draft logits only through the weighted losses
    d0g = d0.clone().requires_grad_(True)
    s0g = StepOutputs(d0g, lab0, torch.zeros(3, 1), s0.rows, d0g)
    mtp_losses([s0g], [t0], num_steps=1, beta=beta, weights=MTPLossWeights(ce=1.0, kl=0.0),
               batch_rows=(1, 3))["loss"].backward()
    ref = (F.softmax(d0, -1) - F.one_hot(lab0, 3)) / 3
    torch.testing.assert_close(d0g.grad, ref)


def test_row_normalizers_make_two_shards_average_to_the_full_batch():
    """DDP contract: each 'rank' divides by the global rows per step / world size; the mean of the ranks'
    losses and gradients is then the one-process loss and gradient (shards of unequal size)."""
    torch.manual_seed(0)
    d = torch.randn(5, 4, requires_grad=True)
    t = torch.randn(5, 4)
    lab = torch.tensor([0, 3, 1, 2, 2])
    rows = torch.tensor([[0, i] for i in range(5)])
    kw = dict(num_steps=1, beta=0.6, weights=MTPLossWeights(ce=0.4, kl=0.6), batch_rows=(1, 5), metrics=False)
    full = mtp_losses([StepOutputs(d, lab, torch.zeros(5, 1), rows, d)], [t], **kw)["loss"]
    (g_full,) = torch.autograd.grad(full, d)
    shards = [slice(0, 1), slice(1, 5)]  # 1 row and 4 rows
    per_rank = [mtp_losses([StepOutputs(d[sl], lab[sl], torch.zeros(1, 1), rows[sl], d[sl])], [t[sl]],
                           row_normalizers=torch.tensor([5 / 2]), **kw)["loss"] for sl in shards]
    mean = sum(per_rank) / 2
    (g_mean,) = torch.autograd.grad(mean, d)
    torch.testing.assert_close(mean, full)
    torch.testing.assert_close(g_mean, g_full)
    naive = sum(mtp_losses([StepOutputs(d[sl], lab[sl], torch.zeros(1, 1), rows[sl], d[sl])], [t[sl]], **kw)["loss"]
                for sl in shards) / 2
    assert abs(float(naive) - float(full)) > 1e-3  # per-rank means would optimise something else


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    x = torch.randn(4, 7)
    torch.testing.assert_close(kl_to_teacher(x, x + 3.0), torch.zeros(4), atol=1e-6, rtol=0)
    assert (kl_to_teacher(x, torch.randn(4, 7)) > 0).all()
