"""The run's feature cache plan (dspark.data.cache_plan.FeatureCachePlan), decided once from the run config by the
layer that builds the run: what to cache and where (the data section), which target and taps (the target section,
the draft group), who computes it (data.feature_producer: the target in this process, or vLLM through the vLLM
client dspark.serving.vllm_features), on which device (the trainer's accelerator and this process's local rank),
and the run's own facts a build and a stream need (held-out rows, max_steps, the run dir). dspark/data/ reads the
plan and never the run config."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from dspark.data.cache_plan import (FeatureCachePlan, VllmProducer, cache_dtype, cache_layout, cache_wanted,
                                    named_folder)
from dspark.data.feature_cache_build import tap_layers
from dspark.data.feature_stream import PRODUCER_DIR
from dspark.schema import RunConfig
from dspark.serving.vllm_features import build_feature_cache_vllm
from dspark.targets.source import target_folder

GPU_ACCELERATORS = ("gpu", "cuda", "auto")  # trainer.accelerator values that put the in-process build on a GPU


def local_rank() -> int:
    """This process's rank on its node (torchrun / Lightning's DDP launcher / SLURM); 0 when alone."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def build_device(accelerator: str, rank: int) -> torch.device | None:
    """The in-process build runs on this rank's GPU when the trainer uses one (trainer.accelerator, Lightning's
    default auto; None: where the target already is)."""
    if str(accelerator) in GPU_ACCELERATORS and torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return None


def feature_cache_plan(run: RunConfig) -> FeatureCachePlan | None:
    """The run's feature cache plan; None when data.feature_cache is null. Made after the held-out count is known
    (training.run.choose_held_out), so a stream writes the right held-out shards first."""
    data = run.data
    if not cache_wanted(data):
        return None
    vllm = VllmProducer(build_feature_cache_vllm, data.vllm_producer) if data.feature_producer == "vllm" else None
    rank = local_rank()
    return FeatureCachePlan(
        folder=named_folder(data), dtype=cache_dtype(data), layout=cache_layout(data),
        stream=bool(data.feature_stream), layer_ids=tuple(tap_layers(run.draft)),
        target_path=target_folder(run.target), target_dtype=run.target.dtype, vllm=vllm,
        batch_size=int(run.train.val_batch_size), device=build_device(run.trainer.get("accelerator", "auto"), rank),
        local_rank=rank, val_examples=data.val_examples, steps=int(run.trainer["max_steps"]),
        work_dir=Path(run.run_dir) / PRODUCER_DIR)
