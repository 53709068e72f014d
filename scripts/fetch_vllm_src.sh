#!/usr/bin/env bash
# The vllm==0.33.0 wheel's Python sources (no install: the GPU build cannot run here) unzipped into
# .cache/vllm-0.33.0-src/vllm, which tests/export/test_vllm_source.py reads to run vLLM's own rule functions against the
# project's copies. ~340 MB download once; prints the folder.
# Then vllm==0.34.0's (docs/serving.md, tests/export/test_vllm034_source.py): only the files listed below, plus
# WHEEL_FILES.txt (every vllm/*.py path of that wheel: what 0.34.0 removed), into .cache/vllm-0.34.0-src. ~240 MB
# download once; prints that folder too.
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

dest34=.cache/vllm-0.34.0-src
files34=(
  vllm/_version.py
  vllm/config/speculative.py
  vllm/config/vllm.py
  vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py
  vllm/envs.py
  vllm/model_executor/model_loader/default_loader.py
  vllm/model_executor/models/interfaces.py
  vllm/model_executor/models/llama_eagle3.py
  vllm/model_executor/models/qwen3_dflash.py
  vllm/model_executor/models/qwen3_dflash2.py
  vllm/model_executor/models/qwen3_dspark.py
  vllm/model_executor/models/registry.py
  vllm/model_executor/models/utils.py
  vllm/models/deepseek_v4/attention.py
  vllm/models/deepseek_v4/common/rope.py
  vllm/models/deepseek_v4/cpu/cpu_mla.py
  vllm/models/deepseek_v4/cpu/cpu_sparse.py
  vllm/models/deepseek_v4/cpu/model.py
  vllm/models/deepseek_v4/nvidia/dspark.py
  vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py
  vllm/models/deepseek_v4/nvidia/flashmla.py
  vllm/models/deepseek_v4/nvidia/model.py
  vllm/models/deepseek_v4/nvidia/mtp.py
  vllm/models/deepseek_v41/attention.py
  vllm/models/deepseek_v41/nvidia/dspark.py
  vllm/models/deepseek_v41/nvidia/model.py
  vllm/models/deepseek_v41/quant_config.py
  vllm/models/hy_v4/nvidia/attention.py
  vllm/models/hy_v4/nvidia/mtp.py
  vllm/models/mistral/mistral_large4/nvidia/dspark.py
  vllm/platforms/cpu.py
  vllm/transformers_utils/configs/deepseek_v41.py
  vllm/transformers_utils/configs/eagle.py
  vllm/transformers_utils/configs/hy_v4.py
  vllm/transformers_utils/configs/mistral.py
  vllm/transformers_utils/configs/speculators/algos.py
  vllm/transformers_utils/configs/speculators/base.py
  vllm/v1/attention/backend.py
  vllm/v1/attention/backends/mla/compressor_utils.py
  vllm/v1/attention/backends/mla/sparse_swa.py
  vllm/v1/attention/ops/metadata.py
  vllm/v1/core/sched/scheduler.py
  vllm/v1/worker/cpu/model_runner.py
  vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py
  vllm/v1/worker/gpu/spec_decode/adaptive_verification.py
  vllm/v1/worker/gpu/spec_decode/dflash/speculator.py
  vllm/v1/worker/gpu/spec_decode/dflash2/config.py
  vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py
  vllm/v1/worker/gpu/spec_decode/dspark/config.py
  vllm/v1/worker/gpu/spec_decode/dspark/speculator.py
  vllm/v1/worker/gpu/spec_decode/dspark/utils.py
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
  vllm/v1/worker/gpu/spec_decode/eagle/utils.py
  vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py
  vllm/v1/worker/gpu/spec_decode/mtp/speculator.py
  vllm/v1/worker/gpu/spec_decode/rejection_sampler.py
  vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py
  vllm/v1/worker/gpu/spec_decode/speculator.py
  vllm/v1/worker/gpu/spec_decode/speculator_config.py
  vllm/v1/worker/gpu/spec_decode/utils.py
)
if [ ! -f "$dest34/WHEEL_FILES.txt" ] || ! (cd "$dest34" && ls "${files34[@]}" >/dev/null 2>&1); then
  mkdir -p .cache/wheels "$dest34"
  ls .cache/wheels/vllm-0.34.0-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps vllm==0.34.0 -d .cache/wheels
  python - "$dest34" .cache/wheels/vllm-0.34.0-*.whl "${files34[@]}" <<'PY'
import sys, zipfile
dest, wheel, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    listing = sorted(n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py"))
    missing = sorted(set(names) - set(listing))
    if missing:
        sys.exit(f"{wheel} lacks {missing}")
    z.extractall(dest, names)
with open(f"{dest}/WHEEL_FILES.txt", "w") as fh:  # written last: its presence means the unzip finished
    fh.write("\n".join(listing) + "\n")
PY
fi
echo "$dest34"
