"""The run's offline feature cache (data.feature_cache): where it lives, who builds it (hf: the loaded FrozenTarget;
vllm: vLLM in its own venv), the build as a job of its own before training, whether the cache is already complete
(`plan_feature_cache`, before the target loads) and so how the target loads (`target_loading`: on a hit or a stream
training needs only the target's head, dspark.targets.head_only, and what draft.init_from_target copies). With
data.feature_stream the build runs in a child process while training reads it (`start_feature_stream`,
dspark.data.feature_stream). The config keys are checked by dspark.schema / dspark.preflight before anything here
runs; the functions read the data section (DataKeys), or the run config (dspark.schema.RunConfig) where they
read several sections."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.data.held_out import held_out_count
from dspark.errors import ConfigError
from dspark.targets.head_only import HeadOnlyTarget
from dspark.targets.source import local_model_folder, target_folder

log = logging.getLogger("dspark.feature_cache")


def cache_wanted(data) -> bool:
    """Whether the data section asks for an offline feature cache (data.feature_cache set)."""
    return data.feature_cache not in (None, "", False)


def stream_wanted(data) -> bool:
    """data.feature_stream: training reads the cache while a child process writes it (dspark.data.feature_stream)."""
    return cache_wanted(data) and bool(data.feature_stream)


def cache_layout(data):
    """data.feature_cache_layout -> CacheLayout (encoding, teacher_rows, context_rows)."""
    from dspark.data.feature_cache import CacheLayout

    try:
        return CacheLayout.from_dict(dataclasses.asdict(data.feature_cache_layout))
    except ValueError as e:
        raise ConfigError(f"data.feature_cache_layout: {e}") from e


def cache_dtype(data) -> torch.dtype:
    from dspark.data.feature_cache import CACHE_DTYPES

    return CACHE_DTYPES[str(data.feature_cache_dtype)]


def target_cache_identity(target) -> dict:
    """The cache identity of a loaded target: a head-only one's is computed from its checkpoint (its layers hold no
    values), the same dict feature_cache.target_identity gives for the whole target."""
    from dspark.data.feature_cache import target_identity

    return target.cache_identity if isinstance(target, HeadOnlyTarget) else target_identity(target)


def feature_cache_dir(data, target, dataset, identity: dict | None = None) -> Path | None:
    """data.feature_cache: null -> None; auto -> <DSPARK_CACHE or ~/.cache/dspark>/features/<key> (key from `identity`,
    default: the target's); else a folder."""
    from dspark.data.feature_cache import cache_key, dataset_fingerprint

    if not cache_wanted(data):
        return None
    if str(data.feature_cache) != "auto":  # a named folder: no identity needed (no target may be at hand)
        return Path(str(data.feature_cache)).expanduser()
    ident = identity if identity is not None else target_cache_identity(target)
    key = cache_key(ident, dataset_fingerprint(dataset), cache_dtype(data), cache_layout(data))
    return cache_dir_for_key(data, key)


def cache_dir_for_key(data, key: str) -> Path:
    """data.feature_cache's folder for a cache named `key`: auto -> <DSPARK_CACHE or ~/.cache/dspark>/features/<key>."""
    if str(data.feature_cache) != "auto":
        return Path(str(data.feature_cache)).expanduser()
    from dspark.data.dataset import default_cache_dir

    return default_cache_dir() / "features" / key


def tap_layers(draft_group) -> list[int]:
    """The target layers a draft group reads (`target_layer_ids`; none for MTP drafts)."""
    return [int(i) for i in (draft_group.get("target_layer_ids") or [])]


def rows_before_target(run, dataset_builder):
    """The training rows (`dataset_builder(run.data, tokenizer)`, factory.build_dataset) made with the target's
    tokenizer alone, before any model loads: the held-out split is checked against them, and plan_feature_cache needs
    them."""
    from dspark.targets.hf_target import load_target_tokenizer, resolve_target_source

    return dataset_builder(run.data, load_target_tokenizer(resolve_target_source(target_folder(run.target))))


@dataclass(frozen=True)
class CachePlan:
    """The feature cache as seen before the target loads."""

    path: Path | None  # None: undecidable without loading the target (see plan_feature_cache)
    identity: dict | None  # the target's cache identity, computed from its checkpoint files
    hit: bool  # complete and built for this target, these rows, dtype and layout: training needs only the head


def plan_feature_cache(run, dataset, rows=None) -> CachePlan | None:
    """Whether the cache is complete (a hit), decided from the checkpoint files before the target loads: the target's
    cache identity by `vllm_features.checkpoint_identity` (the dict the loaded target's `target_identity` gives), the
    key and folder as `feature_cache_dir` makes them, meta.json checked against it. A complete cache built for another
    target / rows / dtype / layout is refused now (ConfigError naming each difference), before any model loads. A
    checkpoint whose identity cannot be computed without loading it gives `hit=False` (the whole target loads and
    prepare_feature_cache decides, as before). None when data.feature_cache is null. `rows` (a short run's,
    dspark.training.data_plan.cached_rows): the cache is of those rows, unless the whole set's is complete."""
    if not cache_wanted(run.data):
        return None
    from dspark.data.feature_cache import META_NAME, FeatureCache, dataset_fingerprint
    from dspark.targets.checkpoint import checkpoint_identity
    from dspark.targets.hf_target import resolve_target_source

    layer_ids = tap_layers(run.draft)
    source = resolve_target_source(target_folder(run.target))
    try:
        ident = checkpoint_identity(local_model_folder(source), layer_ids, run.target.dtype, name_or_path=source)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # not in the HF cache yet, .bin files, unmapped names
        log.info("feature cache: whether it is complete cannot be told from the checkpoint files (%s); the whole "
                 "target loads", e)
        return CachePlan(None, None, False)
    path = feature_cache_dir(run.data, None, dataset, identity=ident)
    if rows is not None and not (path / META_NAME).is_file():  # a short run: the cache of the rows it reads
        dataset = dataset.select(rows)
        path = feature_cache_dir(run.data, None, dataset, identity=ident)
    if not (path / META_NAME).is_file():
        return CachePlan(path, ident, False)
    try:
        FeatureCache(path)._check(ident, dataset_fingerprint(dataset), cache_dtype(run.data), cache_layout(run.data))
    except ValueError as e:
        raise ConfigError(f"data.feature_cache: {e}") from e
    return CachePlan(path, ident, True)


@dataclass(frozen=True)
class TargetLoading:
    """How factory.build_target loads the target, decided before it loads (`target_loading`)."""

    head_only: bool  # only the embedding, LM head and final norm are read (dspark.targets.head_only)
    identity: dict | None  # the target's cache identity, computed from its checkpoint files
    why: str  # what makes the target's decoder layers unneeded, for the log lines ("" when nothing does)
    path: Path | None  # the feature cache folder
    init_reads: bool = False  # head-only plus the target modules draft.init_from_target copies (registry.init_reads)


WHOLE_TARGET = TargetLoading(head_only=False, identity=None, why="", path=None)


def target_loading(run, dataset, rows=None) -> TargetLoading:
    """Whether training needs the target's decoder layers. It does not with a feature cache complete for this target
    and these rows (`dataset`, rows_before_target; a hit: plan_feature_cache) or with data.feature_stream (a child
    process computes the features): the target then loads head-only, plus the target modules draft.init_from_target
    copies when the draft family names them (registry.init_reads_named). It does on a miss (this process computes
    the features), with no dataset, and with draft.init_from_target of a family that does not name what its copy
    reads (logged). A stream whose cache identity cannot be computed from the checkpoint is refused (ConfigError).
    `rows`: a short run's cached rows (plan_feature_cache)."""
    from dspark.models import registry

    plan = None if dataset is None else plan_feature_cache(run, dataset, rows) if rows is not None else \
        plan_feature_cache(run, dataset)
    streamed = plan is not None and not plan.hit and stream_wanted(run.data)
    if streamed and plan.identity is None:
        raise ConfigError("data.feature_stream: the target's cache identity cannot be computed from its checkpoint "
                          "files (logged above), so this process cannot check the shards a producer writes; set "
                          "data.feature_stream=false (the target then loads whole and builds the cache first)")
    if plan is None or not (plan.hit or streamed):
        return WHOLE_TARGET
    why = "feature stream (a child process computes the features)" if streamed else "feature cache complete"
    init = bool(run.draft.get("init_from_target", False))
    if init and not registry.init_reads_named(str(run.draft["kind"])):
        log.info("%s, but draft.init_from_target copies target layers: the whole target loads", why)
        return TargetLoading(head_only=False, identity=plan.identity, why=why, path=plan.path)
    return TargetLoading(head_only=True, identity=plan.identity, why=why, path=plan.path, init_reads=init)


def _local_rank() -> int:
    """This process's rank on its node (torchrun / Lightning's DDP launcher / SLURM); 0 when alone."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _build_device(trainer: dict, target) -> torch.device:
    """The build runs on this rank's GPU when the trainer uses one, else where the target already is."""
    accel = str(trainer["accelerator"])
    if accel in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", _local_rank() % torch.cuda.device_count())
    return target.device


def _wait_for_meta(path: Path, poll_s: float = 2.0) -> None:
    """Other ranks wait for local rank 0's build (meta.json is written last, atomically)."""
    from dspark.data.feature_cache import META_NAME

    polls = 0
    while not (path / META_NAME).is_file():
        if polls % 30 == 0:
            log.info("local rank %d: waiting for the feature cache build at %s", _local_rank(), path)
        time.sleep(poll_s)
        polls += 1


def vllm_producer_settings(data) -> dict:
    """data.vllm_producer -> build_feature_cache_vllm's engine keywords."""
    return dataclasses.asdict(data.vllm_producer)


def _build_with_vllm(data, target, dataset, path: Path, layout) -> Path:
    """data.feature_producer=vllm: the cache computed by vLLM (its own venv, dspark.data.vllm_features)."""
    from dspark.data.vllm_features import build_feature_cache_vllm

    name_or_path = str(getattr(target.model.config, "_name_or_path", "") or "")
    return build_feature_cache_vllm(
        local_model_folder(name_or_path), list(target.layer_ids), dataset, path,
        target_dtype=str(target.embed_weight.dtype).removeprefix("torch."), dtype=cache_dtype(data),
        name_or_path=name_or_path, layout=layout, **vllm_producer_settings(data))


def build_feature_cache_offline(run, dataset_builder, shard_size: int | None = None) -> Path:
    """data.feature_producer=vllm as a job of its own (scripts/build_feature_cache.py, after dspark.preflight), without
    loading the target in this process: the rows as train.py builds them (`dataset_builder(run.data, tokenizer)`), the
    cache where train.py looks for it (`auto`: the same key, the identity computed from the checkpoint). Also the
    vllm producer of a feature stream (dspark.data.feature_stream, with the stream's `shard_size`)."""
    from dspark.data.feature_cache import SHARD_SIZE
    from dspark.data.vllm_features import build_feature_cache_vllm
    from dspark.targets.checkpoint import checkpoint_identity
    from dspark.targets.hf_target import resolve_target_source

    if not cache_wanted(run.data):
        raise ConfigError("data.feature_cache: set it (auto or a folder): there is no cache to build")
    if run.data.feature_producer != "vllm":
        raise ConfigError("data.feature_producer: building a cache without training is for the vllm producer "
                          "(the hf producer builds it in train.py)")
    source = resolve_target_source(target_folder(run.target))
    folder = local_model_folder(source)
    layer_ids = tap_layers(run.draft)
    dtype, layout = cache_dtype(run.data), cache_layout(run.data)
    dataset = rows_before_target(run, dataset_builder)
    ident = None
    if str(run.data.feature_cache) == "auto":
        ident = checkpoint_identity(folder, layer_ids, run.target.dtype, name_or_path=source)
    path = feature_cache_dir(run.data, None, dataset, identity=ident)
    return build_feature_cache_vllm(folder, layer_ids, dataset, path, target_dtype=run.target.dtype, dtype=dtype,
                                    name_or_path=source, layout=layout, shard_size=shard_size or SHARD_SIZE,
                                    **vllm_producer_settings(run.data))


def produce_feature_cache(run, dataset_builder, shard_size: int) -> Path:
    """The build a feature stream's child process runs (dspark.produce_features): vllm as
    `build_feature_cache_offline`, hf with the whole target loaded in this (the child) process."""
    from dspark.data.feature_cache import build_feature_cache
    from dspark.targets.hf_target import load_hf_target

    if run.data.feature_producer == "vllm":
        return build_feature_cache_offline(run, dataset_builder, shard_size=shard_size)
    dataset = rows_before_target(run, dataset_builder)
    layer_ids = tap_layers(run.draft)
    target = load_hf_target(target_folder(run.target), layer_ids, run.target.dtype, require_aux=bool(layer_ids))
    target.to(_build_device(run.trainer, target))
    return build_feature_cache(target, dataset, feature_cache_dir(run.data, target, dataset),
                               batch_size=run.train.val_batch_size, dtype=cache_dtype(run.data),
                               layout=cache_layout(run.data), shard_size=shard_size)


def start_feature_stream(run, target, dataset):
    """data.feature_stream with the cache not complete yet: a FeatureStream over it, its producer started as a child
    process by local rank 0 (rows in dspark.data.feature_stream.production_order); the other local ranks, and a run
    that finds another live producer writing this folder, read what that producer writes."""
    from dspark.data import feature_stream as fs
    from dspark.data.feature_cache import PROGRESS_NAME, cache_key, dataset_fingerprint

    layout, dtype, shard_size = cache_layout(run.data), cache_dtype(run.data), int(fs.SHARD_SIZE)
    key = cache_key(target_cache_identity(target), dataset_fingerprint(dataset), dtype, layout)
    path = cache_dir_for_key(run.data, key)
    path.mkdir(parents=True, exist_ok=True)
    work = Path(run.run_dir) / fs.PRODUCER_DIR
    stream = fs.FeatureStream(path, key, len(dataset), shard_size, dtype, layout, log_path=work / "producer.log")
    lock_fd = fs.take_producer_lock(path) if _local_rank() == 0 else None
    if _local_rank() != 0:
        _wait_for_producer(path)
    elif lock_fd is None:
        log.info("feature stream: another producer is writing %s; training reads what it writes", path)
        stream.log_path = None
    else:
        (path / PROGRESS_NAME).unlink(missing_ok=True)  # an ended build's list: the new producer rewrites it
        spec = _producer_spec(run, len(dataset), path, key, shard_size)
        stream.producer = fs.Producer.launch(spec, work, lock_fd)
        log.info("feature stream: producer pid %d (%s) writes %s, %d shards of %d examples, the %d held-out shard(s) "
                 "first; log %s", stream.producer.proc.pid, run.data.feature_producer, path, len(spec["order"]),
                 shard_size, spec["held_out_shards"], stream.log_path)
    return stream


def _producer_spec(run, num_examples: int, path: Path, key: str, shard_size: int) -> dict:
    """What the stream's child process is told (dspark.produce_features): the resolved run config, the cache
    folder and key, the shard size and the production order (held-out shards first)."""
    from dspark.data import feature_stream as fs

    held_out = int(run.data.val_examples)
    return {"config": run.values(), "path": str(path), "key": key,
            "shard_size": shard_size, "order": fs.production_order(num_examples, held_out, shard_size),
            "held_out_shards": len(fs.held_out_shards(num_examples, held_out, shard_size)), "parent": os.getpid()}


def _wait_for_producer(path: Path, poll_s: float = 0.5) -> None:
    """Local ranks > 0: until local rank 0's producer holds the cache's lock (or the cache is complete)."""
    from dspark.data.feature_cache import META_NAME
    from dspark.data.feature_stream import producer_alive

    polls = 0
    while not producer_alive(path) and not (path / META_NAME).is_file():
        if polls % 60 == 0:
            log.info("local rank %d: waiting for local rank 0's feature producer at %s", _local_rank(), path)
        time.sleep(poll_s)
        polls += 1


def prepare_feature_cache(run, target, dataset, rows=None):
    """Builds (local rank 0; a resumed build skips finished shards) or reuses the feature cache, checks that it
    belongs to this target and dataset, and returns it (None when data.feature_cache is null).

    Local rank 0 of every node builds and the other ranks wait for meta.json: correct on node-local disks, and on a
    shared filesystem concurrent builders write identical shards atomically. A head-only target (loaded on a hit,
    factory.build_target) cannot build: every rank only checks the complete cache against its checkpoint identity.
    With data.feature_stream and the cache not complete: a FeatureStream, its producer a child process
    (start_feature_stream). `rows` (a short run's, dspark.training.data_plan.cached_rows): unless the whole set's
    cache is complete, the cache holds only those dataset rows (keyed by them) and is read through a RowSubsetCache.
    Before a build, one line says what it builds; the hf build then says roughly how long (BuildClock).
    """
    if not cache_wanted(run.data):
        return None
    from dspark.data.feature_cache import (META_NAME, FeatureCache, RowSubsetCache, build_feature_cache,
                                           dataset_fingerprint)

    layout, producer = cache_layout(run.data), run.data.feature_producer
    path = feature_cache_dir(run.data, target, dataset)
    reused = (path / META_NAME).is_file()
    if stream_wanted(run.data) and not reused:
        return start_feature_stream(run, target, dataset)
    whole, subset = dataset, None
    if rows is not None and not reused:
        subset, dataset = list(rows), dataset.select(rows)
        path = feature_cache_dir(run.data, target, dataset)
        reused = (path / META_NAME).is_file()
    if not reused and _local_rank() == 0 and not isinstance(target, HeadOnlyTarget):
        log.info(_build_line(run, whole, subset, path))
    t0 = time.perf_counter()
    try:
        if isinstance(target, HeadOnlyTarget):  # loaded on a hit (plan_feature_cache): nothing to build, every rank
            cache = FeatureCache(path)
            cache._check(target.cache_identity, dataset_fingerprint(dataset), cache_dtype(run.data), layout)
        elif _local_rank() == 0:  # builds, or checks an existing cache against this target and dataset
            if producer == "vllm":
                _build_with_vllm(run.data, target, dataset, path, layout)
            else:
                home, device = target.device, _build_device(run.trainer, target)
                target.to(device)
                try:
                    build_feature_cache(target, dataset, path, batch_size=run.train.val_batch_size,
                                        dtype=cache_dtype(run.data), layout=layout)
                finally:
                    target.to(home)
            cache = FeatureCache(path)
            if producer == "vllm":  # its identity was computed from the checkpoint: must be this target's
                cache.check_compatible(target, dataset)
        else:
            _wait_for_meta(path)
            cache = FeatureCache(path)
            cache.check_compatible(target, dataset)
    except ValueError as e:
        raise ConfigError(f"data.feature_cache: {e}") from e
    size = f"{len(cache)} examples, {cache.nbytes / 2**20:.1f} MB ({cache.meta['dtype']})"
    if reused:
        log.info("feature cache reused: %s, %s (built in %.1f s)", path, size, cache.meta["build_seconds"])
    else:
        log.info("feature cache ready: %s, %s in %.1f s", path, size, time.perf_counter() - t0)
    return cache if subset is None else RowSubsetCache(cache, subset, len(whole))


def _build_line(run, dataset, rows, path: Path) -> str:
    """What a build is about to compute, in one line: the whole set, or (`rows`) the rows a short run reads."""
    from dspark.data.feature_cache import row_tokens

    n = len(dataset)
    if rows is None:
        return (f"feature cache: building all {n} rows ({row_tokens(dataset)} tokens) into {path}; the target runs "
                "once per row (how long: said after its first batch)")
    held = held_out_count(run.data.val_examples, n)
    steps = int(run.trainer["max_steps"])
    return (f"feature cache: this run reads {len(rows) - held} training rows ({steps} steps) + {held} held out: "
            f"building {len(rows)} of the {n} rows ({row_tokens(dataset.select(rows))} tokens) into {path}, keyed by "
            "those rows (a run that reads others builds its own; a run that reads half the set or more builds the "
            "whole set's, which every run then reads)")
