"""Crash-safe file writes: write to a temp file in the same folder, fsync, rename over the target, fsync the
folder. Files keep the user's umask (a serving process or a teammate can read them); a crash leaves at most a
`.<name>.*.tmp` file, which `remove_stale_tmp` clears on the next start. And where dspark keeps its caches
(default_cache_dir)."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch


def default_cache_dir() -> Path:
    """``$DSPARK_CACHE`` if set, else ``~/.cache/dspark`` (the tokenized rows, the feature caches)."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


TMP_SUFFIX = ".tmp"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: Path) -> None:
    """Makes a rename inside `folder` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made when missing), in words, or None when they can: the folder,
    or else its nearest existing parent, must be a directory this process may write."""
    p = Path(folder).expanduser().absolute()
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> bytes:
    """Writes the tensors atomically and returns the file's bytes (for a checksum without a re-read)."""
    from safetensors.torch import save

    data = canonical_header(save(tensors, metadata=metadata))
    atomic_write_bytes(Path(path), data)
    return data


def canonical_header(data: bytes) -> bytes:
    """safetensors bytes with the header's ``__metadata__`` keys in sorted order. safetensors writes that map in hash
    order, so the same tensors and metadata gave different bytes from call to call once the map held two keys (an
    export's checksums changed with nothing changed). The header is rewritten at its own length (padded with spaces,
    as safetensors pads it), so every tensor offset stays valid; a header that would not fit is left as it was."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or len(meta) < 2:
        return data
    header["__metadata__"] = dict(sorted(meta.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > size:
        return data
    return data[:8] + text + b" " * (size - len(text)) + data[8 + size:]


def remove_stale_tmp(folder: Path, older_than_s: float | None = None) -> list[Path]:
    """Deletes the `.<name>.*.tmp` files an interrupted atomic write left in `folder` (not recursive).
    Only call it where no other process is writing (e.g. a run directory under its lock), or with `older_than_s`:
    then only files last modified that many seconds ago or earlier go (an atomic write takes far less: a file that old
    is no write in progress)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    cutoff = None if older_than_s is None else time.time() - older_than_s
    stale = [p for p in folder.iterdir() if p.is_file() and p.name.startswith(".") and p.name.endswith(TMP_SUFFIX)
             and (cutoff is None or p.stat().st_mtime <= cutoff)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
