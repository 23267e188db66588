"""MindSpore on Ascend sends each direction between two ranks through its own HCCL group: one group
puts both on one stream, where two ranks that send to each other first wait forever
(``pulse.runtime.rendezvous``; ``tests/test_rendezvous.py`` shows the schedules it hangs)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from mindspore import Tensor  # noqa: E402

from pulse_mindspore.comm import P2P_GROUPS, MindSporeCommunicator  # noqa: E402


class RecordingLib:
    """``mindspore.ops.communication``'s isend/irecv, recording the group of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def isend(self, tensor, dst, group, tag):
        self.calls.append(("isend", dst, group))
        return SimpleNamespace(wait=lambda: None)

    def irecv(self, tensor, src, group, tag):
        self.calls.append(("irecv", src, group))
        return tensor, SimpleNamespace(wait=lambda: None)


def test_each_direction_between_two_ranks_has_its_own_hccl_group() -> None:
    created = []
    mgmt = SimpleNamespace(get_rank=lambda: 1, get_group_size=lambda: 3,
                           create_group=lambda name, ranks: created.append((name, list(ranks))),
                           GlobalComm=SimpleNamespace(WORLD_COMM_GROUP="hccl_world_group"))
    lib = RecordingLib()
    comm = MindSporeCommunicator(device_target="Ascend", lib=lib, management=mgmt, p2p=True)
    assert created == [(name, [0, 1, 2]) for name in P2P_GROUPS]  # every rank makes both, in order
    up, down = P2P_GROUPS
    t = Tensor(np.ones(2, np.float32))
    comm.transport.isend(t, 2)
    comm.transport.isend(t, 0)
    comm.transport.irecv((2,), ms.float32, 2)
    comm.transport.irecv((2,), ms.float32, 0)
    assert lib.calls == [("isend", 2, up), ("isend", 0, down), ("irecv", 2, down), ("irecv", 0, up)]
