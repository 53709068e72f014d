"""Anchors, block inputs, labels and eval masks for training (docs/CONTRACTS.md §3).

Everything here is a pure function of tensors so tests can pin it down with tiny hand-made inputs. The block
layouts and the packed block attention mask are the draft's inference path (dspark.models.block_draft): training
builds the same blocks. In both layouts prediction j (0-based) has label x_{a+j+1}, teacher row a+j and Markov
prev x_{a+j}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.block_draft import block_layout


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] and loss_mask[a+1]. loss_mask: [S] -> [n] long (ascending)."""
    lm = loss_mask.bool()
    ok = lm[:-1] & lm[1:]  # [S-1]
    return ok.nonzero().flatten()


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct anchors for one sequence, sorted ascending.

    loss_mask: [S]. Returns (anchors [num_anchors] long, keep [num_anchors] bool); slots beyond the
    number of candidates hold anchor 0 with keep=False.
    """
    if num_anchors <= 0:
        raise ValueError(f"num_anchors must be > 0, got {num_anchors}")
    cand = anchor_candidates(loss_mask)
    n = min(num_anchors, cand.numel())
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    if n > 0:
        pick = torch.randperm(cand.numel(), generator=generator)[:n]
        anchors[:n] = cand[pick].sort().values
        keep[:n] = True
    return anchors, keep


@dataclass
class Blocks:
    """Packed blocks for a batch. B = batch, A = anchors per sequence, L = block length, g = drafts."""

    input_ids: torch.Tensor  # [B, A, L] long
    positions: torch.Tensor  # [B, A, L] long
    labels: torch.Tensor  # [B, A, g] long (0 where out of range)
    eval_mask: torch.Tensor  # [B, A, g] bool, contiguous prefix per block
    prev_ids: torch.Tensor  # [B, A, g] long, Markov teacher forcing x_{a+j}
    teacher_positions: torch.Tensor  # [B, A, g] long, rows of the target whose next-token dist is p_j
    pred_offset: int  # output rows [pred_offset : pred_offset + g] of each block are the predictions

    @property
    def num_drafts(self) -> int:
        return self.labels.shape[-1]


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    num_drafts: int,
    mask_token_id: int,
    layout: str = "anchor",
) -> Blocks:
    """input_ids, loss_mask: [B, S]; anchors, keep: [B, A]. Returns the packed Blocks."""
    B, S = input_ids.shape
    g = num_drafts
    L, pred_offset = block_layout(layout, g)
    offs = torch.arange(L, device=input_ids.device)
    positions = anchors.unsqueeze(-1) + offs  # [B, A, L]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[..., 0] = torch.gather(input_ids, 1, anchors)  # x_a

    j = torch.arange(g, device=input_ids.device)
    label_pos = anchors.unsqueeze(-1) + j + 1  # [B, A, g]
    in_range = label_pos < S
    label_pos_c = label_pos.clamp(max=S - 1)
    flat = lambda t: t.reshape(B, -1)  # noqa: E731  [B, A, g] -> [B, A*g]
    labels = torch.gather(input_ids, 1, flat(label_pos_c)).view_as(label_pos)
    label_ok = in_range & torch.gather(loss_mask.bool(), 1, flat(label_pos_c)).view_as(label_pos)
    label_ok &= keep.unsqueeze(-1)
    eval_mask = label_ok.long().cumprod(-1).bool()
    labels = torch.where(in_range, labels, torch.zeros_like(labels))

    prev_pos = (label_pos - 1).clamp(max=S - 1)  # a + j
    prev_ids = torch.gather(input_ids, 1, flat(prev_pos)).view_as(prev_pos)
    return Blocks(
        input_ids=block_ids,
        positions=positions,
        labels=labels,
        eval_mask=eval_mask,
        prev_ids=prev_ids,
        teacher_positions=prev_pos,
        pred_offset=pred_offset,
    )
