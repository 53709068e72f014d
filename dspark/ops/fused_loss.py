"""Fused DSpark LM loss: L_ce and L_l1 straight from hidden rows, without an [N, V] fp32 tensor.

Per row n (one drafted position), with the frozen LM head W [V, H] and the Markov projection W2 [V, r]:
    d_n = W x_n + W2 e_n          draft logits (e_n: the Markov latent; absent for drafts without one)
    t_n = W y_n                   teacher logits (y_n: the target's final hidden row)
    q = softmax(d_n), p = softmax(t_n)
    ce_n = -log q[label_n],  l1_n = ||q - p||_1
    loss = sum_n a_n ce_n + b_n l1_n            (a_n, b_n: per-row coefficients, loss weights folded in)
Gradient w.r.t. the draft logits (s = sign(q - p), c_n = sum_v q s):
    dloss/dd_n = a_n (q - onehot(label_n)) + b_n q (s - c_n)
and from there grad x = dD W, grad e = dD W2, grad W2 = dD^T E.

Reduced draft vocabulary (the draft scores Vd of the target's V tokens): w is the target head's rows at the kept
ids [Vd, H] and labels are draft ids. The teacher is either restricted to the same rows (p = softmax over the kept
ids, renormalised: the training step, as EAGLE-3 / speculators train reduced drafts) or, with `teacher_w` [Vt, H]
(the full head) and `teacher_cols` [Vd] (the teacher-vocabulary id of every draft id), the target's full
distribution: l1_n = sum_{kept} |q - p| + (1 - sum_{kept} p), the true total variation against a draft that puts no
mass outside its vocabulary (held-out metrics); the gradient is the same formula with p taken at the kept ids.
`y = None` runs no teacher GEMM at all (CE-only training): l1 and teacher_argmax come back as NaN / -1.

Because the loss is a weighted sum with coefficients known in the forward, the forward computes the
gradients too (row chunk by row chunk, in a few [chunk, V] buffers allocated once and reused by every chunk) and the
backward only scales them by the incoming scalar gradient: no second pass over the vocabulary.
The teacher side (y, W) is frozen and gets no gradient.

`lm_loss` is the one entry point: it dispatches (dspark.ops.backend) between the chunked torch reference here and the
tilelang kernels (dspark.ops.kernels.fused_loss_tl) on CUDA, or, with materialise=True, runs the materialised
computation (full [N, V] logits, autograd: `lm_loss_naive`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.ops import backend as _backend
from dspark.ops import loss_rows_cpu
from dspark.ops.kernels.fused_loss_tl import lm_loss_tilelang
from dspark.ops.lm_loss_io import LMLossParts, check_inputs

DEFAULT_CHUNK_ROWS = 256  # rows per chunk: big enough that the LM-head GEMMs stay efficient on CPU


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32 (float64 only for float64 inputs, i.e. gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def draft_logits_rows(x, w, latent=None, w2=None) -> torch.Tensor:
    """Draft logits for a few rows, as the draft computes them: x [n, H] -> [n, V] fp32."""
    d = F.linear(x.to(w.dtype), w).to(_acc(w))
    if latent is not None:
        d += F.linear(latent.to(w2.dtype), w2).to(_acc(w))
    return d


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, low: torch.Tensor | None,
               accumulate: bool = False) -> None:
    """out (acc dtype) = / += a @ b_t, the product taken in b_t's dtype; `low` is a scratch buffer of out's shape in
    b_t's dtype when that differs from out's (bf16 LM head: bf16 GEMM, fp32 result), else None."""
    a = a.to(b_t.dtype)
    if low is None:
        if accumulate:
            out.addmm_(a, b_t)
        else:
            torch.mm(a, b_t, out=out)
        return
    torch.mm(a, b_t, out=low)
    if accumulate:
        out.add_(low)
    else:
        out.copy_(low)


def lm_loss_reference(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, latent: torch.Tensor | None,
                      w2: torch.Tensor | None, labels: torch.Tensor, coef_ce: torch.Tensor, coef_l1: torch.Tensor, *,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS, need_grads: bool = True,
                      teacher_w: torch.Tensor | None = None, teacher_cols: torch.Tensor | None = None) -> LMLossParts:
    """Chunked torch reference: rows in chunks of `chunk_rows`, peak extra memory ~3 x chunk_rows x V in the
    accumulation dtype (+ 1 in the LM head's dtype when that is lower), allocated once and reused by every chunk
    (a fresh [chunk, V] tensor per step costs page faults on CPU: about a third of the GEMM's time at V = 152 K).

    x, y [N, H] (y None: no teacher); w [V, H]; latent [N, r] | None; w2 [V, r] | None; labels [N]; coef_ce,
    coef_l1 [N]; teacher_w [Vt, H] + teacher_cols [V] | None (module docstring).
    The LM-head GEMMs (and the Markov ones) run in w's dtype, everything else in float32 (float64 for float64
    inputs). Autocast is off inside: the dtypes here are explicit.
    """
    check_inputs(x, y, w, latent, w2, labels, coef_ce, coef_l1, teacher_w, teacher_cols)
    if chunk_rows < 1:
        raise ValueError(f"lm_loss: chunk_rows must be >= 1, got {chunk_rows}")
    with torch.autocast(x.device.type, enabled=False), torch.no_grad():
        return _lm_loss_chunks(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows, need_grads,
                               teacher_w, teacher_cols)


def _teacher_probs(s, y, w_t, tw_t, cols, low, t_arg) -> torch.Tensor | None:
    """p at the draft's ids into s [m, V] (fp32); the teacher argmax into t_arg [m] (in the teacher's ids: the
    draft's own when there is no teacher_w); returns the teacher mass outside the draft's ids [m] (None when the
    teacher is restricted to them)."""
    if tw_t is None:
        _gemm_into(s, y, w_t, low)
        p_max, t_arg[:] = s.max(-1)
        s.sub_(p_max.unsqueeze(1)).exp_()
        s.mul_(s.sum(-1).reciprocal().unsqueeze(1))
        return None
    full = torch.mm(y.to(tw_t.dtype), tw_t).to(s.dtype)  # [m, Vt]
    p_max, t_arg[:] = full.max(-1)
    full.sub_(p_max.unsqueeze(1)).exp_()
    full.mul_(full.sum(-1).reciprocal().unsqueeze(1))
    torch.index_select(full, 1, cols, out=s)
    return (1.0 - s.sum(-1)).clamp_min(0.0)


def _lm_loss_chunks(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows, need_grads, teacher_w=None,
                    teacher_cols=None) -> LMLossParts:
    if loss_rows_cpu.usable(x, w, teacher_w):
        return _lm_loss_chunks_cpu(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows, need_grads)
    n, v = x.shape[0], w.shape[0]
    dev = x.device
    acc = _acc(w)
    ce = torch.empty(n, device=dev, dtype=acc)
    l1 = torch.empty(n, device=dev, dtype=acc)
    d_arg = torch.empty(n, dtype=torch.long, device=dev)
    t_arg = torch.empty(n, dtype=torch.long, device=dev)
    gx = torch.empty(n, x.shape[1], device=dev, dtype=acc) if need_grads else None
    markov = latent is not None
    ge = torch.empty(n, latent.shape[1], device=dev, dtype=acc) if (need_grads and markov) else None
    gw2 = torch.zeros(w2.shape, device=dev, dtype=acc) if (need_grads and markov) else None
    a_all, b_all = coef_ce.to(acc), coef_l1.to(acc)
    rows = min(n, chunk_rows)
    # reused [rows, V] buffers: Q (draft logits -> q), S (teacher logits -> p -> q - p -> sign -> dD), T (q * sign)
    Q = torch.empty(rows, v, device=dev, dtype=acc)
    S = torch.empty(rows, v, device=dev, dtype=acc)
    T = torch.empty(rows, v, device=dev, dtype=acc) if need_grads else None
    low_dtype = w.dtype if w.dtype != acc else None
    low = None if low_dtype is None else torch.empty(rows, v, device=dev, dtype=low_dtype)
    w_t = w.t()  # [H, V]
    tw_t = None if teacher_w is None else teacher_w.t()  # [H, Vt]
    teacher = y is not None
    if not teacher:
        l1.fill_(float("nan"))
        t_arg.fill_(-1)
    w2_low = None if not markov else w2.to(w.dtype)  # Markov GEMMs in the LM head's dtype too
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        m = hi - lo
        q, s = Q[:m], S[:m]
        lab = labels[lo:hi].long().unsqueeze(1)  # [m, 1]
        e = None if not markov else latent[lo:hi]
        # draft: logits -> q = softmax, ce = lse - logit[label]
        _gemm_into(q, x[lo:hi], w_t, None if low is None else low[:m])
        if markov:
            _gemm_into(q, e, w2_low.t(), None if low is None else low[:m], accumulate=True)
        d_max, d_arg[lo:hi] = q.max(-1)  # one pass: the row max and the first argmax
        d_lab = q.gather(1, lab).squeeze(1)
        q.sub_(d_max.unsqueeze(1)).exp_()
        z = q.sum(-1)  # [m]
        ce[lo:hi] = z.log() + d_max - d_lab
        q.mul_(z.reciprocal().unsqueeze(1))
        a = a_all[lo:hi].unsqueeze(1)  # [m, 1]
        if teacher:  # p = softmax(y W^T) at the draft's ids, then s = sign(q - p)
            outside = _teacher_probs(s, y[lo:hi], w_t, tw_t, teacher_cols, None if low is None else low[:m],
                                     t_arg[lo:hi])
            torch.sub(q, s, out=s)  # q - p
            l1[lo:hi] = torch.linalg.vector_norm(s, 1, dim=-1) + (0.0 if outside is None else outside)
            s.sign_()  # sign(q - p)
        if not need_grads:
            continue
        if teacher:
            b = b_all[lo:hi].unsqueeze(1)
            c = torch.mul(q, s, out=T[:m]).sum(-1, keepdim=True)  # sum_v q sign(q - p)   [m, 1]
            dd = torch.addcmul(a - b * c, s, b, out=s).mul_(q)  # q (a + b (sign - c)) = a q + b q (s - c)
        else:
            dd = torch.mul(q, a, out=s)  # a q
        dd.scatter_add_(1, lab, -a)  # - a onehot(label)
        if low is None:
            torch.mm(dd, w, out=gx[lo:hi])  # [m, H]
            if markov:
                torch.mm(dd, w2_low, out=ge[lo:hi])  # [m, r]
                gw2.addmm_(dd.t(), e.to(acc))  # [V, r]
        else:
            dl = low[:m]
            dl.copy_(dd)
            gx[lo:hi] = torch.mm(dl, w)
            if markov:
                ge[lo:hi] = torch.mm(dl, w2_low)
                gw2.add_(torch.mm(dl.t(), e.to(low_dtype)))
    if teacher_cols is not None:
        d_arg = teacher_cols[d_arg]  # draft ids -> teacher ids, comparable with teacher_argmax
    return LMLossParts(ce, l1, d_arg, t_arg, gx, ge, gw2)


def _lm_loss_chunks_cpu(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows, need_grads) -> LMLossParts:
    """The chunk loop with each chunk's row work in one C++ pass per row (dspark.ops.loss_rows_cpu): the GEMMs
    write [chunk, V] buffers in the head's dtype (as the torch loop's), the kernel turns the draft's buffer into
    the gradient of its logits in place, and the gradient GEMMs read it as it is."""
    n, v = x.shape[0], w.shape[0]
    k = loss_rows_cpu.kernel()
    f32 = torch.float32
    ce, l1 = torch.empty(n, dtype=f32), torch.empty(n, dtype=f32)
    d_arg, t_arg = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    markov, teacher = latent is not None, y is not None
    gx = torch.empty(n, x.shape[1], dtype=f32) if need_grads else None
    ge = torch.empty(n, latent.shape[1], dtype=f32) if (need_grads and markov) else None
    gw2 = torch.zeros(w2.shape, dtype=f32) if (need_grads and markov) else None
    a_all, b_all = coef_ce.to(f32).contiguous(), coef_l1.to(f32).contiguous()
    lab_all = labels.long().contiguous()
    rows = min(n, chunk_rows)
    D = torch.empty(rows, v, dtype=w.dtype)  # draft logits -> their gradient
    M = torch.empty(rows, v, dtype=w.dtype) if markov else None  # the Markov term of the draft logits
    T = torch.empty(rows, v, dtype=w.dtype) if teacher else None  # teacher logits
    w_t = w.t()
    w2_low = w2.to(w.dtype) if markov else None
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        m = hi - lo
        e = latent[lo:hi].to(w.dtype) if markov else None
        torch.mm(x[lo:hi].to(w.dtype), w_t, out=D[:m])
        if markov:
            torch.mm(e, w2_low.t(), out=M[:m])
        if teacher:
            torch.mm(y[lo:hi].to(w.dtype), w_t, out=T[:m])
        k.loss_rows(D[:m], M[:m] if markov else None, T[:m] if teacher else None, lab_all[lo:hi], a_all[lo:hi],
                    b_all[lo:hi], ce[lo:hi], l1[lo:hi], d_arg[lo:hi], t_arg[lo:hi], need_grads)
        if need_grads:
            dd = D[:m]
            gx[lo:hi] = torch.mm(dd, w)
            if markov:
                ge[lo:hi] = torch.mm(dd, w2_low)
                gw2.add_(torch.mm(dd.t(), e))
    return LMLossParts(ce, l1, d_arg, t_arg, gx, ge, gw2)


def _impl(backend_name: str):
    if backend_name == "tilelang":
        return lm_loss_tilelang
    return lm_loss_reference


class _LMLoss(torch.autograd.Function):
    """loss = sum a ce + b l1 as a differentiable scalar; the gradients are computed in the forward."""

    @staticmethod
    def forward(ctx, x, y, w, latent, w2, labels, coef_ce, coef_l1, impl, chunk_rows, teacher):
        parts = impl(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows=chunk_rows, need_grads=True,
                     **teacher)
        loss = _weighted_sum(parts, coef_ce, coef_l1, y is not None)
        ctx.save_for_backward(parts.grad_x, parts.grad_latent, parts.grad_w2)
        ctx.dtypes = (x.dtype, None if latent is None else latent.dtype, None if w2 is None else w2.dtype)
        rows = (parts.ce, parts.l1, parts.draft_argmax, parts.teacher_argmax)
        ctx.mark_non_differentiable(*rows)
        return (loss, *rows)

    @staticmethod
    def backward(ctx, g_loss, *_):
        gx, ge, gw2 = ctx.saved_tensors
        dx, de, dw2 = ctx.dtypes
        out_x = (gx * g_loss).to(dx) if ctx.needs_input_grad[0] else None
        out_e = (ge * g_loss).to(de) if (ge is not None and ctx.needs_input_grad[3]) else None
        out_w2 = (gw2 * g_loss).to(dw2) if (gw2 is not None and ctx.needs_input_grad[4]) else None
        return out_x, None, None, out_e, out_w2, None, None, None, None, None, None


def _weighted_sum(parts: LMLossParts, coef_ce: torch.Tensor, coef_l1: torch.Tensor, teacher: bool) -> torch.Tensor:
    """sum a ce + b l1 (the l1 term only where a teacher ran: without one l1 is NaN)."""
    loss = (coef_ce.to(parts.ce.dtype) * parts.ce).sum()
    if teacher:
        loss = loss + (coef_l1.to(parts.l1.dtype) * parts.l1).sum()
    return loss


def lm_loss(
    x: torch.Tensor,
    y: torch.Tensor | None,
    w: torch.Tensor,
    latent: torch.Tensor | None,
    w2: torch.Tensor | None,
    labels: torch.Tensor,
    coef_ce: torch.Tensor,
    coef_l1: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    backend: str | None = None,
    teacher_w: torch.Tensor | None = None,
    teacher_cols: torch.Tensor | None = None,
    materialise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused DSpark LM loss (see module doc).

    x [N, H] draft rows at the LM head input (after the final norm), y [N, H] teacher final rows,
    w [V, H] frozen LM head, latent [N, r] Markov latent or None, w2 [V, r] markov_w2 weight or None,
    labels [N], coef_ce / coef_l1 [N] (zero rows contribute nothing); y None: no teacher (CE only); teacher_w [Vt, H]
    + teacher_cols [V]: the teacher over its own vocabulary (a reduced draft's held-out metrics, module docstring).
    Returns (loss scalar fp32, differentiable w.r.t. x, latent, w2; ce [N]; l1 [N]; draft argmax [N];
    teacher argmax [N]); the per-row outputs carry no gradient. materialise=True: the same from full [N, V] logits
    and autograd (`lm_loss_naive`), the reference the chunked and tilelang paths are tested against.
    """
    if materialise:
        return lm_loss_naive(x, y, w, latent, w2, labels, coef_ce, coef_l1, teacher_w=teacher_w,
                             teacher_cols=teacher_cols)
    teacher = {} if teacher_w is None else {"teacher_w": teacher_w, "teacher_cols": teacher_cols}
    # the tilelang kernels take the plain form (a teacher over the draft's own rows); the others run the reference
    impl = _impl(_backend.resolve(x, backend)) if (y is not None and not teacher) else lm_loss_reference
    needs = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, latent, w2))
    if needs:
        return _LMLoss.apply(x, y, w, latent, w2, labels, coef_ce, coef_l1, impl, chunk_rows, teacher)
    parts = impl(x, y, w, latent, w2, labels, coef_ce, coef_l1, chunk_rows=chunk_rows, need_grads=False, **teacher)
    loss = _weighted_sum(parts, coef_ce, coef_l1, y is not None)
    return loss, parts.ce, parts.l1, parts.draft_argmax, parts.teacher_argmax


def lm_loss_naive(x, y, w, latent, w2, labels, coef_ce, coef_l1, *, teacher_w=None, teacher_cols=None):
    """The materialised computation: full [N, V] logits and autograd, the same contract and returns as `lm_loss`
    (its `materialise=True`; the reference every other implementation is tested against, and the benchmark's).
    The GEMMs run in w's dtype, the rest in float32 (float64 for float64 inputs), autocast off, as in the chunked
    reference."""
    check_inputs(x, y, w, latent, w2, labels, coef_ce, coef_l1, teacher_w, teacher_cols)
    acc = _acc(w)
    with torch.autocast(x.device.type, enabled=False):
        d = F.linear(x.to(w.dtype), w).to(acc)  # [N, V]
        if latent is not None:
            d = d + F.linear(latent.to(w2.dtype), w2).to(acc)
        ce = F.cross_entropy(d, labels.long(), reduction="none")
        loss = (coef_ce.to(acc) * ce).sum()
        if y is None:  # no teacher: CE only
            l1 = torch.full_like(ce, float("nan"))
            t_arg = torch.full_like(labels, -1, dtype=torch.long)
        else:
            with torch.no_grad():
                head = w if teacher_w is None else teacher_w
                t = F.linear(y.to(head.dtype), head).to(acc)  # [N, V] or [N, Vt]
                t_arg = t.argmax(-1)
                p = t.softmax(-1)
                outside = 0.0
                if teacher_cols is not None:  # the teacher's mass outside the draft's ids counts in full
                    p = p.index_select(1, teacher_cols)
                    outside = (1.0 - p.sum(-1)).clamp_min(0.0)
            l1 = (d.softmax(-1) - p).abs().sum(-1) + outside
            loss = loss + (coef_l1.to(acc) * l1).sum()
    d_arg = d.detach().argmax(-1)
    if teacher_cols is not None:
        d_arg = teacher_cols[d_arg]  # draft ids -> teacher ids
    return loss, ce.detach(), l1.detach(), d_arg, t_arg
