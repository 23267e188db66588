#!/usr/bin/env bash
# Create ./.venv with PULSE, the PyTorch backend, diffusers and the test tools (CPU builds).
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Both backends by default (the tests run every runtime test on each); PULSE_EXTRAS=torch,dev skips MindSpore.
PULSE_EXTRAS=${PULSE_EXTRAS:-torch,mindspore,dev,diffusers,datasets,optimizers}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -m pip install -c constraints/ci.txt -e ".[$PULSE_EXTRAS]" >.venv/pip-install.log 2>&1; then
  grep -v "is ignored" .venv/pip-install.log | tail -n 30 >&2
  echo "setup: pip install failed (full log: .venv/pip-install.log)" >&2
  exit 1
fi
.venv/bin/python -c "import pulse, torch, pulp, yaml, numpy"
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
