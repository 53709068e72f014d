"""The run's offline feature cache (data.feature_cache): where it lives, who builds it (hf: the loaded FrozenTarget;
vllm: vLLM in its own venv), and the build as a job of its own before training. The config keys are checked by
dspark.schema / dspark.preflight before anything here runs."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dspark.errors import ConfigError
from dspark.targets.source import local_model_folder, target_folder

log = logging.getLogger("dspark.feature_cache")


def cache_wanted(cfg: DictConfig) -> bool:
    return cfg.data.feature_cache not in (None, "", False)


def cache_layout(cfg: DictConfig):
    """data.feature_cache_layout -> CacheLayout (encoding, teacher_rows, context_rows)."""
    from dspark.data.feature_cache import CacheLayout

    try:
        return CacheLayout.from_dict(OmegaConf.to_container(cfg.data.feature_cache_layout, resolve=True))
    except ValueError as e:
        raise ConfigError(f"data.feature_cache_layout: {e}") from e


def cache_dtype(cfg: DictConfig) -> torch.dtype:
    from dspark.data.feature_cache import CACHE_DTYPES

    return CACHE_DTYPES[str(cfg.data.feature_cache_dtype)]


def feature_cache_dir(cfg: DictConfig, target, dataset) -> Path | None:
    """data.feature_cache: null -> None; auto -> <DSPARK_CACHE or ~/.cache/dspark>/features/<key>; else a folder."""
    from dspark.data.feature_cache import cache_key, dataset_fingerprint, target_identity

    if not cache_wanted(cfg):
        return None
    where = str(cfg.data.feature_cache)
    if where != "auto":
        return Path(where).expanduser()
    from dspark.data.dataset import default_cache_dir

    key = cache_key(target_identity(target), dataset_fingerprint(dataset), cache_dtype(cfg), cache_layout(cfg))
    return default_cache_dir() / "features" / key


def _local_rank() -> int:
    """This process's rank on its node (torchrun / Lightning's DDP launcher / SLURM); 0 when alone."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _build_device(cfg: DictConfig, target) -> torch.device:
    """The build runs on this rank's GPU when the trainer uses one, else where the target already is."""
    accel = str(cfg.trainer.accelerator)
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


def vllm_producer_settings(cfg: DictConfig) -> dict:
    """data.vllm_producer -> build_feature_cache_vllm's engine keywords."""
    opts = cfg.data.vllm_producer
    return {"batch_size": int(opts.batch_size), "tensor_parallel_size": int(opts.tensor_parallel_size),
            "python": opts.python, "kv_cache_gib": int(opts.kv_cache_gib)}


def _build_with_vllm(cfg: DictConfig, target, dataset, path: Path, layout) -> Path:
    """data.feature_producer=vllm: the cache computed by vLLM (its own venv, dspark.data.vllm_features)."""
    from dspark.data.vllm_features import build_feature_cache_vllm

    name_or_path = str(getattr(target.model.config, "_name_or_path", "") or "")
    return build_feature_cache_vllm(
        local_model_folder(name_or_path), list(target.layer_ids), dataset, path,
        target_dtype=str(target.embed_weight.dtype).removeprefix("torch."), dtype=cache_dtype(cfg),
        name_or_path=name_or_path, layout=layout, **vllm_producer_settings(cfg))


def build_feature_cache_offline(cfg: DictConfig, dataset_builder) -> Path:
    """data.feature_producer=vllm as a job of its own (scripts/build_feature_cache.py, after dspark.preflight), without
    loading the target in this process: the rows as train.py builds them (`dataset_builder(cfg, tokenizer)`), the
    cache where train.py looks for it (`auto`: the same key, the identity computed from the checkpoint)."""
    from transformers import AutoTokenizer

    from dspark.data.dataset import default_cache_dir
    from dspark.data.feature_cache import cache_key, dataset_fingerprint
    from dspark.data.vllm_features import build_feature_cache_vllm, checkpoint_identity
    from dspark.targets.hf_target import resolve_target_source

    if not cache_wanted(cfg):
        raise ConfigError("data.feature_cache: set it (auto or a folder): there is no cache to build")
    if str(cfg.data.feature_producer) != "vllm":
        raise ConfigError("data.feature_producer: building a cache without training is for the vllm producer "
                          "(the hf producer builds it in train.py)")
    source = resolve_target_source(target_folder(cfg))
    folder = local_model_folder(source)
    layer_ids = [int(i) for i in (cfg.draft.get("target_layer_ids") or [])]
    dtype, layout = cache_dtype(cfg), cache_layout(cfg)
    dataset = dataset_builder(cfg, AutoTokenizer.from_pretrained(source))
    where = str(cfg.data.feature_cache)
    if where == "auto":
        ident = checkpoint_identity(folder, layer_ids, str(cfg.target.dtype), name_or_path=source)
        path = default_cache_dir() / "features" / cache_key(ident, dataset_fingerprint(dataset), dtype, layout)
    else:
        path = Path(where).expanduser()
    return build_feature_cache_vllm(folder, layer_ids, dataset, path, target_dtype=str(cfg.target.dtype), dtype=dtype,
                                    name_or_path=source, layout=layout, **vllm_producer_settings(cfg))


def prepare_feature_cache(cfg: DictConfig, target, dataset):
    """Builds (local rank 0; a resumed build skips finished shards) or reuses the feature cache, checks that it
    belongs to this target and dataset, and returns it (None when data.feature_cache is null).

    Local rank 0 of every node builds and the other ranks wait for meta.json: correct on node-local disks, and on a
    shared filesystem concurrent builders write identical shards atomically.
    """
    if not cache_wanted(cfg):
        return None
    from dspark.data.feature_cache import META_NAME, FeatureCache, build_feature_cache

    layout, producer = cache_layout(cfg), str(cfg.data.feature_producer)
    path = feature_cache_dir(cfg, target, dataset)
    reused = (path / META_NAME).is_file()
    t0 = time.perf_counter()
    try:
        if _local_rank() == 0:  # builds, or checks an existing cache against this target and dataset
            if producer == "vllm":
                _build_with_vllm(cfg, target, dataset, path, layout)
            else:
                home, device = target.device, _build_device(cfg, target)
                target.to(device)
                try:
                    build_feature_cache(target, dataset, path, batch_size=int(cfg.train.val_batch_size),
                                        dtype=cache_dtype(cfg), layout=layout)
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
