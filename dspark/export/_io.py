"""Shared folder I/O for the exporters: the export folder written whole (`sealed`), sharded safetensors writing and
reading (names, tensors)."""
from __future__ import annotations

import functools
import glob
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from dspark import integrity  # write_manifest per call: tests/export/test_export_folder.py stops an export there
from dspark.errors import UserError
from dspark.io import (TMP_SUFFIX, _umask, atomic_write_json, fsync_dir, remove_stale_tmp,
                       save_safetensors_atomic, unwritable)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# config key of a folder written although vLLM 0.33.0 would not serve it as trained: the list of reasons
NOT_FOR_VLLM = "dspark_not_for_vllm"


# an export is written into `.<out name>.export-<pid>-<random>.tmp` beside its folder, then renamed into place; a
# replaced folder is moved to `.<out name>.replaced-<pid>-<random>.tmp` first (both removed once their process is gone)
_STAGING = ("export", "replaced")


def _staging_name(out_dir: Path, what: str) -> str:
    return f".{out_dir.name}.{what}-{os.getpid()}-"


def stale_staging(out_dir: Path) -> list[Path]:
    """The staging folders beside `out_dir` whose process is gone (an export killed before its rename)."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    if not parent.is_dir():
        return []
    found = []
    for what in _STAGING:
        for p in parent.glob(f".{glob.escape(out_dir.name)}.{what}-*-*{TMP_SUFFIX}"):
            pid = p.name[len(f".{out_dir.name}.{what}-"):].split("-", 1)[0]
            if p.is_dir() and pid.isdigit() and not _alive(int(pid)):
                found.append(p)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _held_files(out_dir: Path) -> list[str]:
    """What `out_dir` holds, besides the temp files of interrupted atomic writes (dspark.io)."""
    return sorted(p.name for p in out_dir.iterdir() if not (p.is_file() and p.name.startswith(".")
                                                            and p.name.endswith(TMP_SUFFIX)))


def check_out_dir(out_dir: Path, overwrite: bool, *, source: Path | None = None) -> None:
    """An export's folder must be new or empty, unless `overwrite` (which replaces it whole); `source`, the target
    checkpoint a merge copies, must survive that. UserError naming the folder otherwise; call it before any model
    loads (the CLI does) -- the exporters call it again."""
    out_dir = Path(out_dir)
    if source is not None:
        src, out = Path(source).resolve(), out_dir.resolve()
        if src == out:
            raise UserError(f"{out_dir}: the export folder must differ from the target checkpoint it copies "
                            "(the target stays untouched)")
        if overwrite and out in src.parents:
            raise UserError(f"{out_dir}: holds the target checkpoint {source}; replacing it would delete the target")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: is a file, not a folder")
    why = unwritable(out_dir.parent)
    if why is not None:
        raise UserError(f"{out_dir}: cannot write the export beside it ({why})")
    if overwrite or not out_dir.is_dir():
        return
    held = _held_files(out_dir)
    if held:
        shown = ", ".join(held[:3]) + (f", ... ({len(held)} entries)" if len(held) > 3 else "")
        raise UserError(f"{out_dir}: the folder already holds files ({shown}); an export needs a new or empty "
                        "folder: choose another, or pass --overwrite (overwrite=True) to replace it whole")


def _publish(staged: Path, out_dir: Path) -> None:
    """Renames the finished `staged` folder to `out_dir`, replacing whatever `out_dir` held."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=_staging_name(out_dir, "replaced"),
                                    suffix=TMP_SUFFIX))
        os.replace(out_dir, old)  # rename(2) onto the empty folder mkdtemp made
        os.replace(staged, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, out_dir)  # onto nothing, or onto an empty folder
    fsync_dir(out_dir.parent)


def sealed(export_fn):
    """Decorates an exporter whose `out_dir` argument is the folder it writes (and `target_dir`, if any, the target
    checkpoint a merge copies). The folder is written whole or not at all: the exporter writes into a fresh staging
    folder beside it, which gets its checksum manifest (dspark.integrity, checked by `verify` and the importers)
    and is then renamed to `out_dir`. So the manifest covers exactly what this export wrote, and a killed export
    leaves `out_dir` as it was (plus a staging folder, removed by the next export to the same folder).

    `out_dir` must be new or empty (UserError naming it otherwise) unless the decorated function is called with
    `overwrite=True`, which replaces the folder whole: no file of the old one survives beside the new export."""
    sig = inspect.signature(export_fn)

    @functools.wraps(export_fn)
    def wrapper(*args, overwrite: bool = False, **kwargs):
        bound = sig.bind(*args, **kwargs)
        out_dir = Path(bound.arguments["out_dir"])
        source = bound.arguments.get("target_dir")
        check_out_dir(out_dir, overwrite, source=None if source is None else Path(source))
        for stale in stale_staging(out_dir):
            shutil.rmtree(stale, ignore_errors=True)
        if out_dir.is_dir() and not overwrite:
            remove_stale_tmp(out_dir)  # only interrupted-write temp files remain in it (check_out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=_staging_name(out_dir, "export"),
                                       suffix=TMP_SUFFIX))
        try:
            os.chmod(staged, 0o777 & ~_umask())  # mkdtemp makes 0700: a serving process must read the folder
            bound.arguments["out_dir"] = staged
            export_fn(*bound.args, **bound.kwargs)
            integrity.write_manifest(staged)
            _publish(staged, out_dir)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return out_dir

    return wrapper


def check_if_sealed(folder: Path) -> None:
    """Importers: a folder with a dspark manifest must match it (a folder without one, e.g. a released
    checkpoint, is read as is)."""
    integrity.check_manifest(Path(folder), required=False, hint="re-export it from the run's draft/", since="export")


def write_serving_config(out_dir: Path, name: str, config: dict, not_served: list[str] | None = None) -> dict:
    """The folder's serving config (config.json, dspark_config.json, ...) as every export writes it: `config` with
    the reasons vLLM would serve the draft otherwise than it was trained under dspark_not_for_vllm (a list the
    config carried before, e.g. a merged target's, is replaced), written atomically. Returns what was written."""
    config = {k: v for k, v in config.items() if k != NOT_FOR_VLLM}
    if not_served:
        config[NOT_FOR_VLLM] = list(not_served)
    atomic_write_json(Path(out_dir) / name, config)
    return config


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
