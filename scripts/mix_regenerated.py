"""Freeze one data size of the SmolLM2 scaling comparison: the first 3N/4 complete records of the regenerated ShareGPT
file and the first N/4 of the reasoning-gym file, interleaved 3:1 (so the held-out tail holds both sources).

    python scripts/mix_regenerated.py SHAREGPT.jsonl REASONING_GYM.jsonl OUT.jsonl N

The sources grow while scripts/regenerate_at_scale.sh runs; the mix is written once (atomically) so that every
draft of a size trains on the same bytes and the feature caches keep their key. A record is a line ending in "\\n":
never str.splitlines, which also breaks at U+2028 / U+0085 that json.dumps(ensure_ascii=False) leaves raw in strings.
A larger N's mix starts with a smaller N's (both take prefixes of the sources in the same 3:1 order).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from dspark.io import atomic_write_bytes  # noqa: E402


def complete_records(path: Path, k: int) -> list[str]:
    """The first k newline-terminated lines of path (a partial last line, still being appended, is not one)."""
    lines = [line + "\n" for line in path.read_text(encoding="utf-8").split("\n")[:-1]][:k]
    if len(lines) < k:
        raise SystemExit(f"{path}: {len(lines)} complete records, {k} needed: let scripts/regenerate_at_scale.sh "
                         "run longer")
    return lines


def mix(sharegpt: Path, reasoning_gym: Path, n: int) -> list[str]:
    n_rg = n // 4
    a, b = complete_records(sharegpt, n - n_rg), complete_records(reasoning_gym, n_rg)
    mixed: list[str] = []
    for i, line in enumerate(a):
        mixed.append(line)
        if i % 3 == 2 and b:
            mixed.append(b.pop(0))
    return mixed + b


def main(argv: list[str]) -> None:
    sharegpt, rg, out, n = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3])
    mixed = mix(sharegpt, rg, n)
    atomic_write_bytes(out, "".join(mixed).encode("utf-8"))
    print(f"{out}: {len(mixed)} records ({n - n // 4} ShareGPT + {n // 4} reasoning-gym)")


if __name__ == "__main__":
    main(sys.argv[1:])
