"""CPU ranks of one host pinned to their own cores (``pulse.cores.pin_process``; torchrun ranks through
``pulse_torch.dist.pin_to_cores``, msrun workers through ``pulse_mindspore.train.join_cluster``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pulse.cores import cores_of

NEEDS_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs sched_setaffinity and two cores")


@pytest.mark.parametrize("allowed, ranks, expected", [
    ([0, 1], 2, [{0}, {1}]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
    ([2, 5, 7], 2, [{2}, {5}]),  # a taskset mask: its cores, the odd one left out
    ([0, 1], 4, [{0}, {1}, {0}, {1}]),  # more ranks than cores: round-robin
    ([0, 1, 2], 1, [{0, 1, 2}]),
])
def test_each_local_rank_gets_its_own_share_of_the_allowed_cores(allowed, ranks, expected):
    shares = [cores_of(r, ranks, allowed) for r in range(ranks)]
    assert shares == expected
    if ranks <= len(allowed):  # no core given to two ranks
        assert sum(len(s) for s in shares) == len(set().union(*shares))


@NEEDS_AFFINITY
@pytest.mark.parametrize("switch, pinned", [("1", True), ("0", False)])
def test_pin_to_cores_sets_the_process_affinity_unless_switched_off(switch, pinned):
    pytest.importorskip("torch")
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os; from pulse_torch.dist import pin_to_cores; pin_to_cores(1, 2); "
            "print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PULSE_PIN_CORES": switch}).stdout.strip()
    want = sorted(cores_of(1, 2, allowed)) if pinned else allowed
    assert out == str(want)


@NEEDS_AFFINITY
def test_threads_running_before_the_pin_are_pinned_too():
    """A framework's own threads (MindSpore's actor and kernel threads) start before a worker
    pins itself; left on every core they put two ranks' work on one core (pulse.cores.pin_process)."""
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, threading; from pulse.cores import pin_process\n"
            "ready, leave = threading.Event(), threading.Event()\n"
            "ids = []\n"
            "def early():\n"
            "    ids.append(threading.get_native_id()); ready.set(); leave.wait()\n"
            "t = threading.Thread(target=early); t.start(); ready.wait()\n"
            "pin_process(1, 2)\n"
            "print(sorted(os.sched_getaffinity(ids[0])), sorted(os.sched_getaffinity(0)))\n"
            "leave.set(); t.join()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PULSE_PIN_CORES": "1"}).stdout.strip()
    want = sorted(cores_of(1, 2, allowed))
    assert out == f"{want} {want}"
