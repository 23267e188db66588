#!/usr/bin/env bash
# Create ./.venv with PULSE, the PyTorch backend, diffusers and the test tools (CPU builds).
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Both backends by default (the tests run every runtime test on each); PULSE_EXTRAS=torch,dev skips MindSpore.
PULSE_EXTRAS=${PULSE_EXTRAS:-torch,mindspore,dev,diffusers,datasets,optimizers}
NEED_GB=6  # the environment takes about 4.5 GB (torch, MindSpore, diffusers) and pip unpacks beside it
if [ ! -x .venv/bin/python ]; then
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-$NEED_GB}" -lt "$NEED_GB" ]; then
    echo "setup: ${free_gb} GB free on $(df -P . | awk 'NR == 2 {print $6}'), the environment needs about $NEED_GB GB: free some space and rerun" >&2
    exit 1
  fi
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -m pip install -c constraints/ci.txt -e ".[$PULSE_EXTRAS]" >.venv/pip-install.log 2>&1; then
  grep -v "is ignored" .venv/pip-install.log | tail -n 30 >&2
  if grep -q "No space left on device" .venv/pip-install.log; then
    echo "setup: the disk filled while installing ($(df -Ph . | awk 'NR == 2 {print $4}') free now); the environment needs about $NEED_GB GB: free some space and rerun" >&2
  fi
  echo "setup: pip install failed (full log: .venv/pip-install.log)" >&2
  exit 1
fi
.venv/bin/python -c "import pulse, torch, pulp, yaml, numpy"
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
