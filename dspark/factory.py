"""Builds the run's pieces from train.py's typed config (dspark.schema.RunConfig, checked by dspark.preflight before
any model loads): target, draft, dataset, DataModule, LightningModule. Each builder takes the sections it reads: the
target builder the target section, the draft group and how the target loads; the draft builder the draft group; the
dataset builder the data section. The DataModule and the LightningModule read several sections and take the run
config (a Hydra DictConfig is checked and typed first: dspark.schema.run_config)."""
from __future__ import annotations

import logging
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Mapping

import torch

from dspark.errors import ConfigError  # noqa: F401  (re-exported for callers that catch it from here)
from dspark.data.feature_cache_build import WHOLE_TARGET, TargetLoading, tap_layers
from dspark.models import registry
from dspark.schema import DataKeys, RunConfig, TargetKeys, run_config
from dspark.targets.head_only import HeadOnlyTarget, HeadOnlyUnsupported, load_head_only_target
from dspark.targets.hf_target import FrozenTarget, load_hf_target
from dspark.targets.source import target_folder

log = logging.getLogger("dspark.factory")


def build_target(target: TargetKeys, draft_group: Mapping[str, Any],
                 loading: TargetLoading = WHOLE_TARGET) -> FrozenTarget:
    """The frozen target of the target section, capturing the layers the draft group reads (`target_layer_ids`; MTP
    drafts read none). `loading` (feature_cache_build.target_loading: whether training runs the target's layers)
    may make it head-only (embedding, LM head, final norm: dspark.targets.head_only, plus the target modules
    draft.init_from_target copies when the draft family names them); a checkpoint head_only cannot map exactly
    loads whole, logged."""
    layer_ids = tap_layers(draft_group)
    folder, dtype, aux = target_folder(target), str(target.dtype), bool(layer_ids)
    if loading.head_only:
        also = partial(registry.init_reads, draft_group) if loading.init_reads else None
        try:
            frozen = load_head_only_target(folder, layer_ids, dtype, require_aux=aux, cache_identity=loading.identity,
                                           also=also)
        except HeadOnlyUnsupported as e:
            log.warning("%s, but the target cannot load head-only (%s): it loads whole", loading.why, e)
        else:
            log.info("%s (%s): %s", loading.why, loading.path, _head_only_line(frozen))
            return frozen
    return load_hf_target(folder, layer_ids, dtype, require_aux=aux)


def _head_only_line(target: HeadOnlyTarget) -> str:
    """What a head-only target read, for the log."""
    ckpt = target.checkpoint
    size = f"{ckpt.bytes_read / 2**20:.1f} MB of the checkpoint's {ckpt.nbytes / 2**20:.1f} MB"
    if not target.init_modules:
        return f"target head only (embedding, LM head, final norm: {size})"
    return (f"target head only + what draft.init_from_target copies (embedding, LM head, final norm, "
            f"{', '.join(target.init_modules)}: {size})")


def build_draft(group: Mapping[str, Any], target: FrozenTarget) -> torch.nn.Module:
    """The draft of a draft group, built by its family against the target (dspark.models.registry.build_draft),
    then started from another draft's weights when the group names one (`init_from`, dspark.warm_start). The group
    as the draft resolved it (what draft_config.json and a checkpoint hold) is `resolved_group(draft, group)`."""
    draft = registry.build_draft(group, target)
    if isinstance(target, HeadOnlyTarget):
        target.release_init_modules()  # copied into the draft: training reads only the head
    if group.get("init_from"):
        from dspark.warm_start import init_from

        init_from(draft, str(group["init_from"]))
    return draft


def resolved_group(draft: torch.nn.Module, group: Mapping[str, Any]) -> dict[str, Any]:
    """The draft group as the built draft resolved it (the target's sizes under arch, the mask id, ...)."""
    return registry.resolved_group(draft.config, str(group["kind"]), group)


def load_records(data: DataKeys):
    """A zero-argument callable yielding conversation records (only called on a cache miss). Malformed jsonl lines
    are skipped and counted unless data.strict, which refuses the file at the first bad line, naming it."""
    limit = None if data.limit is None else int(data.limit)
    if data.source == "sharegpt":
        from dspark.data.sharegpt import iter_sharegpt

        return lambda: iter_sharegpt(data.path, limit=limit, english_only=bool(data.english_only))
    from dspark.data.jsonl import iter_jsonl_records

    return lambda: islice(iter_jsonl_records(str(data.path), strict=bool(data.strict)), limit)


def build_dataset(data: DataKeys, tokenizer):
    """The tokenized chat rows of the data section (cached by its source, limit and length settings)."""
    from dspark.data.dataset import cached_chat_dataset

    source = f"{data.source}:{data.path}:{data.limit}:en={data.english_only}:strict={data.strict}"
    if data.path is not None and Path(str(data.path)).is_file():  # a changed file is a new cache entry
        st = Path(str(data.path)).stat()
        source += f":{st.st_size}:{st.st_mtime_ns}"
    return cached_chat_dataset(source, load_records(data), tokenizer, int(data.max_length),
                               min_loss_tokens=int(data.min_loss_tokens))


def build_datamodule(run: RunConfig, tokenizer, dataset=None, target: FrozenTarget | None = None):
    """Train/val DataModule; with data.feature_cache set, builds (or reuses) the offline feature cache for `target`
    first (dspark.data.feature_cache_build), and the batches then carry the cached features; with data.feature_stream
    the cache is read while a child process writes it (dspark.data.feature_stream) and the first pass over the data
    follows the order the shards are written in."""
    from dspark.data import feature_stream
    from dspark.data.feature_cache_build import cache_wanted, prepare_feature_cache, stream_wanted
    from dspark.training.data_module import ChatDataModule, held_out_count

    run = run_config(run)
    data, train, trainer = run.data, run.train, run.trainer
    if cache_wanted(data) and target is None:
        raise ValueError("build_datamodule: data.feature_cache needs the target (pass target=)")
    dataset = dataset if dataset is not None else build_dataset(data, tokenizer)
    features = prepare_feature_cache(run, target, dataset)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    val = held_out_count(data.val_examples, len(dataset))  # auto -> its count (run.choose_held_out says it)
    # streamed: the first pass follows the producer's shards (whether or not the cache is complete by now)
    groups = feature_stream.first_pass_groups(len(dataset), val, feature_stream.SHARD_SIZE) \
        if stream_wanted(data) else None
    return ChatDataModule(
        dataset, pad_id=int(pad), batch_size=train.batch_size, num_anchors=train.num_anchors,
        total_batches=int(trainer["max_steps"]) * int(trainer["accumulate_grad_batches"]),
        val_examples=val, val_batch_size=train.val_batch_size,
        seed=run.seed, num_workers=data.num_workers, features=features, first_pass_groups=groups,
        group_by_length=data.group_by_length,
    )


def build_module(run: RunConfig, draft, target: FrozenTarget):
    """The LightningModule of the draft family's objective (dspark.training.modules.MODULES), from that objective's
    train.* keys (its KEYS, typed here) and the shared optimisation keys."""
    from dspark.ops.backend import set_ops_backend
    from dspark.schema import typed
    from dspark.training.module import OptimConfig
    from dspark.training.modules import MODULES

    run = run_config(run)
    set_ops_backend(run.ops_backend)
    module_cls = MODULES[registry.family(str(run.draft["kind"])).objective]
    module = module_cls.from_config(typed(module_cls.KEYS, run.objective), draft, target, OptimConfig.from_keys(run.train, run.trainer["max_steps"]))
    # the resolved run config: in every checkpoint (hyper_parameters) and every logger (hparams.yaml, W&B config)
    module.save_hyperparameters({**run.values(), "draft": resolved_group(draft, run.draft)})
    return module
