"""Builds the run's pieces from a config that dspark.preflight has already checked: target, draft, dataset,
DataModule, LightningModule. Nothing here checks a key (dspark.schema / dspark.preflight do, before any model loads)."""
from __future__ import annotations

import logging
from functools import partial
from itertools import islice
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from dspark.errors import ConfigError  # noqa: F401  (re-exported for callers that catch it from here)
from dspark.models import registry
from dspark.targets.head_only import HeadOnlyTarget, HeadOnlyUnsupported, load_head_only_target
from dspark.targets.hf_target import FrozenTarget, load_hf_target
from dspark.targets.source import target_folder

log = logging.getLogger("dspark.factory")


def build_target(cfg: DictConfig, dataset=None) -> FrozenTarget:
    """The frozen target, capturing the layers the draft group reads (`target_layer_ids`; MTP drafts read none).

    With `dataset` (the rows training reads: feature_cache_build.rows_before_target), how it loads is decided by
    feature_cache_build.target_loading: head-only (embedding, LM head, final norm: dspark.targets.head_only, plus
    the target modules draft.init_from_target copies when the draft family names them) when training never runs
    the target, else whole. A checkpoint head_only cannot map exactly loads whole, logged."""
    from dspark.data.feature_cache_build import target_loading

    layer_ids = [int(i) for i in (cfg.draft.get("target_layer_ids") or [])]
    folder, dtype, aux = target_folder(cfg.target), str(cfg.target.dtype), bool(layer_ids)
    loading = target_loading(cfg, dataset)
    if loading.head_only:
        also = partial(registry.init_reads, cfg.draft) if loading.init_reads else None
        try:
            target = load_head_only_target(folder, layer_ids, dtype, require_aux=aux, cache_identity=loading.identity,
                                           also=also)
        except HeadOnlyUnsupported as e:
            log.warning("%s, but the target cannot load head-only (%s): it loads whole", loading.why, e)
        else:
            log.info("%s (%s): %s", loading.why, loading.path, _head_only_line(target))
            return target
    return load_hf_target(folder, layer_ids, dtype, require_aux=aux)


def _head_only_line(target: HeadOnlyTarget) -> str:
    """What a head-only target read, for the log."""
    ckpt = target.checkpoint
    size = f"{ckpt.bytes_read / 2**20:.1f} MB of the checkpoint's {ckpt.nbytes / 2**20:.1f} MB"
    if not target.init_modules:
        return f"target head only (embedding, LM head, final norm: {size})"
    return (f"target head only + what draft.init_from_target copies (embedding, LM head, final norm, "
            f"{', '.join(target.init_modules)}: {size})")


def build_draft(cfg: DictConfig, target: FrozenTarget) -> torch.nn.Module:
    """The draft group's family builds the draft against the target (dspark.models.registry.build_draft); the
    resolved group is written back into cfg.draft, so draft/draft_config.json and the checkpoint's hyper_parameters
    hold the complete config."""
    draft = registry.build_draft(cfg.draft, target)
    if isinstance(target, HeadOnlyTarget):
        target.release_init_modules()  # copied into the draft: training reads only the head
    if cfg.draft.get("init_from"):
        from dspark.warm_start import init_from

        init_from(draft, str(cfg.draft.init_from))
    resolved = registry.resolved_group(draft.config, str(cfg.draft.kind), cfg.draft)
    with open_dict(cfg.draft):
        for key, value in resolved.items():
            cfg.draft[key] = value
    return draft


def load_records(data: DictConfig):
    """A zero-argument callable yielding conversation records (only called on a cache miss). Malformed jsonl lines
    are skipped and counted unless data.strict, which refuses the file at the first bad line, naming it."""
    limit = None if data.limit is None else int(data.limit)
    if data.source == "sharegpt":
        from dspark.data.sharegpt import iter_sharegpt

        return lambda: iter_sharegpt(data.path, limit=limit, english_only=bool(data.english_only))
    from dspark.data.jsonl import iter_jsonl_records

    return lambda: islice(iter_jsonl_records(str(data.path), strict=bool(data.strict)), limit)


def build_dataset(data: DictConfig, tokenizer):
    """The tokenized chat rows of the data section (cached by its source, limit and length settings)."""
    from dspark.data.dataset import cached_chat_dataset

    source = f"{data.source}:{data.path}:{data.limit}:en={data.english_only}:strict={data.strict}"
    if data.path is not None and Path(str(data.path)).is_file():  # a changed file is a new cache entry
        st = Path(str(data.path)).stat()
        source += f":{st.st_size}:{st.st_mtime_ns}"
    return cached_chat_dataset(source, load_records(data), tokenizer, int(data.max_length),
                               min_loss_tokens=int(data.min_loss_tokens))


def build_datamodule(cfg: DictConfig, tokenizer, dataset=None, target: FrozenTarget | None = None):
    """Train/val DataModule; with data.feature_cache set, builds (or reuses) the offline feature cache for `target`
    first (dspark.data.feature_cache_build), and the batches then carry the cached features; with data.feature_stream
    the cache is read while a child process writes it (dspark.data.feature_stream) and the first pass over the data
    follows the order the shards are written in."""
    from dspark.data import feature_stream
    from dspark.data.feature_cache_build import cache_wanted, prepare_feature_cache, stream_wanted
    from dspark.training.data_module import ChatDataModule, held_out_count

    if cache_wanted(cfg.data) and target is None:
        raise ValueError("build_datamodule: data.feature_cache needs the target (pass target=)")
    tr = cfg.train
    dataset = dataset if dataset is not None else build_dataset(cfg.data, tokenizer)
    features = prepare_feature_cache(cfg, target, dataset)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    val = held_out_count(cfg.data.val_examples, len(dataset))  # auto -> its count (run.choose_held_out says it)
    # streamed: the first pass follows the producer's shards (whether or not the cache is complete by now)
    groups = feature_stream.first_pass_groups(len(dataset), val, feature_stream.SHARD_SIZE) \
        if stream_wanted(cfg.data) else None
    return ChatDataModule(
        dataset, pad_id=int(pad), batch_size=int(tr.batch_size), num_anchors=int(tr.num_anchors),
        total_batches=int(cfg.trainer.max_steps) * int(cfg.trainer.accumulate_grad_batches),
        val_examples=val, val_batch_size=int(tr.val_batch_size),
        seed=int(cfg.seed), num_workers=int(cfg.data.num_workers), features=features, first_pass_groups=groups,
        group_by_length=bool(cfg.data.group_by_length),
    )


def build_module(cfg: DictConfig, draft, target: FrozenTarget):
    """The LightningModule of the draft family's objective (dspark.training.modules.MODULES), its train.* keys
    parsed by that module's from_config."""
    from dspark.ops.backend import set_ops_backend
    from dspark.training.module import OptimConfig
    from dspark.training.modules import MODULES

    tr = cfg.train
    set_ops_backend(str(cfg.ops_backend))
    optim = OptimConfig(lr=float(tr.lr), weight_decay=float(tr.weight_decay), betas=tuple(tr.betas),
                        warmup_ratio=float(tr.warmup_ratio), min_lr_ratio=float(tr.min_lr_ratio),
                        max_steps=int(cfg.trainer.max_steps))
    module = MODULES[registry.family(str(cfg.draft.kind)).objective].from_config(tr, draft, target, optim)
    # the resolved run config: in every checkpoint (hyper_parameters) and every logger (hparams.yaml, W&B config)
    module.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
    return module
