"""DSpark / DFlash training objectives and metrics (docs/CONTRACTS.md §3).

All inputs are per prediction: N blocks x g drafted positions.
  w_k    = eval_mask_k * exp(-k / decay_gamma)                      (k 0-based)
  L_ce   = sum w_k CE(logits_k, label_k) / sum w_k
  L_l1   = sum w_k ||q_k - p_k||_1 / sum w_k                         (q = softmax(draft), p = teacher)
  c*_k   = clamp(1 - 0.5 ||q_k - p_k||_1, 0, 1), detached
  L_conf = sum w_k BCEWithLogits(conf_logit_k, c*_k) / sum w_k
  L      = w_ce L_ce + w_l1 L_l1 + w_conf L_conf
  tau_prob = 1 + sum_k prod_{j<=k} c*_j   (expected accepted length incl. bonus; mean over blocks)

`normalizer` lets the caller divide by a sum of weights taken over more than this call's rows (all DDP
ranks), so that a data-parallel run optimises exactly the same objective as one process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.ops.fused_loss import DEFAULT_CHUNK_ROWS, lm_loss


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0


def position_weights(eval_mask: torch.Tensor, decay_gamma: float | None) -> torch.Tensor:
    """eval_mask [N, g] -> w [N, g] float = eval_mask * exp(-k / decay_gamma) (no decay when None)."""
    g = eval_mask.shape[-1]
    k = torch.arange(g, device=eval_mask.device, dtype=torch.float32)
    decay = torch.ones_like(k) if decay_gamma is None else torch.exp(-k / decay_gamma)
    return eval_mask.float() * decay


def acceptance_targets(l1: torch.Tensor) -> torch.Tensor:
    """c*_k = clamp(1 - 0.5 * L1, 0, 1), detached. [N, g] -> [N, g]."""
    return (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)


def tau_prob(c_star: torch.Tensor, eval_mask: torch.Tensor) -> torch.Tensor:
    """Mean over blocks with at least one valid position of 1 + sum_k prod_{j<=k} c*_j (invalid -> 0)."""
    c = c_star * eval_mask.float()
    per_block = 1.0 + c.cumprod(-1).sum(-1)  # [N]
    valid = eval_mask[:, 0]
    if not bool(valid.any()):
        return torch.zeros((), device=c.device)
    return per_block[valid].mean()


def _confidence_and_metrics(out, loss, w, denom, l1, hit, eval_mask, conf_logits, weights) -> torch.Tensor:
    """Adds "conf", "tau_prob", "agree_count", "agree_total" to `out` from the per-row L1 [N, g] and the
    top-1 agreement hit [N, g]; returns the loss with the confidence part added."""
    c_star = acceptance_targets(l1)
    if conf_logits is not None and weights.conf:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        out["conf"] = (w * bce).sum() / denom
        loss = loss + weights.conf * out["conf"]
    with torch.no_grad():
        out["tau_prob"] = tau_prob(c_star, eval_mask)
        m = eval_mask.float()
        out["agree_count"] = (hit.float() * m).sum(0)  # [g]
        out["agree_total"] = m.sum(0)  # [g]
    return loss


def draft_losses(
    draft_rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    lm_head: torch.Tensor,
    markov_latent: torch.Tensor | None,
    markov_w2: torch.Tensor | None,
    labels: torch.Tensor,
    eval_mask: torch.Tensor,
    conf_logits: torch.Tensor | None,
    *,
    decay_gamma: float | None,
    weights: LossWeights,
    normalizer: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_rows: int | None = None,
    teacher_head: tuple[torch.Tensor, torch.Tensor] | None = None,
    materialise: bool = False,
) -> dict[str, torch.Tensor]:
    """The block objective's loss parts and metrics from hidden rows, through the one LM loss
    (dspark.ops.fused_loss.lm_loss): fused by default, no [N, g, V] logits ever materialised; materialise=True runs
    the same from full logits and autograd (the reference; train.fused_loss=false). The draft logits are
    lm_head(draft_rows) + markov_latent @ markov_w2^T, the teacher's lm_head(teacher_rows).

    draft_rows [N, g, H] (the LM head input: the draft's normed hidden), teacher_rows [N, g, H] (target
    final hidden) or None (no teacher GEMM: CE only, no l1 / tau_prob / agreement), lm_head [V, H] (frozen; a
    reduced draft: the target head's rows at its ids), markov_latent [N, g, r] or None, markov_w2 [V, r] or None,
    labels / eval_mask [N, g] (labels in the draft's ids; -1: a token outside a reduced draft's vocabulary, no CE
    there), conf_logits [N, g] or None, teacher_head (the full target head [Vt, H], the target id of every draft id
    [V]) or None: the teacher over its whole vocabulary (a reduced draft's true L1, fused_loss docstring). Only rows
    with eval_mask set are computed.
    Returns {"loss", "ce", "l1", "conf", "tau_prob", "agree_count" [g], "agree_total" [g]}: top-1 agreement with the
    teacher per position is agree_count / agree_total; parts switched off (weight 0 or inputs None) are absent.
    "ce" and "l1" are reported detached; "loss" carries the gradient of every part.
    """
    w = position_weights(eval_mask, decay_gamma)  # [N, g]
    denom = (w.sum() if normalizer is None else normalizer).clamp_min(1e-8)
    shape = eval_mask.shape
    idx = eval_mask.flatten().nonzero().squeeze(1)  # valid rows [M]
    rows = lambda t: t.flatten(0, 1).index_select(0, idx)  # noqa: E731  [N, g, ...] -> [M, ...]
    wv = rows(w) / denom  # [M]
    lab = rows(labels)
    in_vocab = lab >= 0  # [M] False: a label a reduced draft cannot produce (no CE row)
    teacher = teacher_rows is not None
    tw, cols = teacher_head if teacher_head is not None else (None, None)
    lm, ce_v, l1_v, d_arg, t_arg = lm_loss(
        rows(draft_rows), rows(teacher_rows) if teacher else None, lm_head,
        None if markov_latent is None else rows(markov_latent), markov_w2,
        lab.clamp_min(0), wv * weights.ce * in_vocab, wv * weights.l1,
        backend=backend, chunk_rows=chunk_rows or DEFAULT_CHUNK_ROWS, teacher_w=tw, teacher_cols=cols,
        materialise=materialise,
    )
    out: dict[str, torch.Tensor] = {}
    if weights.ce:
        out["ce"] = (wv * ce_v * in_vocab).sum() / (wv * in_vocab).sum().clamp_min(1e-12) * wv.sum()
    loss = lm if (weights.ce or (weights.l1 and teacher)) else torch.zeros((), device=draft_rows.device)
    if not teacher:
        out["loss"] = loss
        return out
    scatter = lambda v, fill=0: torch.full((shape.numel(),), fill, dtype=v.dtype, device=v.device).index_copy(  # noqa: E731
        0, idx, v).view(shape)
    l1 = scatter(l1_v)  # [N, g]
    hit = scatter(d_arg, 0) == scatter(t_arg, -1)  # invalid rows never hit
    if weights.l1:
        out["l1"] = (wv * l1_v).sum()
    out["loss"] = _confidence_and_metrics(out, loss, w, denom, l1, hit, eval_mask, conf_logits, weights)
    return out
