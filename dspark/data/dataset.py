"""Tokenized chat datasets (docs/CONTRACTS.md rows: input_ids, loss_mask) and their disk cache.

``build_chat_dataset`` renders conversation records with :func:`dspark.data.chat.render_with_loss_mask`
and keeps the examples with enough trainable tokens. ``cached_chat_dataset`` does the same once
per (source, tokenizer, max_length, min_loss_tokens) and reloads the saved ``datasets.Dataset``
afterwards. Cache root: ``cache_dir`` argument, else ``$DSPARK_CACHE``, else ``~/.cache/dspark``;
datasets live under ``<root>/chat_datasets/<source>-<key>/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets

from dspark.data.chat import ChatTemplateError, render_with_loss_mask
from dspark.errors import ConfigError
from dspark.io import default_cache_dir

logger = logging.getLogger(__name__)

# Bump when the tokenization / masking rules change, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1
DEFAULT_MIN_LOSS_TOKENS = 8


@dataclass
class ChatDatasetStats:
    """Counts from :func:`build_chat_dataset`."""

    records: int = 0
    kept: int = 0
    dropped_few_loss_tokens: int = 0  # fewer than min_loss_tokens assistant tokens after truncation
    dropped_render_errors: int = 0  # malformed messages or a template the mask cannot follow
    loss_tokens: int = 0
    tokens: int = 0


def build_chat_dataset(
    records: Iterable[dict],
    tokenizer,
    max_length: int,
    min_loss_tokens: int = DEFAULT_MIN_LOSS_TOKENS,
    *,
    chat_template_kwargs: dict | None = None,
    stats: ChatDatasetStats | None = None,
) -> datasets.Dataset:
    """Tokenize conversation records into a Dataset with columns ``input_ids``, ``loss_mask`` (int64 lists).

    Examples are truncated to ``max_length`` tokens; those left with fewer than ``min_loss_tokens``
    trainable (assistant) tokens are dropped, as are records whose messages are malformed or whose
    template output cannot be masked; both are counted in ``stats`` and logged.
    """
    stats = stats if stats is not None else ChatDatasetStats()
    if min_loss_tokens < 1:
        raise ValueError(f"min_loss_tokens must be >= 1, got {min_loss_tokens}")
    columns: dict[str, list] = {"input_ids": [], "loss_mask": []}
    for record in records:
        stats.records += 1
        try:
            ids, mask = render_with_loss_mask(
                record["messages"], tokenizer, max_length, chat_template_kwargs=chat_template_kwargs
            )
        except (ChatTemplateError, ValueError, KeyError, TypeError) as exc:
            stats.dropped_render_errors += 1
            logger.debug("record %s not rendered: %s", record.get("id") if isinstance(record, dict) else "?", exc)
            continue
        n_loss = sum(mask)
        if n_loss < min_loss_tokens:
            stats.dropped_few_loss_tokens += 1
            continue
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        stats.kept += 1
        stats.loss_tokens += n_loss
        stats.tokens += len(ids)
    logger.info("chat dataset: %s", stats)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
        }
    )
    return datasets.Dataset.from_dict(columns, features=features)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything in the tokenizer that changes tokens: vocab/merges/normalizers + chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def cache_key(
    source_name: str,
    tokenizer,
    max_length: int,
    min_loss_tokens: int,
    chat_template_kwargs: dict | None = None,
) -> str:
    """Directory name for a cached dataset: readable source name + hash of all inputs."""
    payload = json.dumps(
        {
            "v": CACHE_FORMAT_VERSION,
            "source": source_name,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "max_length": max_length,
            "min_loss_tokens": min_loss_tokens,
            "chat_template_kwargs": chat_template_kwargs or {},
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", source_name).strip("_")[:64] or "source"
    return f"{safe}-{digest}"


def cached_chat_dataset(
    source_name: str,
    records_fn: Callable[[], Iterable[dict]],
    tokenizer,
    max_length: int,
    cache_dir: str | os.PathLike | None = None,
    *,
    min_loss_tokens: int = DEFAULT_MIN_LOSS_TOKENS,
    chat_template_kwargs: dict | None = None,
) -> datasets.Dataset:
    """Load the tokenized dataset for ``source_name`` from the cache, or build and save it.

    ``source_name`` must identify the records (e.g. ``"sharegpt-en-2000"``): the cache key hashes
    it with the tokenizer fingerprint, ``max_length``, ``min_loss_tokens`` and the template kwargs,
    never the records themselves, so change the name when the records change. ``records_fn`` is
    only called on a cache miss. The dataset is written to a temporary folder and renamed into
    place, so an interrupted build never leaves a half-written cache entry.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / "chat_datasets" / cache_key(source_name, tokenizer, max_length, min_loss_tokens,
                                              chat_template_kwargs)
    if (path / "dspark_meta.json").is_file():
        logger.info("chat dataset cache hit: %s", path)
        return datasets.load_from_disk(str(path))
    stats = ChatDatasetStats()
    ds = build_chat_dataset(records_fn(), tokenizer, max_length, min_loss_tokens,
                            chat_template_kwargs=chat_template_kwargs, stats=stats)
    if len(ds) == 0:  # never cached: a later run with the same key would silently train on nothing
        raise ConfigError(f"data: {source_name.split(':')[0]} yielded 0 usable conversations ({stats.records} read, "
                          f"{stats.dropped_few_loss_tokens} with fewer than {min_loss_tokens} answer tokens within "
                          f"data.max_length={max_length}, {stats.dropped_render_errors} that the chat template could "
                          "not render); nothing to train on")
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    ds.save_to_disk(str(tmp))
    meta = {"source": source_name, "max_length": max_length, "min_loss_tokens": min_loss_tokens,
            "tokenizer": getattr(tokenizer, "name_or_path", ""), "stats": asdict(stats)}
    (tmp / "dspark_meta.json").write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(path)
    except OSError:  # another process finished the same entry first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "dspark_meta.json").is_file():
            raise
    logger.info("chat dataset cached: %s (%s)", path, stats)
    return datasets.load_from_disk(str(path))
