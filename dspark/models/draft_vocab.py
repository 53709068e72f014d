"""A draft that scores a reduced vocabulary (vLLM / EAGLE-3 convention, dspark.data.vocab): Vd of the target's V ids.

    draft id d <-> target id d + d2t[d]    buffer `d2t` [Vd] long (what vLLM's loaders read)
    t2d                                    buffer [V] bool, True at the kept target ids (training only in vLLM)
Drafts mix this in (dense DSpark / DFlash, EAGLE-3) and call `init_draft_vocab(V, Vd)` in __init__; a full-vocab
draft (Vd = V or None) registers no buffer. The ids are installed before training (dspark.training.draft_vocab) or at
export (dspark.export.vocab), so checkpoints, draft/ and exports carry them.
"""
from __future__ import annotations

import torch


class DraftVocab:
    """Mixin for an nn.Module draft; `self.norm` (any parameterised module) gives the device of a full-vocab draft."""

    reduced_vocab: bool = False

    def init_draft_vocab(self, vocab_size: int, draft_vocab_size: int | None) -> None:
        vd = int(draft_vocab_size or vocab_size)
        self.reduced_vocab = vd < int(vocab_size)
        self._full_vocab = int(vocab_size)
        if self.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # draft id d -> target d + d2t[d]
            self.register_buffer("t2d", torch.zeros(int(vocab_size), dtype=torch.bool))
            self.t2d[:vd] = True  # placeholder identity mapping until set_vocab_mapping

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] long: the target id of every draft id (arange(V) for a full-vocab draft)."""
        if not self.reduced_vocab:
            return torch.arange(self._full_vocab, device=self.norm.weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: the draft id of every target id, -1 where the draft has none (a reduced-vocab draft only)."""
        return (self.t2d.long().cumsum(0) - 1).masked_fill_(~self.t2d, -1)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a mapping (dspark.data.vocab.build_vocab_mapping); checks that d2t and t2d agree."""
        if not self.reduced_vocab:
            raise ValueError("set_vocab_mapping: the draft has the full vocabulary (config.draft_vocab_size unset)")
        vd, v = self.d2t.numel(), self._full_vocab
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise ValueError(f"set_vocab_mapping: expected d2t [{vd}] and t2d [{v}], got {tuple(d2t.shape)} / "
                             f"{tuple(t2d.shape)}")
        ids = torch.arange(vd) + d2t.long().cpu()
        if ids.min() < 0 or ids.max() >= v or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("set_vocab_mapping: d2t must map draft ids to strictly increasing target ids in [0, V)")
        mask = torch.zeros(v, dtype=torch.bool)
        mask[ids] = True
        if not torch.equal(mask, t2d.bool().cpu()):
            raise ValueError("set_vocab_mapping: t2d does not mark exactly the target ids d + d2t[d]")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def scatter_to_target(self, small: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft-vocabulary logits -> [..., V] at their target ids, -inf elsewhere (vLLM
        llama_eagle3.py:385-395 compute_logits; the same tensor for a full-vocab draft)."""
        if not self.reduced_vocab:
            return small
        out = small.new_full((*small.shape[:-1], self._full_vocab), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.draft_to_target(), small)


__all__ = ["DraftVocab"]
