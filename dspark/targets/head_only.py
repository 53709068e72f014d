"""Head-only frozen target: what training from a complete offline feature cache (a cache hit) reads of the target.

Training from a cache never runs the target's decoder layers: the batches carry the cached features (`aux` taps,
`final` = the model's last_hidden_state, already through hc_head + the final norm for DeepSeek-V4 / HY V4), and the
loss reads only the target's embedding (`embed_weight`) and LM head (`lm_head_weight`, `logits_from_final`). So the
model is built on the meta device from its config and only the input embedding, the output embedding (LM head) and
the final norm are read from the checkpoint's safetensors files; every decoder layer stays on meta. Calling the
model (`features`, `logits`, or `model(...)` itself) raises `HeadOnlyError`. With draft.init_from_target, the
target modules the draft's copy reads (its family's `init_reads`, e.g. the last decoder layers for DeepSeek-V4.1
DSpark) are read whole too, and put back on meta once the draft is built (`release_init_modules`).

`TargetCheckpoint` sees the checkpoint through the model's state-dict names, the way transformers' loader builds
them (its renamings, e.g. DeepSeek-V4's `head.weight` -> `lm_head.weight`, and the converters that stack /
concatenate / transpose stored tensors, e.g. the fused MoE experts), so any entry's values are read without loading
the model: the materialised head tensors, `fingerprint()` (the same string `FrozenTarget.fingerprint` gives on the
whole target: the sampled elements are read through the safetensors header offsets) and the cache identity
(`dspark.data.vllm_features.checkpoint_identity`). A checkpoint the view cannot map exactly (a quantized one, a
converter op it does not invert, a state-dict entry the loader would initialise rather than read) is refused with
`HeadOnlyUnsupported`, naming the entry; the caller then loads the whole target.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark.targets.hf_target import FrozenTarget, load_target_tokenizer, resolve_target_source
from dspark.targets.source import local_model_folder


class HeadOnlyUnsupported(ValueError):
    """This checkpoint cannot be loaded head-only (the reason names the entry); load the whole target instead."""


class HeadOnlyError(RuntimeError):
    """A head-only target was asked to run its decoder layers, which were never loaded."""


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

        from dspark.data.vllm_features import CheckpointReader

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


# ---- the target --------------------------------------------------------------------------------------
class HeadOnlyTarget(FrozenTarget):
    """A FrozenTarget whose model holds real values only in its input embedding, LM head and final norm (the rest
    on the meta device): what the loss reads when the features come from the offline cache. `fingerprint()` and
    `cache_identity` equal the whole target's `fingerprint()` / `feature_cache.target_identity`, the other entries
    sampled from the checkpoint files."""

    def __init__(self, model: nn.Module, layer_ids: list[int], tokenizer, checkpoint: TargetCheckpoint,
                 head_modules: list[nn.Module], *, cache_identity: dict | None = None, require_aux: bool = True,
                 init_modules: dict[str, nn.Module] | None = None):
        super().__init__(model, layer_ids, tokenizer, require_aux=require_aux)
        self.checkpoint = checkpoint
        self._cache_identity = cache_identity
        self._head_modules = head_modules
        self.init_modules = dict(init_modules or {})  # read for draft.init_from_target: {name: module}
        for module in {id(m): m for m in (model, getattr(model, "model", model))}.values():
            module.register_forward_pre_hook(self._refuse)

    @property
    def cache_identity(self) -> dict:
        """feature_cache.target_identity of the whole target, from the checkpoint files (vllm_features)."""
        if self._cache_identity is None:
            from dspark.data.vllm_features import checkpoint_identity

            self._cache_identity = checkpoint_identity(self.checkpoint.folder, self.layer_ids, self.embed_weight.dtype,
                                                       name_or_path=str(self.model.config._name_or_path))
        return self._cache_identity

    def _refuse(self, *_args, **_kwargs):
        raise HeadOnlyError(
            "this target was loaded head-only (embedding, final norm, LM head; data.feature_cache was complete, so "
            "training reads the cached features): its decoder layers are not loaded and it cannot run. Load the "
            "whole target (dspark.targets.hf_target.load_hf_target) to compute features or logits.")

    def features(self, *args, **kwargs):
        self._refuse()

    def logits(self, *args, **kwargs):
        self._refuse()

    def to(self, device) -> "HeadOnlyTarget":
        for module in self._head_modules:  # (the meta layers cannot move; tied weights stay one tensor)
            module.to(device)
        return self

    def release_init_modules(self) -> None:
        """The modules read for draft.init_from_target back on the meta device, once the draft has copied them
        (training reads only the head); the head's own tensors stay."""
        keep = {id(t) for m in self._head_modules for t in (*m.parameters(), *m.buffers())}
        for module in self.init_modules.values():
            for sub in module.modules():
                for table in (sub._parameters, sub._buffers):
                    for name, t in table.items():
                        if t is not None and id(t) not in keep and not t.is_meta:
                            table[name] = nn.Parameter(t.to("meta"), requires_grad=False) \
                                if isinstance(t, nn.Parameter) else t.to("meta")
        self.init_modules = {}

    def _sampled(self, name: str, p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if p.is_meta:
            return self.checkpoint.elements(name, index.numpy(), p.dtype).float()
        return super()._sampled(name, p, index)


def _stored_buffers(model: nn.Module, modules: list[nn.Module], ckpt: TargetCheckpoint):
    """[(owner module, buffer name, state-dict name)] of the meta buffers of `modules`, each one the checkpoint
    stores (e.g. a MoE gate's e_score_correction_bias); a non-persistent one (the loader computes it, e.g. rotary
    frequencies) or one the checkpoint lacks is refused."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out = []
    for sub in {id(s): s for mod in modules for s in mod.modules()}.values():
        for bname, b in sub._buffers.items():
            if b is None or not b.is_meta:
                continue
            full = f"{names[id(sub)]}.{bname}".lstrip(".")
            if bname in sub._non_persistent_buffers_set:
                raise HeadOnlyUnsupported(f"{full}: a buffer the loader computes")
            if full not in ckpt:
                raise HeadOnlyUnsupported(f"{full}: {ckpt.why_not(full)}")
            out.append((sub, bname, full))
    return out


def _materialise(model: nn.Module, modules: list[nn.Module], ckpt: TargetCheckpoint) -> None:
    """Every parameter and buffer of `modules` read from the checkpoint, in the dtype the meta model gives it; a
    parameter shared by several modules (tied embeddings) stays one tensor. Refused (HeadOnlyUnsupported) before
    anything is read when a buffer is not stored (_stored_buffers)."""
    buffers = _stored_buffers(model, modules, ckpt)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, pname, f"{mname}.{pname}" if mname else pname))
    for p in list({id(p): p for mod in modules for p in mod.parameters()}.values()):  # (before any is replaced)
        names = [full for _, _, full in owners[id(p)]]
        stored = next((n for n in names if n in ckpt), None)
        if stored is None:
            raise HeadOnlyUnsupported(f"{names[0]}: {ckpt.why_not(names[0])}")
        value = nn.Parameter(ckpt.tensor(stored, p.dtype), requires_grad=False)
        for owner, pname, _ in owners[id(p)]:
            owner._parameters[pname] = value
    for owner, bname, full in buffers:
        owner._buffers[bname] = ckpt.tensor(full, owner._buffers[bname].dtype)


def _head_modules(model: nn.Module) -> list[nn.Module]:
    """The input embedding, the LM head and the final norm (one module when the head is tied to the embedding)."""
    base = getattr(model, "model", model)
    heads = [m for m in (model.get_input_embeddings(), model.get_output_embeddings(), getattr(base, "norm", None))
             if isinstance(m, nn.Module)]
    return list({id(m): m for m in heads}.values())


def load_head_only_target(path: str, layer_ids: list[int], dtype: str = "float32", *, require_aux: bool = True,
                          cache_identity: dict | None = None,
                          also: Callable[[nn.Module, object], Iterable[str]] | None = None) -> HeadOnlyTarget:
    """The target `load_hf_target(path, layer_ids, dtype)` would load, with only its embedding, LM head and final norm
    read (HeadOnlyTarget). `also(meta_model, tokenizer)`: the names of further modules to read whole, e.g. the
    target layers draft.init_from_target copies (registry.init_reads), held until `release_init_modules`.
    HeadOnlyUnsupported (naming the entry) when the checkpoint cannot be mapped exactly, so that the fingerprint
    could not equal the whole target's: load the whole target then."""
    from dspark.data.vllm_features import _meta_model

    source = resolve_target_source(str(path))
    folder = local_model_folder(source)
    model = _meta_model(folder, getattr(torch, dtype))
    model.config._name_or_path = source  # as from_pretrained(source) records it
    ckpt = TargetCheckpoint(folder, model)
    tokenizer = load_target_tokenizer(source)
    heads = _head_modules(model)
    extra = {name: model.get_submodule(name) for name in (also(model, tokenizer) if also is not None else ())}
    extra = {name: m for name, m in extra.items() if all(m is not h for h in heads)}  # (the final norm is read)
    _materialise(model, heads + list(extra.values()), ckpt)
    unread = [name for name, t in model.state_dict().items() if t.is_meta and name not in ckpt]
    if unread:
        raise HeadOnlyUnsupported(f"{folder}: {unread[0]}: {ckpt.why_not(unread[0])}"
                                  + (f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""))
    return HeadOnlyTarget(model, layer_ids, tokenizer, ckpt, heads, cache_identity=cache_identity,
                          require_aux=require_aux, init_modules=extra)


__all__ = ["HeadOnlyError", "HeadOnlyTarget", "HeadOnlyUnsupported", "TargetCheckpoint", "load_head_only_target"]
