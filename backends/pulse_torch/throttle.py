"""Emulate a slow link: a ``Communicator`` wrapper that holds each send for nbytes / bandwidth.

::

    executor ──send(t)──▶ ThrottledCommunicator ──sleep(latency + nbytes/bw)──▶ inner.send(t)

Why sleep *before* the inner send: the receiver then sees the message when a
link of that bandwidth would have delivered it, and the sender is busy for
the transfer time, as a blocking send on such a link keeps it. Sends of one
rank are serialized (one link out of each process); receives, all-reduces
and barriers pass straight through, so data-parallel gradient traffic is not
throttled (the emulation is about pipeline traffic, the part placement changes).

Used by ``python -m pulse_torch.train --emulate-bandwidth BYTES_PER_S``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from pulse.errors import PulseError
from pulse.runtime.protocols import Communicator, Tensor


class ThrottledCommunicator:
    """``inner`` with every send delayed by ``latency + nbytes / bandwidth`` seconds."""

    def __init__(self, inner: Communicator, bandwidth: float, nbytes: Callable[[Tensor], int],
                 latency: float = 0.0) -> None:
        if bandwidth <= 0 or latency < 0:
            raise PulseError(f"emulated link needs bandwidth > 0 and latency >= 0, got {bandwidth} and {latency}")
        self.inner = inner
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self._nbytes = nbytes
        self.throttled_seconds = 0.0  # total time this rank spent "on the wire"

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def bytes_sent(self) -> dict[int, int]:
        return self.inner.bytes_sent

    @property
    def allreduce_bytes(self) -> int:
        return self.inner.allreduce_bytes

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        delay = self.latency + self._nbytes(tensor) / self.bandwidth
        time.sleep(delay)
        self.throttled_seconds += delay
        self.inner.send(tensor, peer_rank, tag, timeout)

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.inner.recv(peer_rank, tag, timeout)

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        return self.inner.all_reduce(tensor, group, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)

    def __getattr__(self, name: str) -> Any:
        # Anything else the inner communicator offers (close(), groups, ...) stays reachable.
        if name == "inner":  # not set yet (mid-construction, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
