"""CPU ranks of one host pinned to their own cores (``pulse_torch.dist.pin_to_cores``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from pulse.cores import cores_of  # noqa: E402


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


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two cores")
@pytest.mark.parametrize("switch, pinned", [("1", True), ("0", False)])
def test_pin_to_cores_sets_the_process_affinity_unless_switched_off(switch, pinned):
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os; from pulse_torch.dist import pin_to_cores; pin_to_cores(1, 2); "
            "print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PULSE_PIN_CORES": switch}).stdout.strip()
    want = sorted(cores_of(1, 2, allowed)) if pinned else allowed
    assert out == str(want)
