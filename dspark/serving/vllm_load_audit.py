"""Load audit, run INSIDE the vLLM interpreter (imports vllm, torch and the standard library only).

Did vLLM's own loader put every exported tensor somewhere, and fill every parameter of its draft model?
vLLM cannot always say: e.g. DFlash's `load_weights` returns nothing, so vLLM's "weights not initialized"
check never runs for it, and a missing `hidden_norm.weight` silently keeps its initial value. The audit
poisons every floating parameter with NaN, lets the model's own `load_weights` (vLLM's name remapping,
fusing, sharding) run, and reads back:

- unloaded: parameters still all NaN (integer parameters, e.g. d2t's draft_id_to_target_id: their dtype's minimum); partial: parameters only partly written (e.g. a fused qkv with a
  missing k); both are restored to their previous values afterwards, so the engine then runs exactly as
  vLLM would have run it (the audit only reports).
- skipped (standalone check only): tensors of the export that write nothing when loaded alone into a freshly
  built model (fresh: some loaders drop modules they received no tensor for, e.g. DSpark V4's confidence head).

`audit_during_init(arch)` wraps the draft class's `load_weights` while `vllm.LLM` builds the engine in
this process; `standalone_check(job)` builds vLLM's draft model class itself (no engine, no KV cache: works
for classes this machine cannot serve, as far as they construct without CUDA; `model_class` picks another
platform's class, e.g. the CUDA one where the CPU entry only raises) and audits it tensor by tensor.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

# Filled by the wrapper installed by audit_during_init: one record per load_weights call.
RECORDS: list[dict] = []


def _poison_value(p):
    """NaN for a floating parameter, the dtype's minimum for an integer one (e.g. DFlash's draft_id_to_target_id:
    d2t offsets are never negative), None for others (bool)."""
    import torch

    if p.is_floating_point():
        return float("nan")
    if p.dtype in (torch.int64, torch.int32, torch.int16, torch.int8):
        return torch.iinfo(p.dtype).min
    return None


def _unwritten(p):
    """Bool mask of the elements still holding the poison value."""
    import torch

    return torch.isnan(p.data) if p.is_floating_point() else p.data == torch.iinfo(p.dtype).min


def _poison(model) -> dict:
    import torch

    originals = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = _poison_value(p)
            if value is not None and p.numel():
                originals[name] = p.data.clone()
                p.data.fill_(value)
    return originals


def _read_back(model, originals: dict, restore: bool = True) -> tuple[list[str], dict[str, float]]:
    """-> (unloaded parameter names, {partly loaded name: written fraction}); restores unwritten values."""
    import torch

    unloaded, partial = [], {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in originals:
                continue
            nan = _unwritten(p)
            if bool(nan.all()):
                unloaded.append(name)
            elif bool(nan.any()):
                partial[name] = 1.0 - float(nan.float().mean())
            if restore and bool(nan.any()):
                p.data[nan] = originals[name].to(p.device)[nan]
    return unloaded, partial


def _any_written(model) -> bool:
    import torch

    return any(not bool(_unwritten(p).all()) for _, p in model.named_parameters()
               if _poison_value(p) is not None and p.numel())


def _params(model) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def audit_during_init(arch: str) -> None:
    """Wrap the registered class of `arch` so that its load_weights is audited (records in RECORDS)."""
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:
        raise ValueError(f"vLLM has no model class registered for architecture {arch!r}")
    if getattr(cls.load_weights, "_dspark_audited", False):
        return
    original = cls.load_weights

    def load_weights(self, weights):
        names: list[str] = []

        def tap(it):
            for name, tensor in it:
                names.append(name)
                yield name, tensor

        originals = _poison(self)
        result = original(self, tap(weights))
        unloaded, partial = _read_back(self, originals)
        RECORDS.append({"class": type(self).__name__, "arch": arch, "tensors": names, "unloaded": unloaded,
                        "partial": partial, "parameters": _params(self),
                        "returned_loaded_set": None if result is None else sorted(result)})
        return result

    load_weights._dspark_audited = True
    cls.load_weights = load_weights


# ---- standalone construction ---------------------------------------------------------------------------
def _tensors(folder: Path) -> list[tuple[str, str]]:
    """(name, file) of every tensor in the folder's safetensors files, in file order."""
    from safetensors import safe_open

    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out += [(k, str(f)) for k in fh.keys()]
    return out


def _load(names: list[tuple[str, str]]):
    from safetensors import safe_open

    handles: dict[str, object] = {}
    for name, f in names:
        if f not in handles:
            handles[f] = safe_open(f, framework="pt")
        yield name, handles[f].get_tensor(name)


@contextlib.contextmanager
def _single_process_dist():
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="dspark-dist-")
    os.close(fd)
    os.unlink(path)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{path}",
                                 backend="gloo")
    initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def _no_runner_check(skip: bool):
    """The audit builds no engine, so the model runner's feature check (e.g. V1 refusing `dspark`) is moot."""
    from vllm.config import VllmConfig

    original = VllmConfig._validate_v1_model_runner
    if skip:
        VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        yield
    finally:
        VllmConfig._validate_v1_model_runner = original


def _import_class(spec: str):
    """'package.module:Class' -> the class."""
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _engine_config(job: dict):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": job["method"], "num_speculative_tokens": int(job["num_speculative_tokens"])}
    if job.get("draft"):
        spec["model"] = job["draft"]
    args = EngineArgs(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True,
                      max_model_len=int(job.get("max_model_len", 2048)), speculative_config=spec,
                      distributed_executor_backend="uni", **(job.get("engine_kwargs") or {}))
    with _no_runner_check(job.get("skip_runner_check", True)):
        return args.create_engine_config()


@contextlib.contextmanager
def _cuda_stubs(enabled: bool):
    """Lets a CUDA model class construct on a CPU-only machine for the audit: torch.cuda.Stream / Event become
    inert objects (nothing runs on them; the audit only builds the module tree and loads weights)."""
    import torch

    if not enabled:
        yield
        return

    class _Inert:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    saved = (torch.cuda.Stream, torch.cuda.Event)
    cap = current_platform.get_device_capability
    torch.cuda.Stream, torch.cuda.Event = _Inert, _Inert
    current_platform.get_device_capability = lambda *a, **k: DeviceCapability(9, 0)  # build the SM90 (H100) layout
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.Event = saved
        current_platform.get_device_capability = cap


def standalone_check(job: dict) -> dict:
    """Build vLLM's draft model for (target, draft, method) without an engine and audit its load_weights,
    first with every tensor, then one tensor at a time (a tensor that writes nothing alone is skipped)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = _engine_config(job)
    draft_cfg = vllm_config.speculative_config.draft_model_config
    folder = Path(job.get("weights") or draft_cfg.model)
    names = _tensors(folder)
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    if job.get("tensor_filter"):  # e.g. only the mtp.* tensors of a merged target checkpoint
        names = [(n, f) for n, f in names if any(n.startswith(p) for p in job["tensor_filter"])]
    with set_current_vllm_config(vllm_config), _single_process_dist(), _cuda_stubs(bool(job.get("cuda_stubs"))), \
            set_default_torch_dtype(getattr(torch, job.get("dtype", "float32"))), torch.device("cpu"):
        cls = _import_class(job["model_class"]) if job.get("model_class") else None  # e.g. the CUDA class

        def build():
            vllm_config.compilation_config.static_forward_context.clear()  # layers register their names there
            return initialize_model(vllm_config, model_config=draft_cfg, model_class=cls, prefix=job.get("prefix", ""))

        model = build()
        originals = _poison(model)
        result = model.load_weights(_load(names))
        unloaded, partial = _read_back(model, originals, restore=False)
        params = _params(model)
        skipped = []
        if job.get("per_tensor", True):  # a fresh model per tensor: some loaders drop modules they got no tensor for
            for item in names:
                alone = build()
                _poison(alone)
                alone.load_weights(_load([item]))
                if not _any_written(alone):
                    skipped.append(item[0])
                del alone
    return {"class": type(model).__name__, "architectures": list(draft_cfg.hf_config.architectures or []),
            "draft_model": str(draft_cfg.model), "tensors": [n for n, _ in names], "unloaded": unloaded,
            "partial": partial, "skipped": skipped, "parameters": params,
            "returned_loaded_set": None if result is None else sorted(result)}


if __name__ == "__main__":  # python vllm_load_audit.py JOB.json -> the audit as JSON on stdout
    import sys

    print(json.dumps(standalone_check(json.loads(Path(sys.argv[1]).read_text()))))
