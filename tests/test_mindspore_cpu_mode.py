"""``pulse_mindspore.cpu_mode``: on a CPU, importing PULSE's cells makes MindSpore run each op where it is
launched, from the process's first op on, so PyNative's queue threads never start (once started they stay and
spin: ``launch_blocking_on_cpu``'s measurement). Each case in a fresh process; a plain MindSpore process
starts them, which shows the check can fail."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

ROOT = Path(__file__).resolve().parents[1]
STEPS = """
import os, sys
import numpy as np
import mindspore as ms
if sys.argv[1] == "pulse":
    import pulse_mindspore.layers  # noqa: F401
from mindspore import Tensor, nn, ops
conv, norm = nn.Conv2d(4, 4, 3, pad_mode="pad", padding=1), nn.GroupNorm(2, 4)
step = ms.value_and_grad(lambda x: ops.sum(norm(conv(x)) ** 2), None, conv.trainable_params() + norm.trainable_params())
for _ in range(5):
    loss, _ = step(Tensor(np.ones((1, 4, 8, 8), np.float32)))
loss.asnumpy()
names = {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
print(" ".join(sorted(n for n in names if n.endswith("_queue"))))
"""


def queue_threads(mode: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{ROOT / 'backends'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


def test_ops_after_importing_pulses_cells_start_no_queue_thread() -> None:
    assert queue_threads("plain") & {"frontend_queue", "backend_queue"}  # MindSpore's default: asynchronous
    assert queue_threads("pulse") == set()
