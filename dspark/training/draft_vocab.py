"""A reduced draft vocabulary chosen at the start of training (`draft.draft_vocab_size`, dense block drafts).

The draft scores Vd of the target's V tokens: the Vd most frequent loss tokens of the TRAINING rows (never the
held-out ones), plus the tokenizer's end-of-sequence id whatever its count (dspark.data.vocab.build_vocab_mapping).
The mapping is the draft's d2t / t2d buffers (vLLM's convention), so checkpoints, draft/ and exports carry it; a
resumed run recomputes the same mapping from the same rows and then loads the checkpoint's.
"""
from __future__ import annotations

import logging

import torch

from dspark.data.vocab import build_vocab_mapping, count_tokens
from dspark.models.contract import optional

log = logging.getLogger(__name__)


def install_draft_vocab(draft: torch.nn.Module, train_rows, tokenizer=None) -> float | None:
    """Sets a reduced-vocab draft's d2t / t2d from `train_rows` (rows with input_ids + loss_mask); returns the
    share of the rows' loss tokens the kept ids cover (None, and nothing done, for a full-vocabulary draft)."""
    if not optional(draft, "reduced_vocab"):
        return None
    v, vd = int(draft.config.vocab_size), int(draft.d2t.numel())
    counts = count_tokens(train_rows, v)  # [V]
    eos = getattr(tokenizer, "eos_token_id", None)
    always = [int(eos)] if isinstance(eos, int) and 0 <= eos < v else []
    d2t, t2d = build_vocab_mapping(counts, vd, always)
    draft.set_vocab_mapping(d2t.to(draft.d2t.device), t2d.to(draft.t2d.device))
    covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
    log.info("draft vocabulary: %d of %d target ids, covering %.4f of the %d training loss tokens",
             vd, v, covered, int(counts.sum()))
    return covered
