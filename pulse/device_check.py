"""What this node's device can do, asked of the backend before `pulse train` launches anything.

::

    pulse train --precision bf16 ─▶ python -m pulse_torch.device_support      (torch, torch_npu)
                                 or python -m pulse_mindspore.device_support  (MindSpore on Ascend)
                                 ─▶ one JSON line: {"device", "name", "bf16_refusal"}
                                 ─▶ a refusal is one line, exit 2, before the launcher starts

The core never imports a framework, so it asks in a child process, and only where the answer
can refuse something (bf16 today: a V100 or an Ascend 910A has none). Every rank asks again
itself (a rank started by hand is checked too; a MindSpore worker through
``pulse_mindspore.traits.check_options``, which is why this lives in the core and not the command
line); a probe that cannot answer leaves it to them.
"""
from __future__ import annotations

import json
import subprocess
import sys

from pulse.errors import PulseError

PROBE_SECONDS = 180.0  # importing torch_npu or MindSpore and opening the device can take a while


def probe(module: str) -> dict:
    """The backend probe's answer (empty when it could not give one: the ranks check again)."""
    try:
        out = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]  # past any library banner
    if out.returncode != 0 or not lines:
        return {}
    try:
        answer = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}


def check_precision(precision: str, module: str) -> None:
    """Refuse ``--precision bf16`` in one line where this node's device has no bf16."""
    if precision != "bf16":
        return
    refusal = probe(module).get("bf16_refusal")
    if refusal:
        raise PulseError(str(refusal))
