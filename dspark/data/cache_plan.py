"""What the run's offline feature cache is, decided once before anything is built (`FeatureCachePlan`): which
rows' features it holds (the target, its taps, its dtype), where it lives, how it is stored, who computes it (the
target loaded in this process, or vLLM in its own venv: `VllmProducer`) and on which device. The training layer that
builds the run makes the plan (dspark.training.cache_plan.feature_cache_plan); dspark.data.feature_cache_build
builds, checks and streams the cache from it. The readings of the data section the plan is made of (DataKeys) are
here too."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.data.feature_cache import CACHE_DTYPES, CacheLayout
from dspark.errors import ConfigError
from dspark.schema import DataKeys, VLLMProducerKeys


def cache_wanted(data: DataKeys) -> bool:
    """Whether the data section asks for an offline feature cache (data.feature_cache set)."""
    return data.feature_cache not in (None, "", False)


def stream_wanted(data: DataKeys) -> bool:
    """data.feature_stream: training reads the cache while a child process writes it (dspark.data.feature_stream)."""
    return cache_wanted(data) and bool(data.feature_stream)


def cache_layout(data: DataKeys) -> CacheLayout:
    """data.feature_cache_layout -> CacheLayout (encoding, teacher_rows, context_rows)."""
    try:
        return CacheLayout.from_dict(dataclasses.asdict(data.feature_cache_layout))
    except ValueError as e:
        raise ConfigError(f"data.feature_cache_layout: {e}") from e


def cache_dtype(data: DataKeys) -> torch.dtype:
    """data.feature_cache_dtype -> the storage dtype."""
    return CACHE_DTYPES[str(data.feature_cache_dtype)]


def named_folder(data: DataKeys) -> Path | None:
    """data.feature_cache as a folder; None for auto (the folder is named by the cache's key)."""
    return None if str(data.feature_cache) == "auto" else Path(str(data.feature_cache)).expanduser()


@dataclass(frozen=True)
class VllmProducer:
    """data.feature_producer=vllm: vLLM computes the cache in its own venv. `build` is the vLLM client's
    build_feature_cache_vllm (dspark.serving.vllm_features), chosen by whoever makes the plan: data/ names no
    client; `settings` are its engine keywords (data.vllm_producer)."""

    build: Callable[..., Path]
    settings: VLLMProducerKeys

    def engine_keywords(self) -> dict[str, Any]:
        """data.vllm_producer -> build_feature_cache_vllm's engine keywords."""
        return dataclasses.asdict(self.settings)


@dataclass(frozen=True)
class FeatureCachePlan:
    """The feature cache of one run, as decided before the target loads (a run without data.feature_cache has none:
    the planner returns None)."""

    folder: Path | None  # data.feature_cache as a folder; None: auto, <DSPARK_CACHE or ~/.cache/dspark>/features/<key>
    dtype: torch.dtype  # storage dtype (data.feature_cache_dtype)
    layout: CacheLayout  # data.feature_cache_layout
    stream: bool  # data.feature_stream: a child process writes the cache while training reads it
    layer_ids: tuple[int, ...]  # the target layers the draft reads (draft.target_layer_ids)
    target_path: str  # the target's local folder or Hub id (targets.source.target_folder)
    target_dtype: str  # the dtype the target runs in (target.dtype)
    vllm: VllmProducer | None  # None: the target loaded in this process computes the cache (data.feature_producer=hf)
    batch_size: int  # rows per target forward of the in-process build (train.val_batch_size)
    device: torch.device | None  # where the in-process build runs; None: where the target already is
    local_rank: int  # this process's rank on its node: local rank 0 builds, the others wait for it
    val_examples: int | str  # data.val_examples: the held-out rows (held_out_count), the stream writes them first
    steps: int  # the run's trainer.max_steps, for the line that says what a short run's build computes
    work_dir: Path  # the stream producer's spec.json and producer.log (<run_dir>/feature_producer)

    @property
    def producer(self) -> str:
        """data.feature_producer: hf | vllm."""
        return "hf" if self.vllm is None else "vllm"
