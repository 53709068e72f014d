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
(`dspark.targets.checkpoint.checkpoint_identity`). A checkpoint the view cannot map exactly (a quantized one, a
converter op it does not invert, a state-dict entry the loader would initialise rather than read) is refused with
`HeadOnlyUnsupported`, naming the entry; the caller then loads the whole target.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from dspark.targets.checkpoint import HeadOnlyUnsupported, TargetCheckpoint, checkpoint_identity, meta_model
from dspark.targets.hf_target import FrozenTarget, decoder_base, load_target_tokenizer, resolve_target_source
from dspark.targets.source import local_model_folder


class HeadOnlyError(RuntimeError):
    """A head-only target was asked to run its decoder layers, which were never loaded."""


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
        for module in {id(m): m for m in (model, decoder_base(model))}.values():
            module.register_forward_pre_hook(self._refuse)

    @property
    def cache_identity(self) -> dict:
        """feature_cache.target_identity of the whole target, from the checkpoint files (vllm_features)."""
        if self._cache_identity is None:
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
    base = decoder_base(model)
    final_norm = getattr(base, "norm", None) or getattr(base, "final_layer_norm", None)  # GPT-NeoX: final_layer_norm
    heads = [m for m in (model.get_input_embeddings(), model.get_output_embeddings(), final_norm)
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

    source = resolve_target_source(str(path))
    folder = local_model_folder(source)
    model = meta_model(folder, getattr(torch, dtype))
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
