"""Freeze one data size of the SmolLM2 scaling comparison: the first complete records of the regenerated ShareGPT file
and of the reasoning-gym file, interleaved at a fixed reasoning-gym share s (so the held-out tail holds both sources):
record k of the mix is reasoning-gym iff floor((k + 1) s) > floor(k s), floor(N s) of them in all.

    python scripts/mix_regenerated.py SHAREGPT.jsonl REASONING_GYM.jsonl OUT.jsonl N [S]

S is a fraction P/Q (default 1/4: the 3:1 mixes of the earlier scaling rows, N = 3,000 and 4,696); the 30k set's
data-size curve uses 27/50 (N = 30,000: 13,800 ShareGPT + 16,200 reasoning-gym, all the set has).

The sources grow while scripts/regenerate_at_scale.sh runs; the mix is written once (atomically) so that every
draft of a size trains on the same bytes and the feature caches keep their key. A record is a line ending in "\\n":
never str.splitlines, which also breaks at U+2028 / U+0085 that json.dumps(ensure_ascii=False) leaves raw in strings.
A larger N's mix starts with a smaller N's (both take prefixes of the sources in the same 3:1 order).
"""
from __future__ import annotations

import sys
from fractions import Fraction
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


def mix(sharegpt: Path, reasoning_gym: Path, n: int, rg_share: Fraction = Fraction(1, 4)) -> list[str]:
    if not 0 <= rg_share <= 1:
        raise SystemExit(f"reasoning-gym share {rg_share} is not within [0, 1]")
    is_rg = [(k + 1) * rg_share // 1 > k * rg_share // 1 for k in range(n)]
    n_rg = sum(is_rg)
    a = iter(complete_records(sharegpt, n - n_rg))
    b = iter(complete_records(reasoning_gym, n_rg))
    return [next(b) if rg else next(a) for rg in is_rg]


def main(argv: list[str]) -> None:
    if len(argv) not in (4, 5):
        raise SystemExit("usage: python scripts/mix_regenerated.py SHAREGPT.jsonl REASONING_GYM.jsonl OUT.jsonl N [P/Q]")
    sharegpt, rg, out, n = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3])
    share = Fraction(argv[4]) if len(argv) == 5 else Fraction(1, 4)
    mixed = mix(sharegpt, rg, n, share)
    atomic_write_bytes(out, "".join(mixed).encode("utf-8"))
    n_rg = n * share // 1
    print(f"{out}: {len(mixed)} records ({n - n_rg} ShareGPT + {n_rg} reasoning-gym)")


if __name__ == "__main__":
    main(sys.argv[1:])
