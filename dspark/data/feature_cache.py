"""Offline target-feature cache: run the frozen target once per example, read the features back in training.

Layout of a cache folder::

    shard-00000.safetensors   examples [0, shard_size): keys "{idx}.aux" [S_i, n*H], "{idx}.final" [S_i, H]
    shard-00001.safetensors   examples [shard_size, 2*shard_size) ...
    meta.json                 written last: target identity, dataset fingerprint, dtype, sizes, and the
                              sha256 + size of every shard (checked: sizes on open, each shard's hash the
                              first time a process reads it)
    progress.json             while a build runs: the cache key and the sha256 + size of every shard complete so
                              far (what a streaming reader, dspark.data.feature_stream, may read); removed once
                              meta.json exists

Indices are positions in the dataset the cache was built from (the full tokenized dataset, before any
train/val split). Every shard is written atomically and carries the cache key in its safetensors header,
so an interrupted build resumes by skipping the shards that are already complete, and a shard left by a
different build is recomputed rather than trusted. A folder is a usable cache only once meta.json exists.
Shards are written in index order unless the build runs inside `production_plan(order, key)` (the feature stream's
producer: the shards holding the held-out tail first).

A cache is tied to (target identity, layer ids, dataset content, dtype); `FeatureCache.check_compatible`
refuses a cache built for anything else, naming what differs.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.errors import IntegrityError
from dspark.integrity import digest_bytes, digest_file
from dspark.io import atomic_write_json, save_safetensors_atomic
from dspark.targets.checkpoint import VOLATILE_CONFIG_KEYS, config_digest
from dspark.targets.hf_target import FrozenTarget

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: meta.json records every shard's sha256 and size
COMPACT_FORMAT_VERSION = 3  # 3: a CacheLayout other than the default (meta.json "layout"); plain caches stay 2
READ_FORMATS = (FORMAT_VERSION, COMPACT_FORMAT_VERSION)
META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
SHARD_SIZE = 256  # examples per shard unless a build says otherwise
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Config entries that do not change what the model computes.


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in CACHE_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"feature cache dtype {dtype} is not one of {sorted(CACHE_DTYPES)}")


# ---- compact layouts -------------------------------------------------------------------------------
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class CacheLayout:
    """How an example's features are stored (what `FeatureCache.get` hands back is always dense [S, .]).

    encoding: "plain" (the cache dtype) | "fp8_e4m3" (float8 e4m3 codes, one float32 scale per row and tapped
      layer: amax / 448).
    teacher_rows: "all" | "assistant": `final` only at positions p whose next token is an assistant token
      (loss_mask[p + 1]), the only teacher rows a block objective reads (its eval mask needs the label in the loss
      mask); other rows read back as zeros.
    context_rows: "all" | "anchored": `aux` only at positions before the last anchor candidate (loss_mask[a] and
      loss_mask[a + 1]): a block's context is the positions before its anchor; the rest read back as zeros.
    Row-dropping layouts are for block objectives only (an MTP chain reads `final` of every context position).
    """

    encoding: str = "plain"
    teacher_rows: str = "all"
    context_rows: str = "all"

    CHOICES = {"encoding": ("plain", "fp8_e4m3"), "teacher_rows": ("all", "assistant"),
               "context_rows": ("all", "anchored")}

    def __post_init__(self):
        for field, allowed in self.CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"feature cache layout: {field}={getattr(self, field)!r} is not one of {allowed}")

    @property
    def is_default(self) -> bool:
        return self == CacheLayout()

    @property
    def drops_rows(self) -> bool:
        return self.teacher_rows != "all" or self.context_rows != "all"

    def as_dict(self) -> dict:
        return {"encoding": self.encoding, "teacher_rows": self.teacher_rows, "context_rows": self.context_rows}

    @classmethod
    def from_dict(cls, d) -> "CacheLayout":
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.CHOICES))
        if unknown:
            raise ValueError(f"feature cache layout: unknown keys {unknown} (known: {sorted(cls.CHOICES)})")
        return cls(**d)


def encode_fp8_rows(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, D] -> (codes [S, D] float8_e4m3fn, scales [S, groups] float32): every row is split into `groups` equal
    segments (one per tapped layer: deeper residual streams are larger) and each segment is divided by its own scale
    amax / 448, so its largest value lands on e4m3's largest finite value. A zero segment gets scale 0 (codes 0)."""
    S, D = x.shape
    if D % groups:
        raise ValueError(f"encode_fp8_rows: {D} columns do not split into {groups} groups")
    xg = x.detach().to(torch.float32).reshape(S, groups, D // groups)
    scale = xg.abs().amax(dim=-1) / E4M3_MAX  # [S, groups]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # clamp: amax / (amax / 448) can round to just above 448, which e4m3fn (no infinity) would turn into NaN
    q = (xg / safe[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(S, D), scale.contiguous()


def decode_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of encode_fp8_rows -> float32 [S, D]."""
    S, D = q.shape
    groups = scale.shape[-1]
    return (q.to(torch.float32).reshape(S, groups, D // groups) * scale[..., None]).reshape(S, D)


def last_anchor(loss_mask: torch.Tensor) -> int:
    """The last anchor candidate (loss_mask[a] and loss_mask[a + 1]), 0 when there is none: a block's context is
    the positions before its anchor, so no context reaches this position or later."""
    lm = torch.as_tensor(loss_mask).bool()
    ok = (lm[:-1] & lm[1:]).nonzero().flatten()
    return int(ok[-1]) if ok.numel() else 0


def teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p whose next token is an assistant token (loss_mask[p + 1]) -> [m] int32."""
    lm = torch.as_tensor(loss_mask).bool()
    return lm[1:].nonzero().flatten().to(torch.int32)


def pack_example(idx: int, aux: torch.Tensor, final: torch.Tensor, loss_mask, layout: CacheLayout,
                 dtype: torch.dtype, n_layers: int) -> dict[str, torch.Tensor]:
    """One example's dense aux [S, n*H] / final [S, H] -> the tensors the layout stores under "{idx}.*"."""
    S = aux.shape[0]
    out: dict[str, torch.Tensor] = {}
    if layout.drops_rows:
        lm = torch.as_tensor(list(loss_mask))
        if lm.numel() != S:
            raise ValueError(f"feature cache: example {idx} has {S} positions but {lm.numel()} loss_mask entries")
        out[f"{idx}.length"] = torch.tensor([S], dtype=torch.int64)
        if layout.context_rows == "anchored":
            aux = aux[: last_anchor(lm)]
        if layout.teacher_rows == "assistant":
            pos = teacher_positions(lm)
            final = final[pos.long()]
            out[f"{idx}.final_pos"] = pos
    for name, x, groups in (("aux", aux, max(1, n_layers)), ("final", final, 1)):
        if layout.encoding == "fp8_e4m3" and x.shape[-1] > 0:
            q, scale = encode_fp8_rows(x, groups)
            out[f"{idx}.{name}"], out[f"{idx}.{name}_scale"] = q.contiguous(), scale
        else:
            out[f"{idx}.{name}"] = x.to(dtype).contiguous()
    return {k: v.contiguous().clone() for k, v in out.items()}  # own storage each (safetensors refuses shared)


def unpack_example(f, idx: int, layout: CacheLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored tensors of example `idx` (an open safetensors shard) -> dense (aux [S, n*H], final [S, H])."""
    def read(name):
        x = f.get_tensor(f"{idx}.{name}")
        if layout.encoding == "fp8_e4m3" and x.dtype == torch.float8_e4m3fn:
            return decode_fp8_rows(x, f.get_tensor(f"{idx}.{name}_scale")).to(dtype)
        return x.to(dtype)

    aux, final = read("aux"), read("final")
    if not layout.drops_rows:
        return aux, final
    S = int(f.get_tensor(f"{idx}.length")[0])
    full_aux = aux.new_zeros(S, aux.shape[-1])
    full_aux[: aux.shape[0]] = aux
    full_final = final.new_zeros(S, final.shape[-1])
    if layout.teacher_rows == "assistant":
        full_final[f.get_tensor(f"{idx}.final_pos").long()] = final
    else:
        full_final[:] = final
    return full_aux, full_final


def read_example(f, idx: int, layout: CacheLayout, stored: torch.dtype,
                 dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Example `idx` of an open shard -> dense (aux [S, n*H], final [S, H]) in `dtype` (None: `stored`)."""
    if not layout.is_default:
        return unpack_example(f, idx, layout, dtype if dtype is not None else stored)
    aux, final = f.get_tensor(f"{idx}.aux"), f.get_tensor(f"{idx}.final")
    if dtype is not None:
        aux, final = aux.to(dtype), final.to(dtype)
    return aux, final


# ---- identities ----------------------------------------------------------------------------------
def _weights_hash(model: torch.nn.Module, samples: int = 64) -> str:
    """Cheap weight fingerprint: name, shape and `samples` evenly strided values of every parameter.

    Catches a retrained target with an unchanged config (same folder, same config.json) without
    hashing gigabytes of weights.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(flat[::step][:samples].to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def target_identity(target: FrozenTarget) -> dict:
    """What makes features reproducible: model name/path, config hash, weight fingerprint, dtype, layer ids. A
    head-only target (dspark.targets.head_only) computes the same identity from its checkpoint files."""
    if hasattr(target, "cache_identity"):
        return target.cache_identity
    cfg = target.model.config
    cfg_dict = {k: v for k, v in cfg.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return {
        "name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
        "config_hash": config_digest(cfg_dict),
        "weights_hash": _weights_hash(target.model),
        "dtype": str(target.embed_weight.dtype).removeprefix("torch."),
        "layer_ids": list(target.layer_ids),
    }


def _input_id_chunks(rows, chunk: int = 4096):
    """Yields (lengths [N] int64, values [sum(lengths)] int64) over the rows' input_ids, in order."""
    import datasets

    if isinstance(rows, datasets.Dataset):
        for tbl in rows.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=chunk):
            col = tbl.column("input_ids").combine_chunks()  # ListArray (respects slices)
            yield (col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64),
                   col.flatten().to_numpy(zero_copy_only=False).astype(np.int64))
        return
    for lo in range(0, len(rows), chunk):
        seqs = [list(rows[i]["input_ids"]) for i in range(lo, min(len(rows), lo + chunk))]
        values = np.fromiter((t for s in seqs for t in s), dtype=np.int64)
        yield np.array([len(s) for s in seqs], dtype=np.int64), values


def dataset_fingerprint(rows) -> dict:
    """Number of rows + a hash of every row's input_ids (independent of how the rows are chunked)."""
    h_len, h_val = hashlib.sha256(), hashlib.sha256()
    for lengths, values in _input_id_chunks(rows):
        h_len.update(lengths.tobytes())
        h_val.update(values.tobytes())
    return {"num_rows": len(rows), "input_ids_hash": config_digest([h_len.hexdigest(), h_val.hexdigest()])}


def cache_key(target_id: dict, dataset_fp: dict, dtype: torch.dtype, layout: CacheLayout | None = None) -> str:
    """Names a cache: hashes the target identity (incl. layer ids), the dataset fingerprint, the dtype and a
    non-default layout (a default-layout cache keeps the key it had before layouts existed)."""
    key = {"v": FORMAT_VERSION, "target": target_id, "dataset": dataset_fp, "dtype": dtype_name(dtype)}
    if layout is not None and not layout.is_default:
        key.update(v=COMPACT_FORMAT_VERSION, layout=layout.as_dict())
    return config_digest(key)


def _differences(meta: dict, target_id: dict | None, dataset_fp: dict | None) -> list[str]:
    """Human-readable mismatches between a cache's meta and the current target / rows."""
    out = []
    if target_id is not None:
        cached = meta["target"]
        if cached["layer_ids"] != target_id["layer_ids"]:
            out.append(f"other layer ids: cache built from target layers {cached['layer_ids']}, "
                       f"this target uses {target_id['layer_ids']}")
        for field in ("name_or_path", "config_hash", "weights_hash", "dtype"):
            if cached[field] != target_id[field]:
                out.append(f"another target: {field} {cached[field]!r} (cache) != {target_id[field]!r} (target)")
    if dataset_fp is not None and meta["dataset"] != dataset_fp:
        c = meta["dataset"]
        out.append(f"another dataset: cache has {c['num_rows']} rows with input_ids hash {c['input_ids_hash']}, "
                   f"these rows are {dataset_fp['num_rows']} with hash {dataset_fp['input_ids_hash']}")
    return out


# ---- build ----------------------------------------------------------------------------------------
def _rows_column(rows, lo: int, hi: int, column: str) -> list[list[int]]:
    import datasets

    if isinstance(rows, datasets.Dataset):
        if column not in rows.column_names:
            raise ValueError(f"feature cache: this layout needs the rows' {column!r} column")
        return rows[lo:hi][column]
    return [list(rows[i][column]) for i in range(lo, hi)]


def shard_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """A shard's examples (positions in it) in batches of `batch_size`, shortest first (ties in order)."""
    order = sorted(range(len(lengths)), key=lambda j: (lengths[j], j))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _rows_input_ids(rows, lo: int, hi: int) -> list[list[int]]:
    import datasets

    if isinstance(rows, datasets.Dataset):
        return rows[lo:hi]["input_ids"]
    return [list(rows[i]["input_ids"]) for i in range(lo, hi)]


def _pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads token lists -> input_ids, attention_mask [B, S_max]."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    am = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        am[i, : len(s)] = 1
    return ids.to(device), am.to(device)


class BuildClock:
    """Says once, after the build's first batch, roughly how long the whole build takes: that batch's seconds per
    token times the tokens of every row still to compute (`tokens`)."""

    def __init__(self, out_dir: Path, tokens: int):
        self.out_dir, self.tokens, self.said = out_dir, int(tokens), False

    def batch_done(self, tokens: int, seconds: float) -> None:
        if self.said or tokens <= 0:
            return
        self.said = True
        log.info("feature cache: about %.0f s to compute %d tokens into %s (its first batch: %d tokens in %.2f s)",
                 seconds / tokens * self.tokens, self.tokens, self.out_dir, tokens, seconds)


def row_tokens(rows) -> int:
    """Tokens of all the rows' input_ids."""
    return int(sum(int(lengths.sum()) for lengths, _ in _input_id_chunks(rows)))


def _shard_tensors(target: FrozenTarget, rows, lo: int, hi: int, batch_size: int,
                   dtype: torch.dtype, clock: BuildClock | None = None) -> dict[str, torch.Tensor]:
    """Features of examples [lo, hi), one padded batch at a time, cut back to each example's length. The batches
    take the shard's examples shortest first (:func:`shard_batches`): padding costs the forward's GEMMs and its
    attention, and rows of similar lengths pad little."""
    tok = target.tokenizer
    pad_id = int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0
    out: dict[str, torch.Tensor] = {}
    shard = _rows_input_ids(rows, lo, hi)
    for batch in shard_batches([len(s) for s in shard], batch_size):
        seqs = [shard[j] for j in batch]
        if any(len(s) == 0 for s in seqs):
            raise ValueError(f"feature cache: an example in rows [{lo}, {hi}) has no input_ids")
        t0 = time.perf_counter()
        ids, am = _pad(seqs, pad_id, target.device)  # [B, S]
        feats = target.features(ids, am)  # aux [B, S, n*H], final [B, S, H]
        if clock is not None:
            clock.batch_done(sum(len(s) for s in seqs), time.perf_counter() - t0)
        for j, s in enumerate(seqs):
            n, idx = len(s), lo + batch[j]
            # copy=True: every example gets its own storage (safetensors refuses shared tensors)
            out[f"{idx}.aux"] = feats.aux[j, :n].detach().to("cpu", dtype, copy=True).contiguous()  # [S_i, n*H]
            out[f"{idx}.final"] = feats.final[j, :n].detach().to("cpu", dtype, copy=True).contiguous()  # [S_i, H]
    return out


def shard_header(path: Path) -> dict | None:
    """The metadata a shard carries in its safetensors header ({"key", "first", "count"}); None if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 (absent, torn or not a safetensors file)
        return None


def header_problem(md: dict | None, key: str, first: int, count: int) -> str | None:
    """Why a shard header is not the one this build writes for examples [first, first + count); None if it is."""
    if md is None:
        return "no readable safetensors header"
    if md.get("key") != key:
        return f"it carries cache key {md.get('key')!r}, this build's is {key!r} (a shard of another build)"
    if md.get("first") != str(first) or md.get("count") != str(count):
        return (f"it holds examples from {md.get('first')!r} ({md.get('count')!r} of them), "
                f"not from {first} ({count})")
    return None


def _shard_complete(path: Path, key: str, first: int, count: int) -> bool:
    """A shard on disk counts as done only if it was written by this build (same key and range)."""
    return path.is_file() and header_problem(shard_header(path), key, first, count) is None


# ---- production order (the feature stream's producer) ------------------------------------------------
@dataclass(frozen=True)
class ProductionPlan:
    order: tuple[int, ...]  # shard indices in the order they are written
    key: str  # the cache key the build must have (a producer computing another one refuses to write)


_PLAN: contextvars.ContextVar[ProductionPlan | None] = contextvars.ContextVar("feature_cache_plan", default=None)


@contextmanager
def production_plan(order, key: str):
    """Every write_feature_cache inside writes its shards in `order` and refuses to build another cache than `key`
    (how a streaming producer runs the ordinary build functions, hf or vllm, unchanged)."""
    token = _PLAN.set(ProductionPlan(tuple(int(k) for k in order), str(key)))
    try:
        yield
    finally:
        _PLAN.reset(token)


def _shard_order(num_shards: int, key: str) -> list[int]:
    """The active production plan's order (checked: a permutation of the shards, the key this build computes);
    index order without one."""
    plan = _PLAN.get()
    if plan is None:
        return list(range(num_shards))
    if plan.key != key:
        raise ValueError(f"feature cache: this producer computes cache key {key}, the reader expects {plan.key} "
                         "(the producer sees another target, rows, dtype or layout than the trainer)")
    if sorted(plan.order) != list(range(num_shards)):
        raise ValueError(f"feature cache: production order {list(plan.order)[:8]}... is not a permutation of the "
                         f"{num_shards} shards")
    return list(plan.order)


def _publish(out_dir: Path, key: str, shard_size: int, num_shards: int, shards: dict) -> None:
    """progress.json: the shards complete so far, with their sha256 + size (written after the shard itself)."""
    atomic_write_json(out_dir / PROGRESS_NAME, {"key": key, "shard_size": shard_size, "num_shards": num_shards,
                                                "shards": shards})


def build_feature_cache(target: FrozenTarget, rows, out_dir, *, batch_size: int = 8,
                        dtype: torch.dtype = torch.bfloat16, shard_size: int = SHARD_SIZE,
                        layout: CacheLayout | None = None) -> Path:
    """Computes target.features for every row (in order) into `out_dir`; resumes an interrupted build.

    rows: datasets.Dataset (or a sequence of dicts) with `input_ids`. Returns out_dir. An existing complete
    cache is reused after checking it was built for this target and these rows (ValueError otherwise).
    """
    if batch_size < 1:
        raise ValueError(f"feature cache: batch_size ({batch_size}) must be >= 1")
    layout = layout or CacheLayout()
    work = torch.float32 if layout.encoding != "plain" else dtype  # fp8 codes are made from the float32 features
    clock = None if (Path(out_dir) / META_NAME).is_file() else BuildClock(Path(out_dir), row_tokens(rows))
    return write_feature_cache(
        target_identity(target), rows, out_dir,
        lambda lo, hi: _shard_tensors(target, rows, lo, hi, batch_size, work, clock),
        dtype=dtype, shard_size=shard_size, hidden_size=int(target.hidden_size), producer="hf", layout=layout)


def write_feature_cache(target_id: dict, rows, out_dir, shard_fn, *, dtype: torch.dtype, shard_size: int,
                        hidden_size: int, producer: str, on_start=None, layout: CacheLayout | None = None) -> Path:
    """The shard loop every feature producer shares: `shard_fn(lo, hi)` -> {"{idx}.aux": [S_i, n*H],
    "{idx}.final": [S_i, H]} (float32, or `dtype`) for rows [lo, hi), stored as `layout` says. Skips the shards a
    previous run of the same build completed (resume), reuses a finished cache after checking it, writes meta.json
    last. `on_start()` runs once before the first shard is computed (e.g. to start an engine), never on a reuse."""
    layout = layout or CacheLayout()
    out_dir = Path(out_dir)
    if shard_size < 1:
        raise ValueError(f"feature cache: shard_size ({shard_size}) must be >= 1")
    if len(rows) == 0:
        raise ValueError("feature cache: no rows to cache")
    dataset_fp = dataset_fingerprint(rows)
    key = cache_key(target_id, dataset_fp, dtype, layout)
    if (out_dir / META_NAME).is_file():
        FeatureCache(out_dir)._check(target_id, dataset_fp, dtype, layout)
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(rows)
    num_shards = math.ceil(n / shard_size)
    t0, done_before, shards, started = time.perf_counter(), 0, {}, False
    published = 0
    for k in _shard_order(num_shards, key):
        lo, hi = k * shard_size, min(n, (k + 1) * shard_size)
        path = out_dir / shard_name(k)
        if _shard_complete(path, key, lo, hi - lo):
            done_before += 1
            shards[path.name] = digest_file(path)
            continue
        if published < len(shards):  # the shards found complete so far, before this one is computed
            _publish(out_dir, key, shard_size, num_shards, shards)
            published = len(shards)
        if not started and on_start is not None:
            on_start()
        started = True
        tensors = shard_fn(lo, hi)
        if not layout.is_default:
            n_layers = len(target_id["layer_ids"])
            masks = _rows_column(rows, lo, hi, "loss_mask") if layout.drops_rows else [None] * (hi - lo)
            tensors = {k: v for i in range(lo, hi) for k, v in pack_example(
                i, tensors[f"{i}.aux"], tensors[f"{i}.final"], masks[i - lo], layout, dtype, n_layers).items()}
        else:
            tensors = {k: v if v.dtype == dtype else v.to(dtype) for k, v in tensors.items()}
        data = save_safetensors_atomic(tensors, path, metadata={"key": key, "first": str(lo), "count": str(hi - lo)})
        shards[path.name] = digest_bytes(data)
        _publish(out_dir, key, shard_size, num_shards, shards)
        published = len(shards)
        log.info("feature cache %s: shard %d/%d written (%s)", out_dir, k + 1, num_shards, producer)
    if done_before:
        log.info("feature cache %s: resumed, %d of %d shards were already complete", out_dir, done_before, num_shards)
    meta = {
        "format": FORMAT_VERSION if layout.is_default else COMPACT_FORMAT_VERSION, "key": key, "target": target_id, "dataset": dataset_fp,
        "dtype": dtype_name(dtype), "hidden_size": int(hidden_size),
        "aux_size": int(hidden_size) * len(target_id["layer_ids"]), "num_examples": n,
        "shard_size": shard_size, "num_shards": num_shards,
        "bytes": sum(d["size"] for d in shards.values()), "shards": shards,
        "build_seconds": round(time.perf_counter() - t0, 3), "producer": producer,
    }
    if not layout.is_default:
        meta["layout"] = layout.as_dict()
    atomic_write_json(out_dir / META_NAME, meta)
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)  # meta.json lists every shard now
    return out_dir


def convert_feature_cache(src, rows, out_dir, *, layout: CacheLayout, dtype: torch.dtype | None = None,
                          shard_size: int | None = None) -> Path:
    """Re-stores a built cache under another layout / dtype without running the target: the float32 features read
    back from `src` (exact for a float32 source) are packed as a build would pack them. `rows` are the rows `src`
    was built from (their loss_mask for row-dropping layouts). Resumable and reused like a build."""
    src = FeatureCache(src)
    if not src.layout.is_default:
        raise ValueError(f"feature cache {src.path}: convert from a plain cache (this one has {src.layout.as_dict()})")
    src._check(None, dataset_fingerprint(rows), None)
    dtype = dtype or src.dtype

    def shard(lo: int, hi: int) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(lo, hi):
            out[f"{i}.aux"], out[f"{i}.final"] = src.get(i, dtype=torch.float32)
        return out

    return write_feature_cache(src.meta["target"], rows, out_dir, shard, dtype=dtype,
                               shard_size=shard_size or int(src.meta["shard_size"]),
                               hidden_size=src.hidden_size, producer=f"{src.meta.get('producer', 'hf')}+convert",
                               layout=layout)


# ---- read -----------------------------------------------------------------------------------------
class RowSubsetCache:
    """A FeatureCache built from some rows of a dataset (a short run's: dspark.training.data_plan.cached_rows), read
    by dataset index like a cache of the whole dataset: `rows` are the dataset indices it holds, ascending (its
    example i is dataset row rows[i]); len() is the dataset's. A row it does not hold is refused, naming it."""

    def __init__(self, cache: "FeatureCache", rows, num_rows: int):
        self.cache, self.rows, self.num_rows = cache, [int(r) for r in rows], int(num_rows)
        if len(self.rows) != len(cache):
            raise ValueError(f"feature cache {cache.path}: holds {len(cache)} examples, {len(self.rows)} rows asked")
        self._position = {r: i for i, r in enumerate(self.rows)}

    def __len__(self) -> int:
        return self.num_rows

    def __getattr__(self, name):  # path, meta, nbytes, dtype, layout, hidden_size, ...: the cache's
        if name in ("cache", "_position"):
            raise AttributeError(name)
        return getattr(self.cache, name)

    def get(self, idx: int, dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        position = self._position.get(int(idx))
        if position is None:
            raise ValueError(f"feature cache {self.cache.path}: dataset row {idx} is not in it (it holds the "
                             f"{len(self.rows)} rows this run's steps read and the held-out ones; a run on more "
                             "ranks or steps than planned?): set data.feature_cache to a folder to cache every row")
        return self.cache.get(position, dtype=dtype)


class FeatureCache:
    """Read side of a built cache: `get(idx)` -> (aux [S_i, n*H], final [S_i, H]), loaded lazily per example.

    Shards are opened with safetensors' safe_open (memory-mapped) and kept in a small LRU. Picklable
    (open handles are dropped), so DataLoader workers each open their own.
    """

    _REQUIRED = ("format", "key", "target", "dataset", "dtype", "hidden_size", "aux_size", "num_examples",
                 "shard_size", "num_shards", "shards")

    def __init__(self, path, max_open_shards: int = 4):
        self.path = Path(path)
        meta_path = self.path / META_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"no feature cache at {self.path}: {META_NAME} is missing "
                                    "(an unfinished build? run build_feature_cache again to resume it)")
        self.meta = json.loads(meta_path.read_text())
        self._validate_meta()
        self.dtype = CACHE_DTYPES[self.meta["dtype"]]
        self.layout = CacheLayout.from_dict(self.meta.get("layout"))
        self.max_open_shards = max(1, int(max_open_shards))
        self._open: OrderedDict[int, object] = OrderedDict()
        self._verified: set[int] = set()  # shards whose sha256 this process has checked

    def _repair_hint(self, k: int) -> str:
        return (f"delete {self.path / shard_name(k)} and {self.path / META_NAME} and rerun: the build resumes and "
                "recomputes only that shard")

    def _validate_meta(self) -> None:
        m = self.meta
        missing = [k for k in self._REQUIRED if k not in m]
        if missing:
            raise ValueError(f"feature cache {self.path}: {META_NAME} lacks {missing}")
        if m["format"] not in READ_FORMATS:
            raise ValueError(f"feature cache {self.path}: format {m['format']}, this code reads {READ_FORMATS}; "
                             "rebuild it")
        if m["dtype"] not in CACHE_DTYPES:
            raise ValueError(f"feature cache {self.path}: unknown dtype {m['dtype']!r}")
        absent = [shard_name(k) for k in range(m["num_shards"]) if not (self.path / shard_name(k)).is_file()]
        if absent:
            raise ValueError(f"feature cache {self.path}: shard files missing: {absent[:3]}")
        for k in range(m["num_shards"]):  # sizes now (cheap); each shard's sha256 when it is first read
            size, expected = (self.path / shard_name(k)).stat().st_size, m["shards"][shard_name(k)]["size"]
            if size != expected:
                raise IntegrityError(f"{self.path / shard_name(k)}: {'truncated' if size < expected else 'grown'} "
                                     f"({size} bytes, meta.json says {expected}); {self._repair_hint(k)}")

    def __len__(self) -> int:
        return int(self.meta["num_examples"])

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def aux_size(self) -> int:
        return int(self.meta["aux_size"])

    @property
    def nbytes(self) -> int:
        return int(self.meta["bytes"])

    def _shard(self, k: int):
        from safetensors import safe_open

        f = self._open.get(k)
        if f is None:
            if k not in self._verified:
                path = self.path / shard_name(k)
                if digest_file(path)["sha256"] != self.meta["shards"][path.name]["sha256"]:
                    raise IntegrityError(f"{path}: content altered (sha256 does not match meta.json); "
                                         f"{self._repair_hint(k)}")
                self._verified.add(k)
            f = safe_open(str(self.path / shard_name(k)), framework="pt")
            self._open[k] = f
            while len(self._open) > self.max_open_shards:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(k)
        return f

    def get(self, idx: int, dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Example `idx` of the original dataset -> (aux [S_i, n*H], final [S_i, H]) in `dtype`
        (None: the cache's stored dtype)."""
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"feature cache {self.path}: index {idx} outside [0, {len(self)})")
        return read_example(self._shard(idx // int(self.meta["shard_size"])), idx, self.layout, self.dtype, dtype)

    def check_compatible(self, target: FrozenTarget, rows) -> None:
        """Raises ValueError naming each difference if this cache was not built for `target` and `rows`."""
        self._check(target_identity(target), dataset_fingerprint(rows), None)

    def _check(self, target_id: dict, dataset_fp: dict, dtype: torch.dtype | None,
               layout: CacheLayout | None = None) -> None:
        problems = _differences(self.meta, target_id, dataset_fp)
        if dtype is not None and self.meta["dtype"] != dtype_name(dtype):
            problems.append(f"another dtype: cache stores {self.meta['dtype']}, {dtype_name(dtype)} was asked for")
        if layout is not None and self.layout != layout:
            problems.append(f"another layout: cache has {self.layout.as_dict()}, {layout.as_dict()} was asked for")
        if problems:
            raise ValueError(f"feature cache {self.path} cannot be used: " + "; ".join(problems)
                             + ". Delete the folder to rebuild it, or use another directory.")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["_verified"] = set()  # each process checks the shards it reads
        return state
