"""Reduced draft vocabulary (vLLM / EAGLE-3 `d2t` / `t2d` convention) from token frequencies.

    kept  = the Vd most frequent target ids (ties: lower id first), sorted ascending     [Vd] long
    d2t   = kept - arange(Vd)   (draft id d -> target id d + d2t[d]; what vLLM's loader reads)  [Vd] long
    t2d   = bool mask over the target vocabulary, True at kept ids (training-only in vLLM)     [V] bool
Counts come from the tokens a draft has to predict: tokenized rows (`input_ids` + `loss_mask`: only
loss_mask == 1 tokens count; without a loss_mask every token counts), or conversation records
(`messages`) rendered with the target tokenizer's chat template (assistant tokens).
Used by training (a draft trained with `draft.draft_vocab_size`: dspark.training.draft_vocab) and by export
(a full-vocab draft pruned at export: dspark.export.vocab).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from dspark.data.chat import render_with_loss_mask


def count_tokens(rows: Iterable[dict], vocab_size: int, tokenizer=None, max_length: int | None = None) -> torch.Tensor:
    """[V] long: how often each id occurs as a trained token in `rows` (see module docstring)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, row in enumerate(rows):
        if "input_ids" in row:
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            mask = row.get("loss_mask")
            if mask is not None:
                mask = torch.as_tensor(mask).bool()
                if mask.shape != ids.shape:
                    raise ValueError(f"row {i}: loss_mask length {mask.numel()} != input_ids length {ids.numel()}")
                ids = ids[mask]
        elif "messages" in row:
            if tokenizer is None:
                raise ValueError(f"row {i} is a conversation (messages): a tokenizer is needed to count tokens")
            all_ids, mask = render_with_loss_mask(row["messages"], tokenizer, max_length)
            ids = torch.tensor([t for t, m in zip(all_ids, mask) if m], dtype=torch.long)
        else:
            raise ValueError(f"row {i}: expected 'input_ids' (+ 'loss_mask') or 'messages', got keys {sorted(row)}")
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"row {i}: token id {int(ids.max())} outside the vocabulary [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def count_tokens_jsonl(path, vocab_size: int, tokenizer=None, max_length: int | None = None) -> torch.Tensor:
    def rows():
        with Path(path).open(encoding="utf-8-sig") as fh:  # a leading BOM is not part of row 1
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{n}: not JSON ({err})") from err
    return count_tokens(rows(), vocab_size, tokenizer, max_length)


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int,
                        always: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] long, t2d [V] bool) keeping the `draft_vocab_size` most frequent ids; ids in `always`
    (e.g. the end-of-turn token) are kept first whatever their count."""
    v = counts.numel()
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}")
    forced = sorted({int(t) for t in always})
    if any(not 0 <= t < v for t in forced) or len(forced) > draft_vocab_size:
        raise ValueError(f"always-kept ids {forced} must be < {v} and at most draft_vocab_size={draft_vocab_size}")
    # rank by (-count, id): a stable sort of -count over ids in ascending order breaks ties by lower id
    order = torch.sort(-counts.long(), stable=True).indices
    keep = torch.zeros(v, dtype=torch.bool)
    keep[forced] = True
    for t in order.tolist():
        if int(keep.sum()) >= draft_vocab_size:
            break
        keep[t] = True
    kept = keep.nonzero().flatten()  # ascending
    return kept - torch.arange(draft_vocab_size), keep
