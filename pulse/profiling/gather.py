"""The ranks of a profile, and what each learns from the others through the communicator alone.

::

    gather(obj): rank r writes obj as JSON into row r of a (world x longest) float32 matrix,
                 zeros elsewhere; one all-reduce (sum) over the world and every rank holds every row

Why not ``torch.distributed.all_gather_object``: MindSpore has no object
collectives, and on a CPU its ``mccl`` has all-reduce and nothing else (no
broadcast, no send/recv). A sum where only one rank writes each element is
exact in float32 for byte values, so one all-reduce carries any byte string
on every backend. Why JSON, not pickle: the bytes come from other processes
over the network, and unpickling runs whatever code the bytes name; JSON can
say numbers, strings, lists, string-keyed dicts and null, nothing that runs.
What the profile gathers is that already (tuples come back as lists).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pulse.errors import PulseError
from pulse.train.loop import StepCommunicator
from pulse.runtime.protocols import Backend


ARRIVED, RELEASED = 91, 92  # a message barrier's tags: no other message of a profile uses them


@dataclass
class Ranks:
    """This rank of a profile job: its communicator, and a backend for host arrays <-> tensors."""

    comm: StepCommunicator  # messages, all-reduce, barrier, wait_sends
    tensors: Backend  # only from_numpy / to_numpy
    rank: int
    world: int
    # MindSpore on a CPU: an mccl collective gives up after a wait far shorter than the time one rank
    # may still measure while another already waits ("Reduce wait receiving failed"); a barrier of
    # messages (every rank to rank 0, then back) waits as long as the communicator's timeout
    barrier_by_messages: bool = False

    def barrier(self) -> None:
        if not self.barrier_by_messages or self.world == 1:
            self.comm.barrier()
            return
        token = self.tensors.from_numpy(np.zeros(1, dtype=np.float32))
        if self.rank == 0:
            for peer in range(1, self.world):
                self.comm.recv(peer, ARRIVED)
            for peer in range(1, self.world):
                self.comm.send(token, peer, RELEASED)
        else:
            self.comm.send(token, 0, ARRIVED)
            self.comm.recv(0, RELEASED)
        self.comm.wait_sends()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (every rank must call this)."""
        if self.world == 1:
            return [obj]
        mine = np.frombuffer(to_wire(obj), dtype=np.uint8)
        lengths = np.zeros(self.world, dtype=np.float32)
        lengths[self.rank] = mine.size
        lengths = self._sum(lengths).astype(np.int64)
        rows = np.zeros((self.world, int(lengths.max())), dtype=np.float32)
        rows[self.rank, :mine.size] = mine
        rows = self._sum(rows)
        return [from_wire(rows[r, :lengths[r]].astype(np.uint8).tobytes(), r) for r in range(self.world)]

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of every rank's ``values`` (a pair's figures, from whichever side saw them)."""
        return [max(column) for column in zip(*self.gather(list(values)))]

    def _sum(self, array: np.ndarray) -> np.ndarray:
        summed = self.comm.all_reduce(self.tensors.from_numpy(array), list(range(self.world)))
        return np.asarray(self.tensors.to_numpy(summed))


def to_wire(obj: Any) -> bytes:
    """``obj`` as JSON bytes (numpy scalars as numbers); TypeError for anything JSON cannot say."""
    return json.dumps(obj, default=_plain_number).encode()


def from_wire(data: bytes, rank: int) -> Any:
    """Rank ``rank``'s object back from its bytes: data only; bytes that are not JSON are refused."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PulseError(f"rank {rank} sent profile figures that are not JSON ({exc}); every rank of a "
                         "profile must run this version of pulse") from None


def _plain_number(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a {type(value).__name__} cannot cross ranks (JSON: numbers, strings, lists, dicts)")
