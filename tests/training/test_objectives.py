"""Every loss part and metric against a naive per-row loop (docs/CONTRACTS.md §3), through the one loss function,
fused and materialised. The LM head is the identity (H = V), so the draft and teacher rows ARE the logits and the
loop reads them directly."""
import math

import pytest
import torch

from dspark.training.objectives import LossWeights
from dspark.training.objectives import draft_losses as draft_losses_of_rows

PATHS = pytest.mark.parametrize("materialise", [False, True], ids=["fused", "materialised"])


def draft_losses(logits, labels, mask, teacher, conf, *, materialise, **kw):
    """draft_losses over logits [N, g, V] with decay_gamma 4: rows = logits and an identity head [V, V] (the fused
    path in chunks of 3 rows)."""
    eye = torch.eye(logits.shape[-1])
    return draft_losses_of_rows(logits, teacher, eye, None, None, labels, mask, conf, decay_gamma=4.0, chunk_rows=3,
                                backend="torch", materialise=materialise, **kw)


def naive(logits, labels, mask, teacher, conf, decay):
    N, g, V = logits.shape
    sw = ce = l1 = cf = 0.0
    taus = []
    for n in range(N):
        prod, tau = 1.0, 1.0
        for k in range(g):
            q = torch.softmax(logits[n, k].double(), -1)
            p = torch.softmax(teacher[n, k].double(), -1)
            d = sum(abs(float(q[v] - p[v])) for v in range(V))
            c = min(max(1 - 0.5 * d, 0.0), 1.0)
            if mask[n, k]:
                prod *= c
                tau += prod
            else:
                prod = 0.0
            if not mask[n, k]:
                continue
            w = math.exp(-k / decay)
            sw += w
            ce += w * -math.log(float(q[labels[n, k]]))
            l1 += w * d
            s = 1 / (1 + math.exp(-float(conf[n, k])))
            cf += w * -(c * math.log(s) + (1 - c) * math.log(1 - s))
        if mask[n, 0]:
            taus.append(tau)
    return ce / sw, l1 / sw, cf / sw, sum(taus) / len(taus)


def make(seed=0, N=5, g=4, V=7):
    torch.manual_seed(seed)
    logits = torch.randn(N, g, V) * 2
    teacher = torch.randn(N, g, V) * 2
    labels = torch.randint(0, V, (N, g))
    conf = torch.randn(N, g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]).bool()
    return logits, labels, mask, teacher, conf


@PATHS
def test_losses_match_naive_loop(materialise):
    logits, labels, mask, teacher, conf = make()
    out = draft_losses(logits, labels, mask, teacher, conf, materialise=materialise, weights=LossWeights())
    ce, l1, cf, tau = naive(logits, labels, mask, teacher, conf, 4.0)
    assert abs(out["ce"].item() - ce) < 1e-5
    assert abs(out["l1"].item() - l1) < 1e-5
    assert abs(out["conf"].item() - cf) < 1e-5
    assert abs(out["tau_prob"].item() - tau) < 1e-5
    assert abs(out["loss"].item() - (0.1 * ce + 0.9 * l1 + 1.0 * cf)) < 1e-5


@PATHS
def test_agreement_counts_per_position(materialise):
    logits, labels, mask, teacher, conf = make(1)
    out = draft_losses(logits, labels, mask, teacher, conf, materialise=materialise, weights=LossWeights())
    hit = logits.argmax(-1) == teacher.argmax(-1)
    for k in range(4):
        assert out["agree_total"][k].item() == mask[:, k].sum().item()
        assert out["agree_count"][k].item() == (hit[:, k] & mask[:, k]).sum().item()


@PATHS
def test_confidence_target_is_detached_and_ce_only_mode(materialise):
    logits, labels, mask, teacher, conf = make(2)
    logits.requires_grad_(True)
    conf.requires_grad_(True)
    out = draft_losses(logits, labels, mask, teacher, conf, materialise=materialise,
                       weights=LossWeights(ce=0.0, l1=0.0, conf=1.0))
    out["loss"].backward()
    assert logits.grad is None or logits.grad.abs().sum() == 0  # c* carries no gradient
    assert conf.grad.abs().sum() > 0
    ce_only = draft_losses(logits.detach(), labels, mask, None, None, materialise=materialise,
                           weights=LossWeights(ce=1.0, l1=0.0, conf=0.0))
    assert set(ce_only) == {"ce", "loss"}
    assert torch.allclose(ce_only["loss"], ce_only["ce"])


@PATHS
def test_identical_draft_and_teacher_give_perfect_acceptance(materialise):
    logits, labels, mask, _, conf = make(3)
    out = draft_losses(logits, labels, mask, logits.clone(), conf, materialise=materialise, weights=LossWeights())
    assert out["l1"].item() < 1e-6
    # tau = 1 + number of valid positions, averaged over blocks with a valid first position
    expect = torch.stack([1 + m.sum() for m in mask if m[0]]).float().mean()
    assert abs(out["tau_prob"].item() - expect.item()) < 1e-5


@PATHS
def test_external_normalizer_scales_loss(materialise):
    logits, labels, mask, teacher, conf = make(4)
    a = draft_losses(logits, labels, mask, teacher, conf, materialise=materialise, weights=LossWeights())
    from dspark.training.objectives import position_weights
    s = position_weights(mask, 4.0).sum()
    b = draft_losses(logits, labels, mask, teacher, conf, materialise=materialise, weights=LossWeights(),
                     normalizer=2 * s)
    assert torch.allclose(b["loss"], a["loss"] / 2, atol=1e-6)
