"""Shared folder I/O for the exporters: sharded safetensors writing and reading (names, tensors)."""
from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from dspark.io import atomic_write_json, save_safetensors_atomic

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# config key of a folder written although vLLM 0.33.0 would not serve it as trained: the list of reasons
NOT_FOR_VLLM = "dspark_not_for_vllm"


def sealed(export_fn):
    """Decorates an exporter whose `out_dir` argument is the folder it writes: once it returns, the folder gets
    its checksum manifest (dspark.integrity), which `verify` and the importers check."""
    sig = inspect.signature(export_fn)

    @functools.wraps(export_fn)
    def wrapper(*args, **kwargs):
        from dspark.integrity import MANIFEST_NAME, write_manifest

        out_dir = Path(sig.bind(*args, **kwargs).arguments["out_dir"])
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # a re-export is unsealed until it is complete
        result = export_fn(*args, **kwargs)
        write_manifest(out_dir)
        return result

    return wrapper


def check_if_sealed(folder: Path) -> None:
    """Importers: a folder with a dspark manifest must match it (a folder without one, e.g. a released
    checkpoint, is read as is)."""
    from dspark.integrity import check_manifest

    check_manifest(Path(folder), required=False, hint="re-export it from the run's draft/")


def write_tensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  metadata: dict | None = None) -> list[Path]:
    """One `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards + index when over the limit."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_NAME]:  # a re-export replaces the set
        if stale.exists():
            stale.unlink()
    meta = {"format": "pt", **(metadata or {})}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        path = out_dir / SINGLE_NAME
        save_safetensors_atomic(tensors, path, meta)
        return [path]
    # the shard plan (greedy by size, model-0000k-of-0000n names) is huggingface_hub's, as transformers saves
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_bytes)
    weight_map, paths = {}, []
    for fname, names in split.filename_to_tensors.items():
        save_safetensors_atomic({name: tensors[name] for name in names}, out_dir / fname, meta)
        weight_map.update({name: fname for name in names})
        paths.append(out_dir / fname)
    atomic_write_json(out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return paths


def iter_tensors(folder: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's model.safetensors or indexed shards whose name starts
    with `prefix` (only those are read: a merged target checkpoint's own weights are never loaded)."""
    from safetensors import safe_open

    folder = Path(folder)
    check_if_sealed(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if name.startswith(prefix)})
    else:
        files = [SINGLE_NAME]
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith(prefix):
                    yield name, fh.get_tensor(name)


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str, *, buffers: bool = False) -> None:
    """Copy `tensors` (module names) into the module's parameters (with `buffers`: its whole state_dict,
    persistent buffers included); strict: both sides must match exactly, names and shapes."""
    own = module.state_dict() if buffers else dict(module.named_parameters())
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    bad_shape = sorted(n for n in set(own) & set(tensors) if tuple(own[n].shape) != tuple(tensors[n].shape))
    if missing or extra or bad_shape:
        lines = [f"{what}: checkpoint does not match the draft"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in extra]
        lines += [f"  shape: {n} checkpoint {tuple(tensors[n].shape)} vs draft {tuple(own[n].shape)}"
                  for n in bad_shape]
        raise ValueError("\n".join(lines))
    with torch.no_grad():
        for name, t in own.items():
            if buffers:
                t.copy_(tensors[name].to(t.dtype))
            else:
                t.data = tensors[name].to(device=t.device, dtype=t.dtype).clone()


def merge_shard_into_copy(target_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], *, shard: str,
                          is_draft_name, skip: tuple[str, ...] = ()) -> None:
    """out_dir = a copy of the target checkpoint folder (files hard-linked when possible, copied otherwise) with
    `tensors` in their own `shard` and the index updated (a single-file target gets an index). Tensors the
    target already holds under draft names (`is_draft_name(name)`, e.g. its own MTP layers) are removed from
    the copy: their shards are rewritten without them, the originals stay untouched. config.json, the index,
    `shard` and the `skip` files are not copied (the caller writes its config)."""
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in target_dir.iterdir():
        if src.is_file() and src.name not in ("config.json", INDEX_NAME, shard, *skip):
            dst = out_dir / src.name
            if dst.exists():
                dst.unlink()
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    if (target_dir / INDEX_NAME).is_file():
        index = json.loads((target_dir / INDEX_NAME).read_text())
    else:
        with safe_open(str(target_dir / SINGLE_NAME), framework="pt") as fh:
            index = {"metadata": {}, "weight_map": {k: SINGLE_NAME for k in fh.keys()}}
    weight_map = dict(index["weight_map"])
    old = {k: f for k, f in weight_map.items() if is_draft_name(k)}
    for fname in sorted(set(old.values())):
        kept = {k: t for k, t in load_file(str(target_dir / fname)).items() if k not in old}
        (out_dir / fname).unlink(missing_ok=True)  # absent: the target is itself a merge (its draft shard)
        if kept:
            save_safetensors_atomic(kept, out_dir / fname, {"format": "pt"})
    for k in old:
        del weight_map[k]
    save_safetensors_atomic(tensors, out_dir / shard, {"format": "pt"})
    weight_map.update({k: shard for k in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index.setdefault("metadata", {}).pop("total_size", None)  # no longer exact; optional in the format
    atomic_write_json(out_dir / INDEX_NAME, index)
