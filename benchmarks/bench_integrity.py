"""Cost of the checksums (dspark.integrity): sha256 of in-memory bytes and of a file read back, in ms per GB,
and a checkpoint write with its sidecar vs the plain atomic write, in one run (ratios are what to compare).

    python benchmarks/bench_integrity.py --gb 1
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from dspark.integrity import digest_bytes, digest_file, write_checked
from dspark.io import atomic_write_bytes


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    data = os.urandom(int(args.gb * 2**30))
    gb = len(data) / 2**30
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        path = Path(tmp) / "blob.bin"
        t_mem = best_of(lambda: digest_bytes(data), args.repeat)
        atomic_write_bytes(path, data)
        t_file = best_of(lambda: digest_file(path), args.repeat)  # page cache warm: the hash, not the disk
        t_plain = best_of(lambda: atomic_write_bytes(path, data), args.repeat)
        t_checked = best_of(lambda: write_checked(path, data), args.repeat)
    print(f"{gb:.2f} GB: sha256 in memory {1000 * t_mem / gb:.0f} ms/GB, of a cached file {1000 * t_file / gb:.0f} ms/GB; "
          f"atomic write {1000 * t_plain / gb:.0f} ms/GB, with checksum sidecar {1000 * t_checked / gb:.0f} ms/GB "
          f"(x{t_checked / t_plain:.2f})")


if __name__ == "__main__":
    main()
