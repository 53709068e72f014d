"""Every check of a training config that needs no model weights, run before anything heavy loads: a bad value
fails in about a second with one line naming the key, not after the target has loaded."""
from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dspark.errors import ConfigError
from dspark.factory import DATA_SOURCES, drafts_per_step, require, target_folder, training_steps
from dspark.models import registry

_POSITIVE_INTS = ("batch_size", "val_batch_size", "num_anchors")


def _number(node: DictConfig, key: str, prefix: str) -> float:
    value = node.get(key)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{prefix}.{key}: must be a number, got {value!r}") from None
    require(math.isfinite(x), f"{prefix}.{key}", f"must be finite, got {value!r}")
    return x


def check_train(cfg: DictConfig) -> None:
    tr = cfg.train
    for key in _POSITIVE_INTS:
        if key in tr:
            require(_number(tr, key, "train") >= 1 and float(tr[key]).is_integer(), f"train.{key}",
                    f"must be an integer >= 1, got {tr[key]!r}")
    require(_number(tr, "lr", "train") > 0, "train.lr", f"must be > 0, got {tr.lr!r}")
    require(_number(tr, "weight_decay", "train") >= 0, "train.weight_decay", f"must be >= 0, got {tr.weight_decay!r}")
    betas = list(tr.betas)
    require(len(betas) == 2 and all(0 <= float(b) < 1 for b in betas), "train.betas",
            f"must be two numbers in [0, 1), got {betas}")
    for key in ("warmup_ratio", "min_lr_ratio"):
        require(0 <= _number(tr, key, "train") <= 1, f"train.{key}", f"must be in [0, 1], got {tr[key]!r}")
    require(_number(tr, "decay_gamma", "train") > 0, "train.decay_gamma", f"must be > 0, got {tr.decay_gamma!r}")
    weights = OmegaConf.to_container(tr.loss_weights, resolve=True)
    unknown = sorted(set(weights) - {"ce", "l1", "conf"})
    require(not unknown, "train.loss_weights", f"unknown keys {unknown} (ce, l1, conf)")
    require(all(float(v) >= 0 for v in weights.values()) and sum(map(float, weights.values())) > 0,
            "train.loss_weights", f"weights must be >= 0 and not all 0, got {weights}")
    max_length = int(_number(cfg.data, "max_length", "data"))
    require(int(tr.num_anchors) < max_length, "train.num_anchors",
            f"{tr.num_anchors} anchors cannot fit in a sequence of data.max_length={max_length} (an anchor a needs "
            f"a loss-masked token a+1): use fewer than {max_length}")


def check_trainer(cfg: DictConfig) -> None:
    """The Trainer keys the run depends on (the rest Lightning checks when the Trainer is built)."""
    training_steps(cfg)
    acc = cfg.trainer.get("accumulate_grad_batches")
    require(isinstance(acc, int) and acc >= 1, "trainer.accumulate_grad_batches", f"must be an int >= 1, got {acc!r}")
    require(not cfg.trainer.get("use_distributed_sampler"), "trainer.use_distributed_sampler",
            "must stay false: ChatDataModule shards, shuffles and resumes its own batches")


def check_data(cfg: DictConfig) -> None:
    data = cfg.data
    require(data.source in DATA_SOURCES, "data.source", f"{data.source!r} is not one of {DATA_SOURCES}")
    depth_key, _ = drafts_per_step(cfg)
    depth = int(_number(cfg.draft, depth_key, "draft"))
    require(int(_number(data, "max_length", "data")) > depth + 1, "data.max_length",
            f"{data.max_length} is too short for draft.{depth_key} {depth}")
    require(int(_number(data, "val_examples", "data")) >= 1, "data.val_examples",
            f"must be >= 1 (the held-out metrics need examples), got {data.val_examples!r}")
    require(int(_number(data, "min_loss_tokens", "data")) >= 0, "data.min_loss_tokens",
            f"must be >= 0, got {data.min_loss_tokens!r}")
    if data.limit is not None:
        require(int(_number(data, "limit", "data")) >= 1, "data.limit", f"must be >= 1 or null, got {data.limit!r}")
    if data.source != "sharegpt":
        require(data.path is not None and Path(str(data.path)).is_file(), "data.path",
                f"{data.path!r} is not a file")
        if data.strict:  # refuse a malformed line now, naming it, not after the target has loaded
            from itertools import islice

            from dspark.data.jsonl import iter_jsonl_records

            limit = None if data.limit is None else int(data.limit)
            for _ in islice(iter_jsonl_records(str(data.path), strict=True), limit):
                pass
    if data.get("feature_cache") not in (None, "", False):
        from dspark.factory import FEATURE_PRODUCERS, cache_layout

        producer = str(data.get("feature_producer", "hf"))
        require(producer in FEATURE_PRODUCERS, "data.feature_producer",
                f"{producer!r} is not one of {FEATURE_PRODUCERS}")
        cache_layout(cfg)  # the layout's values, and row-dropping layouts only for block objectives


def _target_hf_config(cfg: DictConfig):
    """The target's HF config from its local folder (no weights), or None when the target is not a local
    folder (a Hub id: the loader decides)."""
    folder = target_folder(cfg)
    if not Path(folder).is_dir():
        local = folder.startswith(("/", ".", "~")) or Path(folder).exists()
        require(not local, "target.path", f"{folder!r} is not a folder")
        from dspark.targets.hf_target import resolve_target_source

        try:  # a Hub id: refused now when HF_HUB_OFFLINE is set and the cache lacks it
            resolve_target_source(folder)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e
        return None  # the loader resolves it
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"target.path: {folder!r} holds no readable config.json ({e})") from e


def _tokenizer(cfg: DictConfig):
    """The target folder's tokenizer (no weights): a null draft.mask_token_id is its <|mask|> token."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_folder(cfg), local_files_only=True)
    except (OSError, ValueError):
        return None


def check_draft(cfg: DictConfig) -> None:
    """The draft group built into its family's config against the target's config.json (dspark.models.registry)."""
    registry.family(str(cfg.draft.kind))  # draft.kind first, even for a target this check cannot read
    hf_config = _target_hf_config(cfg)
    if hf_config is None:
        return
    tokenizer = _tokenizer(cfg) if cfg.draft.get("mask_token_id", 0) is None else None
    registry.build_config(cfg.draft, hf_config, tokenizer)


def check_training_config(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad key; loads no model weights."""
    check_train(cfg)
    check_trainer(cfg)
    check_data(cfg)
    check_draft(cfg)
