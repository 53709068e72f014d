#!/usr/bin/env bash
# The vllm==0.33.0 wheel's Python sources (no install: the GPU build cannot run here) unzipped into
# .cache/vllm-0.33.0-src/vllm, which tests/export/test_vllm_source.py reads to run vLLM's own rule functions against the
# project's copies. ~340 MB download once; prints the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/vllm-0.33.0-src
if [ ! -d "$dest/vllm" ]; then
  mkdir -p .cache/wheels "$dest"
  ls .cache/wheels/vllm-0.33.0-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps vllm==0.33.0 -d .cache/wheels
  python - "$dest" .cache/wheels/vllm-0.33.0-*.whl <<'PY'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PY
fi
echo "$dest"
