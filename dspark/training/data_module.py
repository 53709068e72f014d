"""DataModule: tokenized chat examples -> padded batches with sampled anchors, resumable mid-run.

Training is step based: the train loader is ONE long Lightning epoch of `total_batches` batches that
walks over the data for as many passes as needed (a fresh permutation per pass). The batch order and
every example's anchors are pure functions of (seed, pass, index), so a resumed run sees exactly the
batches it would have seen without the interruption: the DataModule's checkpoint state is the number
of batches already consumed.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dspark.training.blocks import sample_anchors


def _seed_for(*parts: int) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class AnchoredExamples(Dataset):
    """Rows {input_ids, loss_mask} -> tensors plus anchors sampled deterministically per (pass, index).

    With a FeatureCache, each item also carries the cached target features of its row: row `idx` of
    `rows` is example `feature_index[idx]` of the cache (rows are usually a `select`ed slice of the
    dataset the cache was built from).
    """

    def __init__(self, rows, num_anchors: int, seed: int, features=None, feature_index=None):
        self.rows = rows
        self.num_anchors = num_anchors
        self.seed = seed
        self.features = features  # FeatureCache | None
        self.feature_index = feature_index if feature_index is not None else range(len(rows))
        if features is not None and len(self.feature_index) != len(rows):
            raise ValueError(f"feature_index has {len(self.feature_index)} entries for {len(rows)} rows")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        data_pass, idx = key
        row = self.rows[int(idx)]
        ids = torch.tensor(row["input_ids"], dtype=torch.long)  # [S]
        lm = torch.tensor(row["loss_mask"], dtype=torch.long)  # [S]
        gen = torch.Generator().manual_seed(_seed_for(self.seed, data_pass, int(idx)))
        anchors, keep = sample_anchors(lm, self.num_anchors, gen)
        item = {"input_ids": ids, "loss_mask": lm, "anchors": anchors, "keep": keep}
        if self.features is not None:
            item["aux"], item["final"] = self._cached_features(int(idx), ids.numel())
        return item

    def _cached_features(self, idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> aux [S, n*H], final [S, H] in the cache's dtype (the training step casts them)."""
        j = self.feature_index[idx]
        aux, final = self.features.get(j, dtype=None)
        if aux.shape[0] != length or final.shape[0] != length:
            raise ValueError(f"feature cache {self.features.path}: example {j} has {aux.shape[0]} positions but "
                             f"its row has {length} tokens (a cache built for another dataset?)")
        return aux, final


def _pad_features(items: list[dict[str, torch.Tensor]], key: str, S: int) -> torch.Tensor:
    """Per-example [S_i, D] -> zero-padded [B, S, D]."""
    first = items[0][key]
    out = torch.zeros(len(items), S, first.shape[-1], dtype=first.dtype)
    for i, x in enumerate(items):
        out[i, : x[key].shape[0]] = x[key]
    return out


def collate(items: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads to the longest sequence. -> input_ids/attention_mask/loss_mask [B,S], anchors/keep [B,A];
    with cached features also aux [B,S,n*H] and final [B,S,H] (zero-padded)."""
    S = max(x["input_ids"].numel() for x in items)
    B = len(items)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    am = torch.zeros(B, S, dtype=torch.long)
    lm = torch.zeros(B, S, dtype=torch.long)
    for i, x in enumerate(items):
        n = x["input_ids"].numel()
        ids[i, :n] = x["input_ids"]
        am[i, :n] = 1
        lm[i, :n] = x["loss_mask"]
    batch = {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "anchors": torch.stack([x["anchors"] for x in items]),
        "keep": torch.stack([x["keep"] for x in items]),
    }
    if "aux" in items[0]:
        batch["aux"] = _pad_features(items, "aux", S)  # [B, S, n*H]
        batch["final"] = _pad_features(items, "final", S)  # [B, S, H]
    return batch


class ResumableBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields this rank's share of each global batch as [(pass, index), ...].

    Global batch b of the run covers data pass b // batches_per_pass; passes are fresh permutations
    (seed, pass). `start` skips batches already consumed (resume). len() is the full run length so that
    Lightning's progress counters stay consistent after a restart.

    `first_pass_groups` (a partition of the indices into ranges, e.g. the shards of a feature stream in the order
    they are written): pass 0 then walks the groups one after the other, each in its own permutation (seed, 0, g);
    later passes are the usual full permutations.

    `lengths` ([num_examples] tokens per example; data.group_by_length): batches of similar lengths, so that padding
    to the longest row of a batch costs little. Each window of GROUP_WINDOW consecutive global batches of a pass's
    permutation is sorted by length and cut into global batches, whose order within the window is then shuffled
    (seed, pass, window): every example is still seen once per pass, in an order fixed by the seed (exact resume).
    A streamed first pass (first_pass_groups) keeps its shard order unsorted.
    """

    GROUP_WINDOW = 32  # global batches per length-sorted window

    def __init__(self, num_examples: int, batch_size: int, total_batches: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 first_pass_groups: list[range] | None = None, lengths: torch.Tensor | None = None):
        self.global_batch = batch_size * world_size
        self.batches_per_pass = num_examples // self.global_batch
        if self.batches_per_pass == 0:
            raise ValueError(
                f"data: {num_examples} training examples cannot fill one global batch of "
                f"{batch_size} x {world_size} ranks; lower train.batch_size or add data"
            )
        self.num_examples, self.batch_size = num_examples, batch_size
        self.total_batches, self.seed, self.shuffle = total_batches, seed, shuffle
        self.rank, self.start = rank, 0
        self.groups = None if first_pass_groups is None else [range(g.start, g.stop) for g in first_pass_groups]
        if self.groups is not None and sorted(i for g in self.groups for i in g) != list(range(num_examples)):
            raise ValueError(f"first_pass_groups must partition the {num_examples} examples")
        if lengths is not None and tuple(lengths.shape) != (num_examples,):
            raise ValueError(f"lengths must be [{num_examples}], got {tuple(lengths.shape)}")
        self.lengths = lengths

    def __len__(self) -> int:
        return self.total_batches

    def _order(self, data_pass: int) -> torch.Tensor:
        """-> [num_examples] the example indices of one pass, in order."""
        if not self.shuffle:
            return torch.arange(self.num_examples)
        if data_pass == 0 and self.groups is not None:
            return self._grouped_order()
        gen = torch.Generator().manual_seed(_seed_for(self.seed, data_pass))
        order = torch.randperm(self.num_examples, generator=gen)
        return order if self.lengths is None else self._by_length(order, data_pass)

    def _by_length(self, order: torch.Tensor, data_pass: int) -> torch.Tensor:
        """[num_examples] -> the same indices, each window of GROUP_WINDOW global batches sorted by length and its
        batches shuffled (class docstring); the tail that fills no global batch stays where it is."""
        gb, out = self.global_batch, order.clone()
        full = self.batches_per_pass * gb
        for w, lo in enumerate(range(0, full, self.GROUP_WINDOW * gb)):
            hi = min(full, lo + self.GROUP_WINDOW * gb)
            idx = order[lo:hi]
            idx = idx[torch.sort(self.lengths[idx], stable=True).indices].view(-1, gb)  # [batches, gb]
            gen = torch.Generator().manual_seed(_seed_for(self.seed, data_pass, 1_000_000 + w))
            out[lo:hi] = idx[torch.randperm(idx.shape[0], generator=gen)].flatten()
        return out

    def _grouped_order(self) -> torch.Tensor:
        """-> [num_examples] pass 0 as the groups in turn, each permuted by (seed, 0, group number)."""
        parts = []
        for g, idx in enumerate(self.groups):
            gen = torch.Generator().manual_seed(_seed_for(self.seed, 0, g))
            parts.append(torch.arange(idx.start, idx.stop)[torch.randperm(len(idx), generator=gen)])
        return torch.cat(parts)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        start, self.start = self.start, 0
        order, order_pass = None, -1
        for b in range(start, self.total_batches):
            data_pass, within = divmod(b, self.batches_per_pass)
            if data_pass != order_pass:
                order, order_pass = self._order(data_pass), data_pass
            g0 = within * self.global_batch + self.rank * self.batch_size
            yield [(data_pass, int(i)) for i in order[g0 : g0 + self.batch_size]]


class ChatDataModule(L.LightningDataModule):
    """Train / held-out split of a tokenized dataset with columns input_ids, loss_mask.

    `features` (optional FeatureCache built from the whole `dataset`, or a FeatureStream being written): batches
    then carry the cached target features (aux, final) and the training step skips the target forward.
    `first_pass_groups`: the training rows' order of the first pass (ResumableBatchSampler), e.g. a feature stream's
    shards in the order they are written.
    """

    def __init__(self, dataset, *, pad_id: int, batch_size: int, num_anchors: int, total_batches: int,
                 val_examples: int, val_batch_size: int | None = None, seed: int = 0, num_workers: int = 0,
                 features=None, first_pass_groups: list[range] | None = None, group_by_length: bool = False):
        super().__init__()
        n = len(dataset)
        if not isinstance(val_examples, int) or val_examples <= 0 or val_examples >= n:
            raise ValueError(f"data.val_examples={val_examples} must be in [1, {n - 1}] for {n} examples")
        if features is not None and len(features) != n:
            raise ValueError(f"data.feature_cache: {features.path} holds {len(features)} examples, "
                             f"the dataset has {n} (a cache built for another dataset)")
        # the cache is indexed by position in `dataset`; keep each split's original indices
        self.train_index, self.val_index = range(0, n - val_examples), range(n - val_examples, n)
        self.train_rows = dataset.select(self.train_index)
        self.val_rows = dataset.select(self.val_index)
        self.features = features
        self.pad_id, self.batch_size, self.num_anchors = pad_id, batch_size, num_anchors
        self.total_batches, self.seed, self.num_workers = total_batches, seed, num_workers
        self.val_batch_size = val_batch_size or batch_size
        self.first_pass_groups = first_pass_groups
        self.group_by_length = group_by_length  # batches of similar lengths (ResumableBatchSampler `lengths`)
        self._resume_batches = 0

    def _ranks(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _loader(self, rows, index: range, batch_sampler) -> DataLoader:
        return DataLoader(
            AnchoredExamples(rows, self.num_anchors, self.seed, self.features, index),
            batch_sampler=batch_sampler,
            collate_fn=functools.partial(collate, pad_id=self.pad_id),
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        rank, world = self._ranks()
        lengths = torch.tensor([len(ids) for ids in self.train_rows["input_ids"]]) if self.group_by_length else None
        sampler = ResumableBatchSampler(len(self.train_rows), self.batch_size, self.total_batches,
                                        self.seed, rank, world, first_pass_groups=self.first_pass_groups,
                                        lengths=lengths)
        sampler.start = self._resume_batches
        return self._loader(self.train_rows, self.train_index, sampler)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._ranks()
        idx = list(range(rank, len(self.val_rows), world))  # fixed anchors: pass 0
        batches = [[(0, i) for i in idx[k : k + self.val_batch_size]]
                   for k in range(0, len(idx), self.val_batch_size)]
        return self._loader(self.val_rows, self.val_index, batches)

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        t = self.trainer
        consumed = t.global_step * t.accumulate_grad_batches if t is not None else 0
        return {"batches_consumed": int(consumed)}

    def load_state_dict(self, state: dict) -> None:
        self._resume_batches = int(state.get("batches_consumed", 0))
