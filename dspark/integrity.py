"""Checksums for every artifact dspark writes and later reads, so a truncated or altered file is refused
with one line that names it, instead of a deep traceback or (worse) a silent wrong answer.

Two shapes:
- a folder (draft/, an export, a merged checkpoint): `dspark_manifest.json` = {file: {sha256, size}},
  written atomically after the files it lists (an interrupted write leaves no manifest, or one that does not
  match: both are refused, never trusted);
- a single file that is rewritten in place (training checkpoints): `<file>.sha256.json` beside it, updated
  in two phases (old + new digest accepted while the file is being replaced, then only the new one), so a
  crash at any moment leaves a file that its sidecar accepts.

`python -m dspark.integrity check PATH` / `seal PATH` checks a file or folder, or records the checksums of
one you trust (e.g. an artifact written by an older dspark).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from dspark import io as dspark_io  # atomic_write_bytes looked up per call: tests/test_faults.py fills the disk there
from dspark.errors import IntegrityError
from dspark.io import atomic_write_json

MANIFEST_NAME = "dspark_manifest.json"
SIDECAR_SUFFIX = ".sha256.json"
_CHUNK = 16 << 20


def digest_bytes(data: bytes | memoryview) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def digest_file(path: Path) -> dict:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "size": size}


def _mismatch(path: Path, expected: list[dict], *, hint: str, since: str = "it was written") -> IntegrityError | None:
    """None when `path` matches one of the `expected` digests, else the error naming what is wrong.

    Any size or sha256 difference reads "changed since <since> (N bytes now, M recorded)": a checksum cannot tell a
    truncation from an edit (a hand-edited config can be shorter), so the message states what is known, the sizes."""
    if not path.is_file():
        return IntegrityError(f"{path}: missing (listed in its checksum file); {hint}")
    size = path.stat().st_size
    recorded = " or ".join(map(str, sorted({int(e["size"]) for e in expected})))
    if all(size != int(e["size"]) for e in expected):
        return IntegrityError(f"{path}: changed since {since} ({size} bytes now, {recorded} recorded); {hint}")
    got = digest_file(path)["sha256"]
    if all(got != e["sha256"] for e in expected):
        return IntegrityError(f"{path}: changed since {since} ({size} bytes now, {recorded} recorded; sha256 "
                              f"{got[:12]}... does not match its checksum file); {hint}")
    return None


# ---- single files ------------------------------------------------------------------------------------
def sidecar_path(path: Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _sidecar_digests(path: Path) -> list[dict]:
    side = sidecar_path(path)
    try:
        return list(json.loads(side.read_text())["accept"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_checked(path: Path, data: bytes | memoryview) -> None:
    """Atomically replaces `path` with `data` and keeps `<path>.sha256.json` valid at every moment."""
    path = Path(path)
    new = digest_bytes(data)
    old = _sidecar_digests(path)[:1] if path.is_file() else []
    atomic_write_json(sidecar_path(path), {"file": path.name, "accept": [new, *old]})
    try:
        dspark_io.atomic_write_bytes(path, data)
    except BaseException:  # the file is unchanged (or absent): so is what its sidecar accepts
        if old:
            atomic_write_json(sidecar_path(path), {"file": path.name, "accept": old})
        else:
            sidecar_path(path).unlink(missing_ok=True)
        raise
    if old:
        atomic_write_json(sidecar_path(path), {"file": path.name, "accept": [new]})


def check_file(path: Path, *, hint: str, since: str = "it was written") -> None:
    """Raises IntegrityError (one line naming the file and `hint`, what to do) unless `path` matches its
    sidecar. A file without a sidecar is refused too: nothing says it is what was written."""
    path = Path(path)
    if not path.is_file():
        raise IntegrityError(f"{path}: does not exist; {hint}")
    expected = _sidecar_digests(path)
    if not expected:
        raise IntegrityError(f"{path}: no checksum file {sidecar_path(path).name} (written with every file dspark "
                             f"saves); if you trust the file, `python -m dspark.integrity seal {path}`; otherwise {hint}")
    err = _mismatch(path, expected, hint=hint, since=since)
    if err is not None:
        raise err


def remove_checked(path: Path) -> None:
    Path(path).unlink(missing_ok=True)
    sidecar_path(path).unlink(missing_ok=True)


# ---- folders -------------------------------------------------------------------------------------------
def write_manifest(folder: Path, names: list[str] | None = None) -> dict:
    """Hashes `names` (default: every regular, non-hidden file of the folder, recursively, except the
    manifest itself) and writes the manifest atomically. Call it after the last file is written."""
    folder = Path(folder)
    if names is None:
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                       if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith("."))
    files = {name: digest_file(folder / name) for name in names}
    atomic_write_json(folder / MANIFEST_NAME, {"format": 1, "files": files})
    return files


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """{file: {sha256, size}} or None when the folder has no manifest."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text())["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{path}: unreadable manifest ({e}); re-create the folder") from e


def check_manifest(folder: Path, *, hint: str, required: bool = True, names: list[str] | None = None,
                   since: str = "it was written") -> bool:
    """Checks the folder's files (or only `names`, which must be listed) against its manifest; a differing file
    is "changed since <since>" (e.g. "export").

    Returns False when there is no manifest and `required` is False (a folder dspark did not write, e.g. a
    released checkpoint); raises IntegrityError, one line naming the file and `hint`, otherwise."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        if required:
            raise IntegrityError(f"{folder}: no {MANIFEST_NAME} (written last, so the folder is incomplete or "
                                 f"was not written by dspark); if you trust it, `python -m dspark.integrity seal "
                                 f"{folder}`; otherwise {hint}")
        return False
    for name in names if names is not None else sorted(files):
        if name not in files:
            raise IntegrityError(f"{folder / name}: not in {MANIFEST_NAME}; {hint}")
        err = _mismatch(folder / name, [files[name]], hint=hint, since=since)
        if err is not None:
            raise err
    return True


def unlisted_files(folder: Path) -> list[str]:
    """Files of a manifested folder that its manifest does not list (a serving loader would still read them)."""
    folder = Path(folder)
    files = read_manifest(folder) or {}
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")
                  and str(p.relative_to(folder)) not in files)


# ---- CLI ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.integrity",
                                 description="check or record the checksums of a dspark file or folder")
    ap.add_argument("action", choices=("check", "seal"))
    ap.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    path: Path = args.path
    try:
        if args.action == "seal":
            if path.is_dir():
                n = len(write_manifest(path))
                print(f"{path}: {MANIFEST_NAME} written for {n} files")
            else:
                data = path.read_bytes()
                atomic_write_json(sidecar_path(path), {"file": path.name, "accept": [digest_bytes(data)]})
                print(f"{path}: {sidecar_path(path).name} written")
            return 0
        if path.is_dir():
            check_manifest(path, hint="the folder is damaged: re-create it")
        else:
            check_file(path, hint="the file is damaged")
        print(f"{path}: OK")
        return 0
    except IntegrityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
