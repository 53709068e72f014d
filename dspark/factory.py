"""Builds the pieces training, eval and export share, each from the config sections it reads (checked by
dspark.schema / dspark.preflight before any model loads): the target (the target section, the draft and how the target
loads), the draft (a run's resolved Config, or a draft group eval / export read back), the training rows (the data
section). The training pieces (DataModule, LightningModule) are dspark.training.build's."""
from __future__ import annotations

import copy
import dataclasses
import logging
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Mapping

import torch

from dspark.data.dataset import cached_chat_dataset
from dspark.data.feature_cache_build import WHOLE_TARGET, TargetLoading, tap_layers
from dspark.data.jsonl import iter_jsonl_records
from dspark.data.sharegpt import iter_sharegpt
from dspark.errors import ConfigError  # noqa: F401  (re-exported for callers that catch it from here)
from dspark.models import registry
from dspark.schema import DataKeys, DraftStartKeys, TargetKeys, plain
from dspark.targets.head_only import HeadOnlyTarget, HeadOnlyUnsupported, load_head_only_target
from dspark.targets.hf_target import FrozenTarget, load_hf_target
from dspark.targets.source import target_folder

log = logging.getLogger("dspark.factory")


def _group(draft) -> dict | None:
    """A draft group (Hydra's DictConfig or a mapping: eval's draft_config.json, export's config, a test's cfg.draft) as
    plain values; None for a resolved family Config (a run's `run.draft`)."""
    return None if dataclasses.is_dataclass(draft) else plain(draft)


def build_target(target: TargetKeys, draft, loading: TargetLoading = WHOLE_TARGET) -> FrozenTarget:
    """The frozen target of the target section, capturing the layers the draft reads (`target_layer_ids`; MTP drafts
    read none). `draft`: the run's resolved Config (run.draft) or a draft group. `loading`
    (feature_cache_build.target_loading: whether training runs the target's layers) may make it head-only (embedding,
    LM head, final norm: dspark.targets.head_only, plus the target modules draft.init_from_target copies when the
    draft family names them); a checkpoint head_only cannot map exactly loads whole, logged."""
    group = _group(draft)
    layer_ids = tap_layers(draft if group is None else group)
    folder, dtype, aux = target_folder(target), str(target.dtype), bool(layer_ids)
    if loading.head_only:
        also = partial(_init_reads, draft, group) if loading.init_reads else None
        try:
            frozen = load_head_only_target(folder, layer_ids, dtype, require_aux=aux, cache_identity=loading.identity,
                                           also=also)
        except HeadOnlyUnsupported as e:
            log.warning("%s, but the target cannot load head-only (%s): it loads whole", loading.why, e)
        else:
            log.info("%s (%s): %s", loading.why, loading.path, _head_only_line(frozen))
            return frozen
    return load_hf_target(folder, layer_ids, dtype, require_aux=aux)


def _init_reads(config, group: dict | None, model: torch.nn.Module, tokenizer) -> list[str]:
    """The target modules draft.init_from_target copies (registry.init_reads), read from the (meta-device) model;
    a draft group is built into its config against that model's config first."""
    if group is None:
        return registry.init_reads(config, model)
    if not group.get("init_from_target", False):
        return []
    return registry.init_reads(registry.build_config(group, model.config, tokenizer), model)


def _head_only_line(target: HeadOnlyTarget) -> str:
    """What a head-only target read, for the log."""
    ckpt = target.checkpoint
    size = f"{ckpt.bytes_read / 2**20:.1f} MB of the checkpoint's {ckpt.nbytes / 2**20:.1f} MB"
    if not target.init_modules:
        return f"target head only (embedding, LM head, final norm: {size})"
    return (f"target head only + what draft.init_from_target copies (embedding, LM head, final norm, "
            f"{', '.join(target.init_modules)}: {size})")


def build_draft(draft, target: FrozenTarget, start: DraftStartKeys | None = None) -> torch.nn.Module:
    """The draft, built by its family against the loaded target (dspark.models.registry.build_draft), in its fresh
    initialisation or started from the target's layers (draft.init_from_target). `draft`: a run's resolved Config
    (run.draft, with `start` = run.draft_start), built as it is and never changed (a family that rewrote its config
    while building is refused); or a draft group (eval / export rebuilding a trained draft from draft_config.json, a
    test), built into its config against the target here. A new run's warm start from trained weights
    (`draft.init_from`) is training.run's: a trained draft rebuilt by eval or export never reads where its run
    started."""
    group = _group(draft)
    if group is None:
        config, init = draft, (start or DraftStartKeys()).init_from_target
        before = copy.deepcopy(config)
    else:
        config = registry.build_config(group, target.model.config, target.tokenizer)
        registry.check_init_from_target(group)
        init = bool(group.get("init_from_target", False))
    built = registry.build_draft(config, target, init_from_target=init)
    if group is None and built.config != before:
        raise RuntimeError(f"{type(built).__name__} changed its config while building ({before} -> {built.config}): "
                           "a run's draft config is final when the run starts (dspark.draft_resolve)")
    if isinstance(target, HeadOnlyTarget):
        target.release_init_modules()  # copied into the draft: training reads only the head
    return built


def resolved_group(draft: torch.nn.Module, group: Mapping[str, Any]) -> dict[str, Any]:
    """The draft group as the built draft resolved it (the target's sizes under arch, the mask id, ...)."""
    group = plain(group)
    return registry.resolved_group(draft.config, str(group["kind"]), group)


def load_records(data: DataKeys):
    """A zero-argument callable yielding conversation records (only called on a cache miss). Malformed jsonl lines
    are skipped and counted unless data.strict, which refuses the file at the first bad line, naming it."""
    limit = None if data.limit is None else int(data.limit)
    if data.source == "sharegpt":
        return lambda: iter_sharegpt(data.path, limit=limit, english_only=bool(data.english_only))
    return lambda: islice(iter_jsonl_records(str(data.path), strict=bool(data.strict)), limit)


def build_dataset(data: DataKeys, tokenizer):
    """The tokenized chat rows of the data section (cached by its source, limit and length settings)."""
    source = f"{data.source}:{data.path}:{data.limit}:en={data.english_only}:strict={data.strict}"
    if data.path is not None and Path(str(data.path)).is_file():  # a changed file is a new cache entry
        st = Path(str(data.path)).stat()
        source += f":{st.st_size}:{st.st_mtime_ns}"
    return cached_chat_dataset(source, load_records(data), tokenizer, int(data.max_length),
                               min_loss_tokens=int(data.min_loss_tokens))
