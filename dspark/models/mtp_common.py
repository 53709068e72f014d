"""What every MTP draft shares at inference: chain drafting over the draft's context_hidden / step / logits.

Used by DSV4MTPDraft.propose and HYV4MTPDraft.propose (and by any draft with the same three methods).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def takes_layer(draft: nn.Module) -> bool:
    """Whether draft.logits accepts the step's layer index (per-layer head stacks, as DSV4 MTP has)."""
    return "layer_idx" in inspect.signature(draft.logits).parameters


@torch.no_grad()
def chain_propose(draft: nn.Module, feats, tokens: torch.Tensor, *, num_drafts: int, temperature: float = 0.0,
                  generator: torch.Generator | None = None):
    """`num_drafts` drafts after x0 = tokens[a] with any MTP draft (context_hidden / step / logits).

    tokens [a+1] long (prompt + generated, x0 last); feats: TargetFeatures of batch 1 covering positions
    0..a-1. Step 0 runs over rows 0..a-1 with ids tokens[1..a] (row p holds t_{p+1}, row a-1 holds x0) and
    its last row gives y_0; step k runs over step k-1's outputs with the ids shifted once more and y_{k-1}
    appended, positions + k, layer k % num_layers. No KV cache: every step recomputes its whole prefix (the
    same computation as teacher-forced training, with the draft's own tokens at the end).
    """
    from dspark.evaluation.propose import Proposal, sample_from_logits  # noqa: PLC0415 (evaluation imports models)

    a = int(tokens.numel()) - 1
    if a < 1:
        raise ValueError("chain_propose: tokens must hold at least one context token before x0")
    if num_drafts < 1:
        raise ValueError(f"chain_propose: num_drafts must be >= 1, got {num_drafts}")
    hidden = draft.context_hidden(feats)[:, :a]  # [1, a, ...]
    if hidden.shape[0] != 1 or hidden.shape[1] != a:
        raise ValueError(f"chain_propose: features must be batch 1 with >= {a} positions, got {tuple(hidden.shape)}")
    dev = hidden.device
    ids = tokens.to(dev).long()[1 : a + 1].unsqueeze(0)  # [1, a]
    pos = torch.arange(a, device=dev).unsqueeze(0)  # [1, a]
    per_layer = takes_layer(draft)
    ys, q_rows, logit_rows = [], [], []
    for k in range(int(num_drafts)):
        hidden = draft.step(ids, hidden, pos + k, k)  # [1, a, ...]
        last = hidden[:, -1:]  # [1, 1, ...]
        logits = (draft.logits(last, k) if per_layer else draft.logits(last))[0, 0].float()  # [V]
        y, q = sample_from_logits(logits, temperature, generator)
        ys.append(y)
        q_rows.append(q)
        logit_rows.append(logits)
        ids = torch.cat([ids[:, 1:], y.view(1, 1).to(dev)], dim=1)  # shift once more, append the draft
    return Proposal(tokens=torch.stack(ys), q_probs=torch.stack(q_rows), conf=None, logits=torch.stack(logit_rows))
