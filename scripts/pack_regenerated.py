#!/usr/bin/env python
"""Keep regenerated data across machines: pack data/regenerated/<name>.jsonl (and its failure sidecar) into
benchmarks/data/<name>.jsonl.gz with a sha256 manifest, and unpack it back to resume the run.

    python scripts/pack_regenerated.py pack data/regenerated/smollm2_sharegpt_5k.jsonl [more.jsonl ...]
    python scripts/pack_regenerated.py unpack smollm2_sharegpt_5k [--force]   # -> data/regenerated/, then rerun
    python scripts/pack_regenerated.py check                                   # every packed file vs the manifest
    # a run in progress: append-only shards <name>.partNNNN.jsonl.gz, each holding the lines added since the last
    python scripts/pack_regenerated.py shard data/regenerated/smollm2_30k_sharegpt.jsonl [--min-lines 500]
    # a second process's range (scripts/regenerate.py --skip K --out PART) appended to the main output, once both end
    python scripts/pack_regenerated.py merge data/regenerated/smollm2_30k_sharegpt.jsonl PART.jsonl

Packing takes the complete lines only (a run may be appending while it packs: a partial last line is left out)
and checks that each parses as a JSON object with an "id". The gzip files carry no timestamp, so packing the same
lines twice gives the same bytes. benchmarks/data/manifest.json records, per packed file, the sha256 of the .gz
and of its text, the line count and the source file; benchmarks/data/SHA256SUMS the same .gz digests for
`sha256sum -c`. Unpacking verifies both digests, then writes the file; an existing file is replaced only when it
is a prefix of the packed one (or with --force), so unpacking never drops records a run has added since.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without install

from dspark.data.regenerate import OutputBusy, writing_alone  # noqa: E402
PACK_DIR = REPO / "benchmarks" / "data"
DATA_DIR = REPO / "data" / "regenerated"
MANIFEST = "manifest.json"
SIDECAR = ".failed.jsonl"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def complete_lines(path: Path) -> bytes:
    """The file's text up to its last newline, every line checked to be a JSON object with a string "id"."""
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not (isinstance(row, dict) and isinstance(row.get("id"), str)):
            raise ValueError(f"{path}:{lineno}: not a JSON object with a string 'id'")
    return data


def _lines(data: bytes) -> int:
    return data.count(b"\n")


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def load_manifest(pack_dir: Path) -> dict:
    path = pack_dir / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def _write_manifest(pack_dir: Path, manifest: dict) -> None:
    (pack_dir / MANIFEST).write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    (pack_dir / "SHA256SUMS").write_text("".join(f"{e['sha256']}  {name}\n" for name, e in sorted(manifest.items())))


def pack(paths: list[Path], pack_dir: Path = PACK_DIR) -> list[dict]:
    """Pack each .jsonl and, when it has lines, its <file>.failed.jsonl sidecar; returns the manifest entries."""
    pack_dir.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(pack_dir)
    written = []
    for path in paths:
        path = Path(path)
        for src in (path, path.with_name(path.name + SIDECAR)):
            if src != path and (not src.exists() or not src.stat().st_size):
                continue
            text = complete_lines(src)
            blob = _gzip(text)
            name = src.name + ".gz"
            (pack_dir / name).write_bytes(blob)
            entry = {"sha256": _sha256(blob), "content_sha256": _sha256(text), "lines": text.count(b"\n"),
                     "bytes": len(text), "gz_bytes": len(blob), "source": src.name}
            manifest[name] = entry
            written.append({"file": name, **entry})
    _write_manifest(pack_dir, manifest)
    return written


def shard_names(manifest: dict, stem: str) -> list[str]:
    """The packed shards of <stem>.jsonl, in order."""
    prefix = f"{stem}.part"
    return sorted(n for n in manifest if n.startswith(prefix) and n.endswith(".jsonl.gz")
                  and n[len(prefix):-len(".jsonl.gz")].isdigit())


def shard(path: Path, pack_dir: Path = PACK_DIR, min_lines: int = 1) -> list[dict]:
    """Pack the complete lines of ``path`` that its earlier shards do not hold into a new shard (never rewriting
    a packed file), when there are at least ``min_lines``; the failure sidecar is packed whole when it changed.
    Refuses a file whose start differs from its shards (edited or replaced: pack it under another name)."""
    path = Path(path)
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    pack_dir.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(pack_dir)
    parts = shard_names(manifest, stem)
    packed = b"".join(_verified_text(pack_dir, n, manifest[n]) for n in parts)
    text = complete_lines(path)
    if not text.startswith(packed):
        raise ValueError(f"{path} does not continue its {len(parts)} packed shards ({_lines(packed)} lines): "
                         "the file was edited or replaced")
    new = text[len(packed):]
    written = []
    if _lines(new) >= max(1, min_lines):
        name = f"{stem}.part{len(parts):04d}.jsonl.gz"
        blob = _gzip(new)
        (pack_dir / name).write_bytes(blob)
        manifest[name] = {"sha256": _sha256(blob), "content_sha256": _sha256(new), "lines": _lines(new),
                          "bytes": len(new), "gz_bytes": len(blob), "source": path.name,
                          "first_line": _lines(packed)}
        written.append({"file": name, **manifest[name]})
    sidecar = path.with_name(path.name + SIDECAR)
    if sidecar.exists() and sidecar.stat().st_size:
        side = complete_lines(sidecar)
        name = sidecar.name + ".gz"
        if manifest.get(name, {}).get("content_sha256") != _sha256(side):
            blob = _gzip(side)
            (pack_dir / name).write_bytes(blob)
            manifest[name] = {"sha256": _sha256(blob), "content_sha256": _sha256(side), "lines": _lines(side),
                              "bytes": len(side), "gz_bytes": len(blob), "source": sidecar.name}
            written.append({"file": name, **manifest[name]})
    _write_manifest(pack_dir, manifest)
    return written


def _ids(data: bytes) -> dict[str, bytes]:
    return {json.loads(line)["id"]: line for line in data.split(b"\n") if line.strip()}


def _whole_lines(path: Path) -> bytes:
    """complete_lines of a file that must not end in a torn line (appending after one would corrupt the next)."""
    if not path.exists():
        return b""
    data = complete_lines(path)
    if len(data) != path.stat().st_size:
        raise ValueError(f"{path} ends in a torn line (a killed run): rerun its regeneration once to repair it")
    return data


def merge(main: Path, part: Path) -> tuple[int, int]:
    """Append to ``main`` (and its failure sidecar) the records of ``part`` it lacks: the output of a second process
    that regenerated a later range of the same source (scripts/regenerate.py --skip), with the same settings. Neither
    may be in use by a regeneration; a record in both must be the same line. Appending keeps ``main``'s packed shards
    valid; merging again appends nothing. Returns (records, failures) appended."""
    main, part = Path(main), Path(part)
    with writing_alone(main), writing_alone(part):
        have = _ids(_whole_lines(main))
        new = {}
        for rid, line in _ids(_whole_lines(part)).items():
            if rid not in have:
                new[rid] = line
            elif have[rid] != line:
                raise ValueError(f"{part}: record {rid!r} differs from {main}'s: not the same source and settings")
        side_main, side_part = (p.with_name(p.name + SIDECAR) for p in (main, part))
        failed = _ids(_whole_lines(side_main))
        taken = have.keys() | new.keys() | failed.keys()
        new_failed = [line for rid, line in _ids(_whole_lines(side_part)).items() if rid not in taken]
        for path, lines in ((main, list(new.values())), (side_main, new_failed)):
            if lines:
                with open(path, "ab") as f:
                    f.write(b"".join(line + b"\n" for line in lines))
                    f.flush()
                    os.fsync(f.fileno())
    return len(new), len(new_failed)


def _verified_text(pack_dir: Path, name: str, entry: dict) -> bytes:
    blob = (pack_dir / name).read_bytes()
    if _sha256(blob) != entry["sha256"]:
        raise ValueError(f"{pack_dir / name}: sha256 differs from {MANIFEST}")
    text = gzip.decompress(blob)
    if _sha256(text) != entry["content_sha256"] or text.count(b"\n") != entry["lines"]:
        raise ValueError(f"{pack_dir / name}: content differs from {MANIFEST}")
    return text


def check(pack_dir: Path = PACK_DIR) -> dict:
    """Verify every manifest entry; {file: lines}."""
    return {name: _verified_text(pack_dir, name, entry).count(b"\n") for name, entry in load_manifest(pack_dir).items()}


def unpack(name: str, pack_dir: Path = PACK_DIR, data_dir: Path = DATA_DIR, force: bool = False) -> list[Path]:
    """Restore <name>.jsonl (and its sidecar, if packed) into data_dir; returns the files written."""
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    manifest = load_manifest(pack_dir)
    whole = [n for n in (f"{stem}.jsonl.gz",) if n in manifest] or shard_names(manifest, stem)
    files = ([(f"{stem}.jsonl", whole)] if whole else []) + [
        (f"{stem}.jsonl{SIDECAR}", [n]) for n in (f"{stem}.jsonl{SIDECAR}.gz",) if n in manifest]
    if not whole:
        raise FileNotFoundError(f"{stem}: not in {pack_dir / MANIFEST} (packed: {sorted(manifest)})")
    data_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for target, packed_names in files:
        text = b"".join(_verified_text(pack_dir, n, manifest[n]) for n in packed_names)
        packed = packed_names[0] if len(packed_names) == 1 else f"{stem} ({len(packed_names)} shards)"
        dest = data_dir / target
        if dest.exists() and not force:
            have = dest.read_bytes()
            if not text.startswith(have):
                raise FileExistsError(f"{dest} exists and is not a prefix of the packed file {packed} ({_lines(have)} "
                                      f"vs {_lines(text)} lines); --force replaces it")
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.write_bytes(text)
        os.replace(tmp, dest)
        out.append(dest)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="gzip regenerated .jsonl files into benchmarks/data")
    p.add_argument("paths", nargs="+", type=Path)
    u = sub.add_parser("unpack", help="restore a packed file into data/regenerated")
    u.add_argument("names", nargs="+", help="<name> or <name>.jsonl (as packed)")
    u.add_argument("--force", action="store_true", help="replace an existing file that is not a prefix")
    u.add_argument("--data-dir", type=Path, default=DATA_DIR)
    c = sub.add_parser("check", help="verify every packed file against the manifest")
    sh = sub.add_parser("shard", help="pack the lines added since the last shard into a new shard")
    sh.add_argument("paths", nargs="+", type=Path)
    sh.add_argument("--min-lines", type=int, default=1, help="pack only when at least this many lines are new")
    for q in (p, u, c, sh):
        q.add_argument("--pack-dir", type=Path, default=PACK_DIR)
    m = sub.add_parser("merge", help="append a second process's records (regenerate.py --skip) to the main output")
    m.add_argument("main", type=Path)
    m.add_argument("part", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            for entry in pack(args.paths, args.pack_dir):
                print(f"{entry['file']}: {entry['lines']} lines, {entry['bytes']} -> {entry['gz_bytes']} bytes, "
                      f"sha256 {entry['sha256']}")
        elif args.cmd == "shard":
            for path in args.paths:
                entries = shard(path, args.pack_dir, args.min_lines)
                for entry in entries:
                    print(f"{entry['file']}: {entry['lines']} lines, {entry['bytes']} -> {entry['gz_bytes']} bytes")
                if not entries:
                    print(f"{path}: nothing new to pack")
        elif args.cmd == "unpack":
            for name in args.names:
                for dest in unpack(name, args.pack_dir, args.data_dir, args.force):
                    print(f"{dest}: {_lines(dest.read_bytes())} lines")
        elif args.cmd == "merge":
            records, failures = merge(args.main, args.part)
            print(f"{args.main}: {records} records and {failures} failures appended from {args.part}")
        else:
            for name, lines in check(args.pack_dir).items():
                print(f"{name}: ok, {lines} lines")
    except (OSError, ValueError, OutputBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
