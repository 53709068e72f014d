"""A target's safetensors checkpoint read without loading the model: tensors by stored name (CheckpointReader,
memory-mapped), the same tensors seen through the model's state-dict names as transformers' loader would build them
(TargetCheckpoint: renamings and the stacking / concatenating / transposing converters), and the target identity
computed from those reads (checkpoint_identity, equal to dspark.data.feature_cache.target_identity of the loaded
model). Read by the head-only target (dspark.targets.head_only) and the vLLM feature producer
(dspark.serving.vllm_features); it imports neither."""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark.targets import register_v41

# config keys that do not change what a target computes (left out of its config hash)
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")


def config_digest(obj) -> str:
    """16 hex digits of the sha256 of a JSON-able object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class HeadOnlyUnsupported(ValueError):
    """This checkpoint cannot be loaded head-only (the reason names the entry); load the whole target instead."""


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


# ---- checkpoint reading without loading the model ------------------------------------------------
class CheckpointReader:
    """Tensors of an HF safetensors checkpoint folder by name (single file or sharded with an index), memory-mapped."""

    def __init__(self, folder):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").is_file():
            files = None
        else:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors or model.safetensors.index.json")
        self._headers: dict[str, tuple[dict, int]] = {}
        self.where: dict[str, str] = {}
        for fname in (sorted(set(files.values())) if files else ["model.safetensors"]):
            header, start = self._header(fname)
            for name in header:
                if name != "__metadata__":
                    self.where[name] = fname

    def _header(self, fname: str) -> tuple[dict, int]:
        if fname not in self._headers:
            with open(self.folder / fname, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._headers[fname] = (json.loads(fh.read(n)), 8 + n)
        return self._headers[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _flat(self, name: str) -> tuple[np.ndarray, str]:
        fname = self.where[name]
        header, start = self._header(fname)
        info = header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.folder / fname}: tensor {name} has dtype {info['dtype']}, which this reader "
                             f"does not decode ({sorted(_ST_DTYPES)})")
        lo, hi = info["data_offsets"]
        dt = np.dtype(_ST_DTYPES[info["dtype"]])
        count = (hi - lo) // dt.itemsize
        mm = np.memmap(self.folder / fname, dtype=dt, mode="r", offset=start + lo, shape=(count,))
        return mm, info["dtype"]

    @staticmethod
    def _to_torch(arr: np.ndarray, st_dtype: str) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if st_dtype == "BF16":
            return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(arr.copy())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header(self.where[name])[0][name]["shape"])

    def nbytes(self, name: str) -> int:
        lo, hi = self._header(self.where[name])[0][name]["data_offsets"]
        return hi - lo

    def tensor(self, name: str) -> torch.Tensor:
        flat, st = self._flat(name)
        return self._to_torch(flat, st).reshape(self.shape(name))

    def strided(self, name: str, step: int, samples: int) -> torch.Tensor:
        """flat[::step][:samples] of tensor `name`, reading only those elements."""
        flat, st = self._flat(name)
        return self._to_torch(flat[::step][:samples], st)

    def elements(self, name: str, index: np.ndarray) -> torch.Tensor:
        """flat[index] of tensor `name` (stored dtype; bf16 bits reinterpreted exactly), reading only those elements."""
        flat, st = self._flat(name)
        return self._to_torch(flat[np.asarray(index, dtype=np.int64)], st)


def meta_model(folder, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    register_v41()
    cfg = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.config._name_or_path = str(folder)  # as from_pretrained(folder) records it
    return model


def checkpoint_identity(folder, layer_ids: list[int], dtype: str | torch.dtype, samples: int = 64, *,
                        name_or_path: str | None = None) -> dict:
    """feature_cache.target_identity of the target `load_hf_target(folder, layer_ids, dtype)` would load, computed
    from config.json and strided reads of the checkpoint (the model is built on the meta device for its parameter
    names and shapes only; stored names are mapped through transformers' renamings and stacking / concatenating
    converters, TargetCheckpoint below). A parameter it cannot map is refused, naming it.
    `name_or_path`: what the HF loader was given, when that is a Hub id rather than `folder`."""

    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = meta_model(folder, dt)
    reader = TargetCheckpoint(folder, model)  # the model's names, through transformers' renamings / converters
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name not in reader:
            raise ValueError(f"{folder}: parameter {name}: {reader.why_not(name)}; this target cannot be "
                             "fingerprinted without loading it (for the vLLM producer: use data.feature_producer=hf)")
        numel = p.numel()
        step = max(1, numel // samples)
        vals = reader.strided(name, step, samples, p.dtype).to(torch.float32)
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(vals.numpy().tobytes())
    cfg_dict = {k: v for k, v in model.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return {
        "name_or_path": str(name_or_path or folder),
        "config_hash": config_digest(cfg_dict),
        "weights_hash": h.hexdigest()[:16],
        "dtype": str(model.get_input_embeddings().weight.dtype).removeprefix("torch."),
        "layer_ids": [int(i) for i in layer_ids],
    }


# ---- the checkpoint through the model's names -------------------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    key: str  # the checkpoint's tensor name
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Join:
    """torch.stack (`stack`: a new axis) or torch.cat (an existing axis) of `parts` along `dim`."""
    parts: tuple
    dim: int
    stack: bool
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Transpose:
    part: object
    dim0: int
    dim1: int
    shape: tuple[int, ...]


def _join(parts: list, dim: int, stack: bool):
    if not parts:
        raise HeadOnlyUnsupported("a converter with no stored tensors")
    first = parts[0].shape
    if stack:
        if any(p.shape != first for p in parts):
            raise HeadOnlyUnsupported(f"stacking tensors of different shapes {[p.shape for p in parts]}")
        d = dim % (len(first) + 1)
        return _Join(tuple(parts), d, True, first[:d] + (len(parts),) + first[d:])
    d = dim % len(first)
    if any(len(p.shape) != len(first) or p.shape[:d] + p.shape[d + 1:] != first[:d] + first[d + 1:] for p in parts):
        raise HeadOnlyUnsupported(f"concatenating tensors of shapes {[p.shape for p in parts]} on dim {d}")
    return _Join(tuple(parts), d, False, first[:d] + (sum(p.shape[d] for p in parts),) + first[d + 1:])


def _transpose(part, dim0: int, dim1: int):
    n = len(part.shape)
    d0, d1 = dim0 % n, dim1 % n
    shape = list(part.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return _Transpose(part, d0, d1, tuple(shape))


def _converted(converter, collected: dict[str, list[_Leaf]], want: tuple[int, ...]):
    """The node transformers' `converter` builds from the collected stored tensors ({source pattern: [leaves]} in
    the loader's order). Only the shape ops whose index map is known here: MergeModulelist (stack),
    Concatenate (cat), Transpose."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    if len(converter.target_patterns) != 1:
        raise HeadOnlyUnsupported(f"converter {converter.source_patterns} -> {converter.target_patterns} makes "
                                  "several tensors")
    state: dict[str, object] = dict(collected)
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            state = {k: _join(v, op.dim, True) if isinstance(v, list) else v for k, v in state.items()}
        elif isinstance(op, Concatenate):
            parts = []
            for pattern in converter.source_patterns:  # the loader's order: the converter's patterns
                v = state.get(pattern)
                parts += v if isinstance(v, list) else [] if v is None else [v]
            state = {"": _join(parts, op.dim, False)}
        elif isinstance(op, Transpose):
            if len(state) != 1:
                raise HeadOnlyUnsupported("Transpose of several tensors")
            (k, v), = state.items()
            v = v[0] if isinstance(v, list) and len(v) == 1 else v
            if isinstance(v, list):
                raise HeadOnlyUnsupported("Transpose of a list of tensors")
            state = {k: v if op.check_dims and v.shape == want else _transpose(v, op.dim0, op.dim1)}
        else:
            raise HeadOnlyUnsupported(f"conversion op {type(op).__name__} (only MergeModulelist, Concatenate, "
                                      "Transpose are mapped)")
    if len(state) != 1:
        raise HeadOnlyUnsupported(f"converter {converter.source_patterns} leaves {len(state)} tensors")
    node = next(iter(state.values()))
    if isinstance(node, list):
        if len(node) != 1:
            raise HeadOnlyUnsupported(f"converter {converter.source_patterns} leaves a list of {len(node)} tensors")
        node = node[0]
    return node


class TargetCheckpoint:
    """A safetensors checkpoint folder seen through `model`'s state-dict names (model on the meta device): which
    stored tensors transformers' loader would build each entry from, and how. Nothing is read until asked;
    `bytes_read` counts the bytes of the whole tensors materialised (`tensor`), `nbytes` is the checkpoint's."""

    def __init__(self, folder, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        self.folder = Path(folder)
        self.reader = CheckpointReader(folder)
        self.bytes_read = 0
        if getattr(model.config, "quantization_config", None):
            raise HeadOnlyUnsupported(f"{folder}: a quantized checkpoint (config.quantization_config): its tensors "
                                      "are what the quantizer makes of the stored ones")
        mapping = get_model_conversion_mapping(model)  # as from_pretrained (no key_mapping, no quantizer)
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        self.shapes = {k: tuple(v.shape) for k, v in meta.items()}
        prefix = model.base_model_prefix
        collected: dict[str, tuple[object, dict[str, list[_Leaf]]]] = {}
        for key in sorted(self.reader.where, key=dot_natural_key):  # the loader's order (experts 0, 1, ...)
            name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:  # transformers' own fallback: the key as is (+/- prefix)
                name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
            if name not in meta:
                continue  # a tensor the model does not hold (the loader reports it as unexpected)
            conv, leaves = collected.setdefault(name, (by_pattern[pattern] if pattern else None, {}))
            leaves.setdefault(pattern or key, []).append(_Leaf(key, self.reader.shape(key)))
        self.nodes: dict[str, object] = {}
        self.problems: dict[str, str] = {}
        for name, (conv, leaves) in collected.items():
            try:
                if conv is None:
                    (only,) = leaves.values()
                    if len(only) != 1:
                        raise HeadOnlyUnsupported(f"{len(only)} stored tensors renamed to it")
                    node = only[0]
                else:
                    node = _converted(conv, leaves, self.shapes[name])
                if node.shape != self.shapes[name]:
                    raise HeadOnlyUnsupported(f"built as {node.shape} from the checkpoint, the model holds "
                                              f"{self.shapes[name]}")
                self.nodes[name] = node
            except HeadOnlyUnsupported as e:
                self.problems[name] = str(e)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor stored in the checkpoint."""
        return sum(self.reader.nbytes(key) for key in self.reader.where)

    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def why_not(self, name: str) -> str:
        """Why state-dict entry `name` cannot be read from the checkpoint (it is not in `self`)."""
        return self.problems.get(name, "no stored tensor is loaded into it (the loader would initialise it)")

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole state-dict entry `name` as the loader builds it, in `dtype` (the parameter's)."""
        def build(node) -> torch.Tensor:
            if isinstance(node, _Leaf):
                self.bytes_read += self.reader.nbytes(node.key)
                return self.reader.tensor(node.key).to(dtype)
            if isinstance(node, _Transpose):
                return build(node.part).transpose(node.dim0, node.dim1).contiguous()
            parts = [build(p) for p in node.parts]
            return torch.stack(parts, node.dim) if node.stack else torch.cat(parts, node.dim)

        return build(self.nodes[name])

    def elements(self, name: str, index: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """Entry `name`'s elements at flat positions `index` [k] -> [k] in `dtype` (stored values cast as the loader
        casts them), reading only those elements of the stored tensors."""
        node = self.nodes[name]
        index = np.asarray(index, dtype=np.int64)
        idx = np.stack(np.unravel_index(index, node.shape), axis=1) if node.shape else np.zeros((len(index), 0),
                                                                                                 np.int64)
        return self._gather(node, idx, dtype)

    def strided(self, name: str, step: int, samples: int, dtype: torch.dtype) -> torch.Tensor:
        """flat[::step][:samples] of entry `name` in `dtype` (feature_cache._weights_hash's sample)."""
        n = int(np.prod(self.shapes[name], dtype=np.int64))
        return self.elements(name, np.arange(0, n, step, dtype=np.int64)[:samples], dtype)

    def _gather(self, node, idx: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """idx [k, ndim] multi-indices into `node` -> values [k]."""
        if isinstance(node, _Leaf):
            flat = np.ravel_multi_index(tuple(idx.T), node.shape) if len(node.shape) else np.zeros(len(idx), np.int64)
            return self.reader.elements(node.key, flat).to(dtype)
        if isinstance(node, _Transpose):
            idx = idx.copy()
            idx[:, [node.dim0, node.dim1]] = idx[:, [node.dim1, node.dim0]]
            return self._gather(node.part, idx, dtype)
        d = node.dim
        if node.stack:
            which, sub = idx[:, d], np.delete(idx, d, axis=1)
        else:
            ends = np.cumsum([p.shape[d] for p in node.parts])
            which = np.searchsorted(ends, idx[:, d], side="right")
            sub = idx.copy()
            sub[:, d] -= np.concatenate([[0], ends[:-1]])[which]  # position inside its part
        out = torch.empty(len(idx), dtype=dtype)
        for k in np.unique(which):
            rows = which == k
            out[torch.from_numpy(rows)] = self._gather(node.parts[int(k)], sub[rows], dtype)
        return out
