#!/usr/bin/env bash
# SGLang 0.5.23's DSpark STS calibration parser (sglang/srt/speculative/dspark_components/dspark_sts.py: the
# `DSparkStsCalibration` that `--speculative-dspark-confidence-sts-path` reads), unzipped alone from the sglang==0.5.23
# wheel (no install: SGLang itself is not needed) into .cache/sglang-0.5.23-src, plus msgspec (that file's only import
# besides torch; SGLang 0.5.23 requires it unpinned) into the active environment. tests/export/test_sts_file.py
# parses dspark's written files with it. ~40 MB download once; prints the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/sglang-0.5.23-src
file=sglang/srt/speculative/dspark_components/dspark_sts.py
if [ ! -f "$dest/$file" ]; then
  mkdir -p .cache/wheels "$dest"
  ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps sglang==0.5.23 -d .cache/wheels
  python - "$dest" "$file" .cache/wheels/sglang-0.5.23-*.whl <<'PY'
import sys, zipfile
dest, name, wheel = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    z.extract(name, dest)
PY
fi
python -c "import msgspec" 2>/dev/null || python -m pip install -q msgspec   # also in the test extra
echo "$dest"
