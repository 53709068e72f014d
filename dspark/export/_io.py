"""Shared folder I/O for the exporters: sharded safetensors writing and reading (names, tensors)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from dspark.io import atomic_write_json, save_safetensors_atomic

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    n = len(shards)
    weight_map, paths = {}, []
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_safetensors_atomic(shard, out_dir / fname, meta)
        weight_map.update({name: fname for name in shard})
        paths.append(out_dir / fname)
    atomic_write_json(out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return paths


def iter_tensors(folder: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's model.safetensors or indexed shards whose name starts
    with `prefix` (only those are read: a merged target checkpoint's own weights are never loaded)."""
    from safetensors import safe_open

    folder = Path(folder)
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


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Copy `tensors` (module names) into the module's parameters; strict: both sides must match exactly."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    bad_shape = sorted(n for n in set(params) & set(tensors) if tuple(params[n].shape) != tuple(tensors[n].shape))
    if missing or extra or bad_shape:
        lines = [f"{what}: checkpoint does not match the draft"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in extra]
        lines += [f"  shape: {n} checkpoint {tuple(tensors[n].shape)} vs draft {tuple(params[n].shape)}"
                  for n in bad_shape]
        raise ValueError("\n".join(lines))
    with torch.no_grad():
        for name, p in params.items():
            p.data = tensors[name].to(device=p.device, dtype=p.dtype).clone()
