"""What the fused LM loss takes and gives, shared by the torch reference (dspark.ops.fused_loss) and the tilelang
kernels (dspark.ops.kernels.fused_loss_tl): the result record and the input checks (shapes and id ranges), so that
neither implementation imports the other."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LMLossParts:
    """Everything one pass produces. Rows are [N]; gradients are of `sum a ce + b l1` (None when not asked)."""

    ce: torch.Tensor  # [N] fp32
    l1: torch.Tensor  # [N] fp32
    draft_argmax: torch.Tensor  # [N] long
    teacher_argmax: torch.Tensor  # [N] long
    grad_x: torch.Tensor | None = None  # [N, H] fp32
    grad_latent: torch.Tensor | None = None  # [N, r] fp32
    grad_w2: torch.Tensor | None = None  # [V, r] fp32


def check_inputs(x, y, w, latent, w2, labels, coef_ce, coef_l1, teacher_w=None, teacher_cols=None) -> None:
    if x.dim() != 2 or (y is not None and y.shape != x.shape):
        raise ValueError(f"lm_loss: draft rows [N, H] and teacher rows must match, got {tuple(x.shape)} "
                         f"and {None if y is None else tuple(y.shape)}")
    n, h = x.shape
    if (teacher_w is None) != (teacher_cols is None):
        raise ValueError("lm_loss: pass both teacher_w and teacher_cols, or neither")
    if teacher_w is not None:
        if y is None or teacher_w.dim() != 2 or teacher_w.shape[1] != h:
            raise ValueError(f"lm_loss: teacher_w must be [Vt, {h}] with teacher rows, got "
                             f"{tuple(teacher_w.shape)}")
        if tuple(teacher_cols.shape) != (w.shape[0],) or (teacher_cols.numel() and (
                int(teacher_cols.min()) < 0 or int(teacher_cols.max()) >= teacher_w.shape[0])):
            raise ValueError(f"lm_loss: teacher_cols must be [{w.shape[0]}] ids in [0, {teacher_w.shape[0]})")
    if w.dim() != 2 or w.shape[1] != h:
        raise ValueError(f"lm_loss: lm_head must be [V, {h}], got {tuple(w.shape)}")
    v = w.shape[0]
    if (latent is None) != (w2 is None):
        raise ValueError("lm_loss: pass both the Markov latent and markov_w2, or neither")
    if latent is not None:
        if latent.dim() != 2 or latent.shape[0] != n:
            raise ValueError(f"lm_loss: Markov latent must be [{n}, r], got {tuple(latent.shape)}")
        if tuple(w2.shape) != (v, latent.shape[1]):
            raise ValueError(f"lm_loss: markov_w2 must be [{v}, {latent.shape[1]}], got {tuple(w2.shape)}")
    for name, t in (("labels", labels), ("coef_ce", coef_ce), ("coef_l1", coef_l1)):
        if tuple(t.shape) != (n,):
            raise ValueError(f"lm_loss: {name} must be [{n}], got {tuple(t.shape)}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= v):
        raise ValueError(f"lm_loss: labels must lie in [0, {v}), got range [{int(labels.min())}, "
                         f"{int(labels.max())}]")
