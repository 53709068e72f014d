"""Sharded data parallel training of the draft: FSDP2 (torch's `fully_shard`) through Lightning's
ModelParallelStrategy, chosen with `trainer=fsdp2` (configs/trainer/fsdp2.yaml, `strategy: fsdp2`).

What is sharded: the draft's parameters, gradients and AdamW state, over every rank (a 1-D data-parallel mesh,
no tensor parallelism). What is not: the frozen target. It is not a submodule of the LightningModule
(DraftLightningModule keeps it in __dict__), so it is never wrapped, never in the optimizer and never in a
checkpoint; each rank holds the one copy its own batch's forward needs, and the draft reads the target's
embedding / LM head through share_target_weights (plain tensors outside the module tree, untouched by FSDP).

One FSDP unit, the whole draft: the objectives call the draft's methods (combine, context_kv, backbone, heads)
rather than its forward, so FSDP's forward hooks cannot sit on the draft or its layers. `StepRunner` is a module
whose forward runs one training / validation computation; fully_shard on it all-gathers the draft's parameters
when a step starts and reduce-scatters the gradients (averaged over ranks, as DDP) at the end of backward.

Lightning's FSDPStrategy refuses accelerator='cpu'; ModelParallelStrategy runs on CPU with gloo, which the
2-process tests use (tests/training/test_sharded_training.py).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from dspark.integrity import MANIFEST_NAME, write_manifest


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy with every rank in the data-parallel dimension (tensor_parallel_size 1): FSDP2 over
    num_nodes x devices ranks. Checkpoints are sharded folders (torch.distributed.checkpoint) unless
    save_distributed_checkpoint=False (then rank 0 writes one full file)."""

    strategy_name = "fsdp2"

    def __init__(self, save_distributed_checkpoint: bool = True, **kwargs: Any):
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A sharded checkpoint appears under its name only when complete: every rank writes its shard into a
        hidden staging folder beside it (`.NAME.partial`); after a barrier, rank 0 writes the folder's completion
        record (dspark_manifest.json: every file, the ranks' shards, .metadata and meta.pt, with its sha256) and
        renames the folder into place (an older folder of that name is moved aside first, then removed). A crash
        at any point leaves either the previous complete folder or none under NAME, never a partial one."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        staging = path.with_name(f".{path.name}.partial")
        if self.global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier("dspark_checkpoint_staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("dspark_checkpoint_written")
        if self.global_rank == 0:
            seal_sharded_checkpoint(staging)
            move_into_place(staging, path)
        self.barrier("dspark_checkpoint_renamed")

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # known before the process group starts
        self._tensor_parallel_size = 1
        super().setup_environment()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 (fully_shard) of the draft over all "
                                   "ranks, sharded checkpoints (dspark.training.sharding)")
        strategy_registry.register(f"{cls.strategy_name}_full_checkpoint", cls, save_distributed_checkpoint=False,
                                   description="FSDP2 of the draft, one full checkpoint file written by rank 0")


if FSDP2Strategy.strategy_name not in StrategyRegistry:
    FSDP2Strategy.register_strategies(StrategyRegistry)


class StepRunner(nn.Module):
    """forward(fn) = fn(): the module FSDP wraps so that a whole step runs between its all-gather and its
    reduce-scatter (module docstring). Holds the draft as its only child."""

    def __init__(self, draft: nn.Module):
        super().__init__()
        self.draft = draft

    def forward(self, fn: Callable[[], Any]) -> Any:
        return fn()


def shard_draft(draft: nn.Module, mesh) -> StepRunner:
    """fully_shard the draft (in place: its parameters become DTensor shards over `mesh`) -> the StepRunner to run
    each step through."""
    from torch.distributed.fsdp import fully_shard

    runner = StepRunner(draft)
    fully_shard(runner, mesh=mesh)
    return runner


def is_sharded(draft: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in draft.parameters())


def full_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's full, unsharded state dict on CPU on rank 0, {} on the others (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _is_zero3_partitioned(draft: nn.Module) -> bool:
    """DeepSpeed ZeRO-3 replaces each parameter's data by a partition (the parameter carries `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in draft.parameters())


def gathered_draft_state(draft: nn.Module, is_global_zero: bool) -> dict[str, torch.Tensor] | None:
    """The draft's full state dict after sharded training, for the draft/ export: FSDP2 (DTensor shards) through
    torch.distributed.checkpoint, DeepSpeed ZeRO-3 (partitioned parameters) through deepspeed.zero.GatheredParameters;
    a collective in both cases (every rank calls it), the state on rank 0. None when the module holds its full
    weights (one process, DDP, ZeRO-1/2): write its state_dict() as usual."""
    if is_sharded(draft):
        return full_state_dict(draft)
    if _is_zero3_partitioned(draft):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(draft.parameters()), modifier_rank=None):
            return ({k: v.detach().cpu().clone() for k, v in draft.state_dict().items()} if is_global_zero else {})
    return None


def seal_sharded_checkpoint(folder: Path) -> None:
    """The completion record of a sharded checkpoint folder: every file in it (the hidden .metadata of
    torch.distributed.checkpoint included) with its sha256 (dspark.integrity's manifest), written last."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    write_manifest(folder, names)


def move_into_place(staging: Path, path: Path) -> None:
    """Renames the complete `staging` folder to `path`, an existing `path` moved aside (`.NAME.old`) first and
    removed after; the parent folder is synced so the rename survives a power loss."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.is_dir():
        os.replace(path, old)
    elif path.exists():
        path.unlink()
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
