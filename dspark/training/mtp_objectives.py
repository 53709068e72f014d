"""MTP training: recursive K-step teacher forcing, CE + distillation losses, tau-like metrics (docs/CONTRACTS.md §6).

Sequence ids [B, S]. Every position t starts a chain, run the way vLLM serves it (dspark.models.mtp_common:
step-0 rows built once from the target's hidden, depth-k rows attending to the step-0 rows 0..t plus the
chain's own earlier rows, never to other chains' depth-k rows). Step k (0-based) runs over rows
t = 0 .. L_k - 1 with L_k = S - k - 1:
    input token  ids[t + k + 1]                       (always the TRUE token: teacher forcing)
    input hidden context_hidden[t] (k = 0) / output of step k-1 at row t (k >= 1)
    position     t + k
    label        ids[t + k + 2]     (rows t <= S - k - 3; the last row only feeds step k+1)
    teacher      softmax(lm_head(final[t + k + 1]))  = the target's own prediction of token t + k + 2
A row counts in step k's loss iff its label exists and loss_mask[t + k + 2] is set.

    L_k = w_ce * mean CE(logits, label) + w_kd * mean KL(teacher || draft)      (means over step k's rows)
    L   = sum_k beta^k L_k / sum_j beta^j

Metrics use the DSpark definitions with every row t as an anchor and steps as draft positions, so the
numbers compare with the DSpark module's: eval_mask[t, k] = prod_{j<=k} valid[t, j];
c*_k = clamp(1 - 0.5 ||q_k - p_k||_1, 0, 1); tau_prob = 1 + sum_k prod_{j<=k} c*_j (mean over rows valid
at step 0); agree_k = top-1 agreement with the teacher at step k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.mtp_common import teacher_forced_chain
from dspark.training.objectives import acceptance_targets, tau_prob


@dataclass(frozen=True)
class MTPLossWeights:
    ce: float = 0.1  # CE vs the true token
    kl: float = 0.9  # KL(target || draft) per row


def step_weights(num_steps: int, beta: float) -> torch.Tensor:
    """[K] fp32: beta^k / sum_j beta^j."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    w = torch.tensor([float(beta) ** k for k in range(num_steps)], dtype=torch.float32)
    return w / w.sum()


@dataclass
class StepRows:
    """The teacher-forced inputs and targets of step k for a batch (see the module docstring)."""

    input_ids: torch.Tensor  # [B, L_k]       ids[:, k+1:]
    positions: torch.Tensor  # [B, L_k]       t + k
    labels: torch.Tensor  # [B, L_k - 1]      ids[:, k+2:]
    valid: torch.Tensor  # [B, L_k - 1] bool  loss_mask at the label
    teacher_positions: torch.Tensor  # [L_k - 1]  t + k + 1


def step_rows(ids: torch.Tensor, loss_mask: torch.Tensor, k: int) -> StepRows:
    """ids, loss_mask [B, S] -> StepRows of step k (needs S >= k + 2)."""
    b, s = ids.shape
    length = s - k - 1
    if length < 1:
        raise ValueError(f"step {k} needs sequences of at least {k + 2} tokens, got {s}")
    t = torch.arange(length, device=ids.device)
    return StepRows(
        input_ids=ids[:, k + 1 :],
        positions=(t + k).expand(b, length),
        labels=ids[:, k + 2 :],
        valid=loss_mask[:, k + 2 :].bool(),
        teacher_positions=t[: length - 1] + k + 1,
    )


@dataclass
class StepOutputs:
    """Step k's scored rows, gathered where valid: N_k rows."""

    logits: torch.Tensor  # [N_k, V] draft logits
    labels: torch.Tensor  # [N_k]
    teacher_final: torch.Tensor  # [N_k, H] target final hidden at t + k + 1 (teacher = lm_head of it)
    rows: torch.Tensor  # [N_k, 2] (batch index, t) of each scored row
    hidden: torch.Tensor  # [N_k, ...] the step's output hidden at those rows (tests, diagnostics)


def recursive_forward(draft, context_hidden: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                      final: torch.Tensor, num_steps: int, logits_fn=None) -> list[StepOutputs]:
    """Teacher-forced K-step chain of an MTP draft over whole sequences, as served (module docstring).

    context_hidden [B, S, ...] (draft.context_hidden(feats)), ids / loss_mask [B, S], final [B, S, H]
    -> one StepOutputs per step. Steps that need longer sequences than S (no row with a label) are skipped.
    logits_fn(rows [1, N, ...], k) -> [1, N, V']: the scored logits (default draft.logits; a reduced-vocabulary
    draft's own Vd columns, draft.draft_logits).
    """
    logits_fn = logits_fn or draft.logits
    steps = min(int(num_steps), max(ids.shape[1] - 2, 0))  # step k has a labelled row iff S >= k + 3
    outs: list[StepOutputs] = []
    for k, hidden in enumerate(teacher_forced_chain(draft, context_hidden, ids, steps)):
        r = step_rows(ids, loss_mask, k)
        scored = hidden[:, :-1]  # [B, L_k - 1, ...]: rows with a label
        where = r.valid.nonzero()  # [N_k, 2] (b, t)
        sel = scored[where[:, 0], where[:, 1]]  # [N_k, ...]
        logits = logits_fn(sel.unsqueeze(0), k)
        outs.append(StepOutputs(
            logits=logits[0], labels=r.labels[where[:, 0], where[:, 1]],
            teacher_final=final[where[:, 0], r.teacher_positions[where[:, 1]]], rows=where, hidden=sel,
        ))
    return outs


def kl_to_teacher(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[N, V] x2 -> KL(softmax(teacher) || softmax(draft)) per row [N] (fp32)."""
    logp = teacher_logits.float().log_softmax(-1)
    logq = draft_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def mtp_losses(steps: list[StepOutputs], teacher_logits: list[torch.Tensor], *, num_steps: int, beta: float,
               weights: MTPLossWeights, batch_rows: tuple[int, int], metrics: bool = True,
               row_normalizers: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Loss and metrics from recursive_forward's outputs and the teacher logits of each step's rows.

    teacher_logits[k] [N_k, V]; batch_rows = (B, L_0 - 1) for the dense metric grid.
    Returns loss, ce, kl (weighted over steps), ce_k / kl_k per step and, with `metrics` (vocabulary-sized
    work on every row; training skips it on steps that are not logged), tau_prob, l1, agree_count [K],
    agree_total [K], rows (scored rows of step 0).
    row_normalizers [K]: divide step k's summed CE / KL by this instead of its own row count N_k (DDP: the
    global N_k / world size, so that averaging the ranks' gradients gives the single-process objective).
    """
    w = step_weights(num_steps, beta)
    dev = steps[0].logits.device if steps else torch.device("cpu")
    zero = torch.zeros((), device=dev)
    loss, ce_all, kl_all = zero, zero, zero
    b, rows = batch_rows
    c_grid = torch.zeros(b, max(rows, 0), num_steps, device=dev)  # c*_k per (row, step)
    hit_grid = torch.zeros(b, max(rows, 0), num_steps, dtype=torch.bool, device=dev)
    valid_grid = torch.zeros(b, max(rows, 0), num_steps, dtype=torch.bool, device=dev)
    out: dict[str, torch.Tensor] = {}
    for k, (st, teacher) in enumerate(zip(steps, teacher_logits)):
        if st.labels.numel() == 0:
            continue
        logq = st.logits.float().log_softmax(-1)  # [N_k, V]
        logp = teacher.float().log_softmax(-1)
        denom = st.labels.numel() if row_normalizers is None else row_normalizers[k].clamp_min(1e-8)
        # a label outside a reduced draft vocabulary (-1) has no CE term; its row still counts in the KL
        in_vocab = st.labels >= 0
        ce = -(logq.gather(-1, st.labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * in_vocab).sum() / denom
        kl = (logp.exp() * (logp - logq)).sum(-1).sum() / denom  # KL(teacher || draft), as kl_to_teacher
        out[f"ce_{k}"], out[f"kl_{k}"] = ce.detach(), kl.detach()
        ce_all = ce_all + w[k] * ce
        kl_all = kl_all + w[k] * kl
        if metrics:
            with torch.no_grad():
                bi, ti = st.rows[:, 0], st.rows[:, 1]
                l1 = (logq.exp() - logp.exp()).abs().sum(-1)  # [N_k], the block objective's L1
                c_grid[bi, ti, k] = acceptance_targets(l1)
                hit_grid[bi, ti, k] = st.logits.argmax(-1) == teacher.argmax(-1)
                valid_grid[bi, ti, k] = True
    if weights.ce:
        loss = loss + weights.ce * ce_all
    if weights.kl:
        loss = loss + weights.kl * kl_all
    out.update(loss=loss, ce=ce_all, kl=kl_all)
    if not metrics:
        return out
    with torch.no_grad():
        eval_mask = valid_grid.flatten(0, 1).long().cumprod(-1).bool()  # [B*rows, K]
        c = c_grid.flatten(0, 1)
        m = eval_mask.float()
        out["tau_prob"] = tau_prob(c, eval_mask)
        out["l1"] = ((2.0 - 2.0 * c) * m).sum() / m.sum().clamp_min(1)  # c* = 1 - L1/2 (unclamped rows: L1 <= 2)
        out["agree_count"] = (hit_grid.flatten(0, 1).float() * m).sum(0)  # [K]
        out["agree_total"] = m.sum(0)  # [K]
        out["rows"] = m[:, 0].sum()
    return out
