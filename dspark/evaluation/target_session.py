"""A batch of requests decoding together against one KV-cached target (the verify side of eval.py).

Cache layout: one HF `DynamicCache` whose layers keep all of their keys (no sliding-window eviction: a
rejected draft must be removable, and the window is applied by the attention mask from the true
positions); DSA layers (`indexed_attention`, HY V4) also keep their indexer keys, re-packed the same way. Rows are requests; each row's cached tokens are right-aligned
and left-padded:

    slot   0 .. pad_i-1      padding (attention_mask 0)
    slot   pad_i .. L-1      the row's tokens at positions 0 .. len_i-1          L = max_i len_i + pad_i

`forward(new_ids [B, T])` appends T slots to every row (positions len_i .. len_i+T-1) and returns their
target features and logits; `commit(keep)` then keeps the first keep_i of those T slots in row i (the
anchor and the accepted drafts) and re-packs the cache so that rows stay right-aligned. Finished requests
are dropped with `retain(rows)`. Per-row target features of the kept positions accumulate in
`features(i)` for the draft's next proposal.

Targets with compressed attention layers (DeepSeek-V4 CSA/HCA) keep compressor state that cannot be
rolled back this way; they are refused with a clear error.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.targets.hf_target import FrozenTarget, TargetFeatures

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "indexed_attention"})


def _new_cache(target: FrozenTarget):
    """DynamicCache with one non-evicting layer per decoder layer (an indexed layer where the model has DSA)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

    types = list(getattr(target.model.config, "layer_types", None) or [])
    if "indexed_attention" not in types:
        return DynamicCache()  # lazily filled with DynamicLayer
    cache = DynamicCache(config=target.model.config)
    cache.layers = [DynamicIndexedLayer() if t == "indexed_attention" else DynamicLayer() for t in types]
    return cache


def check_cacheable(target: FrozenTarget) -> None:
    types = set(getattr(target.model.config, "layer_types", None) or [])
    bad = sorted(types - SUPPORTED_LAYER_TYPES)
    if bad:
        raise NotImplementedError(
            f"KV-cached verification supports layer types {sorted(SUPPORTED_LAYER_TYPES)}; the target has {bad} "
            "(compressor state cannot be rolled back after a rejected draft)"
        )


def _gather_slots(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D], src [B, W] slot indices -> [B, heads, W, D]."""
    return x.gather(2, src[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def _cat_features(parts: list[TargetFeatures]) -> TargetFeatures:
    if len(parts) == 1:
        return parts[0]
    return type(parts[0])(**{k: None if v is None else torch.cat([getattr(p, k) for p in parts], dim=1)
                             for k, v in vars(parts[0]).items()})


class TargetSession:
    """prompts: one [P_i] long tensor per request (P_i >= 1)."""

    def __init__(self, target: FrozenTarget, prompts: Sequence[torch.Tensor]):
        check_cacheable(target)
        if not prompts:
            raise ValueError("TargetSession needs at least one prompt")
        self.target = target
        self.device = target.device
        self.cache = _new_cache(target)
        self.attention_mask = torch.zeros(len(prompts), 0, dtype=torch.long, device=self.device)  # [B, L]
        self._feats: list[list[TargetFeatures]] = [[] for _ in prompts]  # kept features per row, in chunks
        self._pending: TargetFeatures | None = None  # features of the last forward, [B, T, ...]
        self._pending_ids: torch.Tensor | None = None  # its input ids [B, T]
        self.requests = list(range(len(prompts)))  # request index of each row
        for i, p in enumerate(prompts):
            if p.dim() != 1 or p.numel() == 0:
                raise ValueError(f"prompt {i}: expected a non-empty [P] tensor, got shape {tuple(p.shape)}")
        self._prompts = [p.to(self.device, torch.long) for p in prompts]
        self._tokens: list[torch.Tensor] = [p[:0] for p in self._prompts]  # cached token ids per row [len_i]

    @property
    def batch_size(self) -> int:
        return len(self._tokens)

    @property
    def lengths(self) -> list[int]:
        """Cached tokens per row."""
        return [t.numel() for t in self._tokens]

    # ---- forward ------------------------------------------------------------------------------------
    def prefill(self) -> torch.Tensor:
        """Forward every prompt; keep all of it. Returns the logits of each prompt's last position [B, V]."""
        if self.cache.get_seq_length() != 0:
            raise RuntimeError("prefill() runs once, on an empty session")
        width = max(p.numel() for p in self._prompts)
        ids = torch.zeros(self.batch_size, width, dtype=torch.long, device=self.device)  # [B, P] left-padded
        self.attention_mask = torch.zeros_like(ids)
        pos = torch.zeros_like(ids)
        for i, p in enumerate(self._prompts):
            ids[i, width - p.numel():] = p
            self.attention_mask[i, width - p.numel():] = 1
            pos[i, width - p.numel():] = torch.arange(p.numel(), device=self.device)
        feats = self.target.features(ids, self.attention_mask, position_ids=pos, cache=self.cache)
        logits = self.target.logits_from_final(feats.final[:, -1]).float()  # [B, V]
        for i, p in enumerate(self._prompts):
            self._feats[i].append(self._row(feats, i, width - p.numel(), width))
        self._tokens = list(self._prompts)
        return logits

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [B, T] (row i at positions len_i .. len_i+T-1) -> logits [B, T, V] fp32. Call commit() next."""
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before the next one")
        b, t = new_ids.shape
        if b != self.batch_size:
            raise ValueError(f"new_ids has {b} rows, the session {self.batch_size}")
        lengths = torch.tensor(self.lengths, device=self.device)
        pos = lengths.unsqueeze(1) + torch.arange(t, device=self.device)  # [B, T]
        mask = torch.cat([self.attention_mask, torch.ones(b, t, dtype=torch.long, device=self.device)], dim=1)
        feats = self.target.features(new_ids.to(self.device), mask, position_ids=pos, cache=self.cache)
        self.attention_mask = mask
        self._pending, self._pending_ids = feats, new_ids.to(self.device)
        return self.target.logits_from_final(feats.final).float()  # [B, T, V]

    def commit(self, keep: Sequence[int]) -> None:
        """Keep the first keep[i] of the last forward's T slots of row i; drop the rest from the cache."""
        if self._pending is None:
            raise RuntimeError("commit() without a forward()")
        t = self._pending.final.shape[1]
        if len(keep) != self.batch_size or any(not 0 <= int(k) <= t for k in keep):
            raise ValueError(f"keep must hold {self.batch_size} counts in 0..{t}, got {list(keep)}")
        old_width = self.attention_mask.shape[1] - t  # cache slots before the forward
        old_lengths = self.lengths
        for i, k in enumerate(keep):
            if k:
                self._feats[i].append(self._row(self._pending, i, 0, int(k)))
                self._tokens[i] = torch.cat([self._tokens[i], self._pending_ids[i, : int(k)]])
        self._repack(old_width, old_lengths)
        self._pending = self._pending_ids = None

    def retain(self, rows: Sequence[int]) -> None:
        """Keep only these rows (e.g. drop finished requests)."""
        if self._pending is not None:
            raise RuntimeError("commit() before retain()")
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            if getattr(layer, "indexer_keys", None) is not None and layer.indexer_keys.numel():
                layer.indexer_keys = layer.indexer_keys[idx]  # [B, L, D]
            if getattr(layer, "indexer_position_ids", None) is not None:
                layer.indexer_position_ids = layer.indexer_position_ids[:, idx]  # [P, B, L]
        self.attention_mask = self.attention_mask[idx]
        self._tokens = [self._tokens[r] for r in rows]
        self._feats = [self._feats[r] for r in rows]
        self.requests = [self.requests[r] for r in rows]
        self._repack(self.attention_mask.shape[1], self.lengths)

    # ---- per-row state ------------------------------------------------------------------------------
    def tokens(self, row: int) -> torch.Tensor:
        """Token ids of row `row`'s committed positions 0..len-1 [len] long."""
        return self._tokens[row]

    def features(self, row: int) -> TargetFeatures:
        """Target features of row `row`'s committed positions 0..len-1, batch 1."""
        parts = self._feats[row]
        merged = _cat_features(parts)
        self._feats[row] = [merged]
        return merged

    @staticmethod
    def _row(feats: TargetFeatures, row: int, start: int, stop: int) -> TargetFeatures:
        return type(feats)(**{k: None if v is None else v[row : row + 1, start:stop] for k, v in vars(feats).items()})

    def _repack(self, old_valid_end: int, old_lengths: list[int]) -> None:
        """Right-align every row's now-committed tokens; they start at cache slot old_valid_end - old_lengths[i]."""
        new_lengths = self.lengths
        width = max(new_lengths, default=0)
        starts = torch.tensor([old_valid_end - n for n in old_lengths], device=self.device)  # [B]
        new_len = torch.tensor(new_lengths, device=self.device)  # [B]
        j = torch.arange(width, device=self.device).unsqueeze(0)  # [1, W]
        pad = (width - new_len).unsqueeze(1)  # [B, 1]
        src = (starts.unsqueeze(1) + j - pad).clamp_min(0)  # [B, W] source slot of destination slot j
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = _gather_slots(layer.keys, src)  # [B, heads, W, D]
                layer.values = _gather_slots(layer.values, src)  # (MLA: other heads / dim than the keys)
            ik = getattr(layer, "indexer_keys", None)
            if ik is not None and ik.numel():
                layer.indexer_keys = ik.gather(1, src[:, :, None].expand(-1, -1, ik.shape[-1]))  # [B, W, D]
            ip = getattr(layer, "indexer_position_ids", None)
            if ip is not None:
                layer.indexer_position_ids = ip.gather(2, src[None].expand(ip.shape[0], -1, -1))  # [P, B, W]
        self.attention_mask = (j >= pad).long()
