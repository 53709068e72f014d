"""The run's offline feature cache (data.feature_cache) built from its plan (dspark.data.cache_plan.FeatureCachePlan,
decided once by the layer that builds the run): where it lives, who builds it (hf: the loaded FrozenTarget; vllm:
the plan's vLLM client, in its own venv), the build as a job of its own before training, whether the cache is already
complete (`cache_status`, before the target loads) and so how the target loads (`target_loading`: on a hit or a
stream training needs only the target's head, dspark.targets.head_only, and what draft.init_from_target copies).
With data.feature_stream the build runs in a child process while training reads it (`start_feature_stream`,
dspark.data.feature_stream). The config keys are checked by dspark.schema / dspark.preflight before anything here
runs; the functions read the plan and the data section (DataKeys), never the whole run config."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.data import feature_stream as fs
from dspark.data.cache_plan import FeatureCachePlan
from dspark.data.feature_cache import (META_NAME, PROGRESS_NAME, SHARD_SIZE, FeatureCache, RowSubsetCache,
                                       build_feature_cache, cache_key, dataset_fingerprint, row_tokens,
                                       target_identity)
from dspark.data.held_out import held_out_count
from dspark.errors import ConfigError
from dspark.io import default_cache_dir
from dspark.models import registry
from dspark.schema import DataKeys
from dspark.targets.checkpoint import checkpoint_identity
from dspark.targets.head_only import HeadOnlyTarget
from dspark.targets.hf_target import load_hf_target, load_target_tokenizer, resolve_target_source
from dspark.targets.source import local_model_folder

log = logging.getLogger("dspark.feature_cache")


def target_cache_identity(target) -> dict:
    """The cache identity of a loaded target: a head-only one's is computed from its checkpoint (its layers hold no
    values), the same dict feature_cache.target_identity gives for the whole target."""
    return target.cache_identity if isinstance(target, HeadOnlyTarget) else target_identity(target)


def feature_cache_dir(plan: FeatureCachePlan, target, dataset, identity: dict | None = None) -> Path:
    """The plan's folder: a named one as is (no identity needed: no target may be at hand); auto ->
    <DSPARK_CACHE or ~/.cache/dspark>/features/<key> (key from `identity`, default: the target's)."""
    if plan.folder is not None:
        return plan.folder
    ident = identity if identity is not None else target_cache_identity(target)
    return cache_dir_for_key(plan, cache_key(ident, dataset_fingerprint(dataset), plan.dtype, plan.layout))


def cache_dir_for_key(plan: FeatureCachePlan, key: str) -> Path:
    """The plan's folder for a cache named `key`: auto -> <DSPARK_CACHE or ~/.cache/dspark>/features/<key>."""
    if plan.folder is not None:
        return plan.folder
    return default_cache_dir() / "features" / key


def tap_layers(draft) -> list[int]:
    """The target layers a draft reads (`target_layer_ids` of its resolved config or of a draft group; none for MTP
    drafts)."""
    ids = draft.get("target_layer_ids") if isinstance(draft, Mapping) else getattr(draft, "target_layer_ids", None)
    return [int(i) for i in (ids or [])]


def rows_before_target(data: DataKeys, target_path: str, dataset_builder):
    """The training rows (`dataset_builder(data, tokenizer)`, factory.build_dataset) made with the tokenizer of the
    target at `target_path` (targets.source.target_folder) alone, before any model loads: the held-out split is
    checked against them, and cache_status needs them."""
    return dataset_builder(data, load_target_tokenizer(resolve_target_source(target_path)))


@dataclass(frozen=True)
class CacheStatus:
    """The feature cache as seen before the target loads."""

    path: Path | None  # None: undecidable without loading the target (see cache_status)
    identity: dict | None  # the target's cache identity, computed from its checkpoint files
    hit: bool  # complete and built for this target, these rows, dtype and layout: training needs only the head


def cache_status(plan: FeatureCachePlan, dataset, rows=None) -> CacheStatus:
    """Whether the cache is complete (a hit), decided from the checkpoint files before the target loads: the target's
    cache identity by `targets.checkpoint.checkpoint_identity` (the dict the loaded target's `target_identity`
    gives), the key and folder as `feature_cache_dir` makes them, meta.json checked against it. A complete cache built
    for another target / rows / dtype / layout is refused now (ConfigError naming each difference), before any model
    loads. A checkpoint whose identity cannot be computed without loading it gives `hit=False` (the whole target
    loads and prepare_feature_cache decides, as before). `rows` (a short run's, dspark.training.data_plan.cached_rows):
    the cache is of those rows, unless the whole set's is complete."""
    source = resolve_target_source(plan.target_path)
    try:
        ident = checkpoint_identity(local_model_folder(source), list(plan.layer_ids), plan.target_dtype,
                                    name_or_path=source)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # not in the HF cache yet, .bin files, unmapped names
        log.info("feature cache: whether it is complete cannot be told from the checkpoint files (%s); the whole "
                 "target loads", e)
        return CacheStatus(None, None, False)
    path = feature_cache_dir(plan, None, dataset, identity=ident)
    if rows is not None and not (path / META_NAME).is_file():  # a short run: the cache of the rows it reads
        dataset = dataset.select(rows)
        path = feature_cache_dir(plan, None, dataset, identity=ident)
    if not (path / META_NAME).is_file():
        return CacheStatus(path, ident, False)
    try:
        FeatureCache(path)._check(ident, dataset_fingerprint(dataset), plan.dtype, plan.layout)
    except ValueError as e:
        raise ConfigError(f"data.feature_cache: {e}") from e
    return CacheStatus(path, ident, True)


@dataclass(frozen=True)
class TargetLoading:
    """How factory.build_target loads the target, decided before it loads (`target_loading`)."""

    head_only: bool  # only the embedding, LM head and final norm are read (dspark.targets.head_only)
    identity: dict | None  # the target's cache identity, computed from its checkpoint files
    why: str  # what makes the target's decoder layers unneeded, for the log lines ("" when nothing does)
    path: Path | None  # the feature cache folder
    init_reads: bool = False  # head-only plus the target modules draft.init_from_target copies (registry.init_reads)


WHOLE_TARGET = TargetLoading(head_only=False, identity=None, why="", path=None)


def target_loading(plan: FeatureCachePlan | None, copies_target: str | None, dataset, rows=None) -> TargetLoading:
    """Whether training needs the target's decoder layers. It does not with a feature cache complete for this target
    and these rows (`dataset`, rows_before_target; a hit: cache_status) or with data.feature_stream (a child
    process computes the features): the target then loads head-only, plus the target modules draft.init_from_target
    copies when the draft family names them (registry.init_reads_named; `copies_target`: the draft's kind with
    draft.init_from_target set, else None). It does without a cache
    (`plan` None), on a miss (this process computes the features), with no dataset, and with draft.init_from_target
    of a family that does not name what its copy reads (logged). A stream whose cache identity cannot be computed
    from the checkpoint is refused (ConfigError). `rows`: a short run's cached rows (cache_status)."""
    status = None if plan is None or dataset is None else cache_status(plan, dataset, rows) if rows is not None \
        else cache_status(plan, dataset)
    streamed = status is not None and not status.hit and plan.stream
    if streamed and status.identity is None:
        raise ConfigError("data.feature_stream: the target's cache identity cannot be computed from its checkpoint "
                          "files (logged above), so this process cannot check the shards a producer writes; set "
                          "data.feature_stream=false (the target then loads whole and builds the cache first)")
    if status is None or not (status.hit or streamed):
        return WHOLE_TARGET
    why = "feature stream (a child process computes the features)" if streamed else "feature cache complete"
    init = copies_target is not None
    if init and not registry.init_reads_named(copies_target):
        log.info("%s, but draft.init_from_target copies target layers: the whole target loads", why)
        return TargetLoading(head_only=False, identity=status.identity, why=why, path=status.path)
    return TargetLoading(head_only=True, identity=status.identity, why=why, path=status.path, init_reads=init)


def _build_device(plan: FeatureCachePlan, target):
    """Where the in-process build runs: the plan's device (this rank's GPU when the trainer uses one), else where the
    target already is."""
    return plan.device if plan.device is not None else target.device


def _wait_for_meta(path: Path, local_rank: int, poll_s: float = 2.0) -> None:
    """Other ranks wait for local rank 0's build (meta.json is written last, atomically)."""
    polls = 0
    while not (path / META_NAME).is_file():
        if polls % 30 == 0:
            log.info("local rank %d: waiting for the feature cache build at %s", local_rank, path)
        time.sleep(poll_s)
        polls += 1


def _build_with_vllm(plan: FeatureCachePlan, target, dataset, path: Path) -> Path:
    """data.feature_producer=vllm: the cache computed by the plan's vLLM client (its own venv) for the loaded target."""
    name_or_path = str(getattr(target.model.config, "_name_or_path", "") or "")
    return plan.vllm.build(
        local_model_folder(name_or_path), list(target.layer_ids), dataset, path,
        target_dtype=str(target.embed_weight.dtype).removeprefix("torch."), dtype=plan.dtype,
        name_or_path=name_or_path, layout=plan.layout, **plan.vllm.engine_keywords())


def build_feature_cache_offline(plan: FeatureCachePlan | None, data: DataKeys, dataset_builder,
                                shard_size: int | None = None) -> Path:
    """data.feature_producer=vllm as a job of its own (scripts/build_feature_cache.py, after dspark.preflight), without
    loading the target in this process: the rows as train.py builds them (`dataset_builder(data, tokenizer)`), the
    cache where train.py looks for it (`auto`: the same key, the identity computed from the checkpoint). Also the
    vllm producer of a feature stream (dspark.data.feature_stream, with the stream's `shard_size`). `plan` None: the
    run has no data.feature_cache."""
    if plan is None:
        raise ConfigError("data.feature_cache: set it (auto or a folder): there is no cache to build")
    if plan.vllm is None:
        raise ConfigError("data.feature_producer: building a cache without training is for the vllm producer "
                          "(the hf producer builds it in train.py)")
    source = resolve_target_source(plan.target_path)
    folder = local_model_folder(source)
    layer_ids = list(plan.layer_ids)
    dataset = rows_before_target(data, plan.target_path, dataset_builder)
    ident = None
    if plan.folder is None:
        ident = checkpoint_identity(folder, layer_ids, plan.target_dtype, name_or_path=source)
    path = feature_cache_dir(plan, None, dataset, identity=ident)
    return plan.vllm.build(folder, layer_ids, dataset, path, target_dtype=plan.target_dtype, dtype=plan.dtype,
                           name_or_path=source, layout=plan.layout, shard_size=shard_size or SHARD_SIZE,
                           **plan.vllm.engine_keywords())


def produce_feature_cache(plan: FeatureCachePlan, data: DataKeys, dataset_builder, shard_size: int) -> Path:
    """The build a feature stream's child process runs (dspark.produce_features): vllm as
    `build_feature_cache_offline`, hf with the whole target loaded in this (the child) process."""
    if plan.vllm is not None:
        return build_feature_cache_offline(plan, data, dataset_builder, shard_size=shard_size)
    dataset = rows_before_target(data, plan.target_path, dataset_builder)
    target = load_hf_target(plan.target_path, list(plan.layer_ids), plan.target_dtype,
                            require_aux=bool(plan.layer_ids))
    target.to(_build_device(plan, target))
    return build_feature_cache(target, dataset, feature_cache_dir(plan, target, dataset), batch_size=plan.batch_size,
                               dtype=plan.dtype, layout=plan.layout, shard_size=shard_size)


def start_feature_stream(plan: FeatureCachePlan, target, dataset, child_config: Mapping[str, Any]):
    """data.feature_stream with the cache not complete yet: a FeatureStream over it, its producer started as a child
    process by local rank 0 (rows in dspark.data.feature_stream.production_order) and told the resolved run config
    `child_config`; the other local ranks, and a run that finds another live producer writing this folder, read what
    that producer writes."""
    shard_size = int(fs.SHARD_SIZE)
    key = cache_key(target_cache_identity(target), dataset_fingerprint(dataset), plan.dtype, plan.layout)
    path = cache_dir_for_key(plan, key)
    path.mkdir(parents=True, exist_ok=True)
    work = plan.work_dir
    stream = fs.FeatureStream(path, key, len(dataset), shard_size, plan.dtype, plan.layout,
                              log_path=work / "producer.log")
    lock_fd = fs.take_producer_lock(path) if plan.local_rank == 0 else None
    if plan.local_rank != 0:
        _wait_for_producer(path, plan.local_rank)
    elif lock_fd is None:
        log.info("feature stream: another producer is writing %s; training reads what it writes", path)
        stream.log_path = None
    else:
        (path / PROGRESS_NAME).unlink(missing_ok=True)  # an ended build's list: the new producer rewrites it
        spec = _producer_spec(plan, child_config, len(dataset), path, key, shard_size)
        stream.producer = fs.Producer.launch(spec, work, lock_fd)
        log.info("feature stream: producer pid %d (%s) writes %s, %d shards of %d examples, the %d held-out shard(s) "
                 "first; log %s", stream.producer.proc.pid, plan.producer, path, len(spec["order"]),
                 shard_size, spec["held_out_shards"], stream.log_path)
    return stream


def _producer_spec(plan: FeatureCachePlan, child_config: Mapping[str, Any], num_examples: int, path: Path, key: str,
                   shard_size: int) -> dict:
    """What the stream's child process is told (dspark.produce_features): the resolved run config, the cache
    folder and key, the shard size and the production order (held-out shards first)."""
    held_out = int(plan.val_examples)
    return {"config": child_config, "path": str(path), "key": key,
            "shard_size": shard_size, "order": fs.production_order(num_examples, held_out, shard_size),
            "held_out_shards": len(fs.held_out_shards(num_examples, held_out, shard_size)), "parent": os.getpid()}


def _wait_for_producer(path: Path, local_rank: int, poll_s: float = 0.5) -> None:
    """Local ranks > 0: until local rank 0's producer holds the cache's lock (or the cache is complete)."""
    polls = 0
    while not fs.producer_alive(path) and not (path / META_NAME).is_file():
        if polls % 60 == 0:
            log.info("local rank %d: waiting for local rank 0's feature producer at %s", local_rank, path)
        time.sleep(poll_s)
        polls += 1


def prepare_feature_cache(plan: FeatureCachePlan | None, target, dataset, rows=None,
                          child_config: Mapping[str, Any] | None = None):
    """Builds (local rank 0; a resumed build skips finished shards) or reuses the feature cache of `plan`, checks that
    it belongs to this target and dataset, and returns it (None when the run has no cache: `plan` None).

    Local rank 0 of every node builds and the other ranks wait for meta.json: correct on node-local disks, and on a
    shared filesystem concurrent builders write identical shards atomically. A head-only target (loaded on a hit,
    factory.build_target) cannot build: every rank only checks the complete cache against its checkpoint identity.
    With data.feature_stream and the cache not complete: a FeatureStream, its producer a child process told
    `child_config` (start_feature_stream). `rows` (a short run's, dspark.training.data_plan.cached_rows): unless the
    whole set's cache is complete, the cache holds only those dataset rows (keyed by them) and is read through a
    RowSubsetCache. Before a build, one line says what it builds; the hf build then says roughly how long
    (BuildClock).
    """
    if plan is None:
        return None
    path = feature_cache_dir(plan, target, dataset)
    reused = (path / META_NAME).is_file()
    if plan.stream and not reused:
        if child_config is None:
            raise ValueError("prepare_feature_cache: data.feature_stream needs the run config its producer is told "
                             "(child_config=)")
        return start_feature_stream(plan, target, dataset, child_config)
    whole, subset = dataset, None
    if rows is not None and not reused:
        subset, dataset = list(rows), dataset.select(rows)
        path = feature_cache_dir(plan, target, dataset)
        reused = (path / META_NAME).is_file()
    if not reused and plan.local_rank == 0 and not isinstance(target, HeadOnlyTarget):
        log.info(_build_line(plan, whole, subset, path))
    t0 = time.perf_counter()
    try:
        if isinstance(target, HeadOnlyTarget):  # loaded on a hit (cache_status): nothing to build, every rank
            cache = FeatureCache(path)
            cache._check(target.cache_identity, dataset_fingerprint(dataset), plan.dtype, plan.layout)
        elif plan.local_rank == 0:  # builds, or checks an existing cache against this target and dataset
            if plan.vllm is not None:
                _build_with_vllm(plan, target, dataset, path)
            else:
                home, device = target.device, _build_device(plan, target)
                target.to(device)
                try:
                    build_feature_cache(target, dataset, path, batch_size=plan.batch_size, dtype=plan.dtype,
                                        layout=plan.layout)
                finally:
                    target.to(home)
            cache = FeatureCache(path)
            if plan.vllm is not None:  # its identity was computed from the checkpoint: must be this target's
                cache.check_compatible(target, dataset)
        else:
            _wait_for_meta(path, plan.local_rank)
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


def _build_line(plan: FeatureCachePlan, dataset, rows, path: Path) -> str:
    """What a build is about to compute, in one line: the whole set, or (`rows`) the rows a short run reads."""
    n = len(dataset)
    if rows is None:
        return (f"feature cache: building all {n} rows ({row_tokens(dataset)} tokens) into {path}; the target runs "
                "once per row (how long: said after its first batch)")
    held = held_out_count(plan.val_examples, n)
    return (f"feature cache: this run reads {len(rows) - held} training rows ({plan.steps} steps) + {held} held out: "
            f"building {len(rows)} of the {n} rows ({row_tokens(dataset.select(rows))} tokens) into {path}, keyed by "
            "those rows (a run that reads others builds its own; a run that reads half the set or more builds the "
            "whole set's, which every run then reads)")
