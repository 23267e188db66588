"""PULSE's emulated link under torch.distributed.pipelining's point-to-point messages.

pipelining sends and receives through two functions of
``torch.distributed.pipelining.schedules``: ``_batch_p2p`` (isend/irecv each
op; on gloo ``batch_isend_irecv`` issues the ops one by one too, gloo has no
coalescing) and ``_wait_batch_p2p`` (``work.wait()`` on each). ``install``
replaces ``_batch_p2p`` with one that issues the same ops one by one and:

* counts every byte handed to ``isend`` (the wire's payload: the benchmark's
  "bytes per step");
* with a bandwidth, passes every send through PULSE's own
  ``ThrottledCommunicator.send_group`` (the rank's outbound link, then the
  receiver's inbound link booked on the host's shared board,
  ``pulse_torch.emulation.link_board``: the same code ``pulse train --emulate-bandwidth``
  runs), and every receive, once its ``wait()`` returns, through its
  ``recv_group``, which sleeps until the message would have landed;

The landing time a sender computes travels beside the message, not in it: the
sender writes it into a per-(sender, receiver) file of the host before its
``isend``; the receiver reads entry k for its k-th receive posted from that
sender (gloo matches a pair's messages in the order they were posted, which
pipelining relies on already). So the wire carries exactly the tensors
pipelining sends, and the stamps cost no message. PULSE's communicator
carries its stamp in the message header instead (``pulse_torch.comm``).

Metadata exchanges pipelining makes outside ``_batch_p2p`` (shape inference
and the warm-up vote, step 0 only) are neither throttled nor counted. The ops
keep pipelining's own process group (the default one: gloo, one connection
per rank pair); PULSE's communicator opens one per direction
(``pulse_torch.dist.direction_groups``). Each side runs as its user gets it.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Wire:
    """The inner communicator ``ThrottledCommunicator`` drives: ``send_group`` writes the landing stamp
    and issues the isends; ``recv_group`` (called once the receive has completed) reads the stamp."""

    def __init__(self, rank: int, stamps: Path) -> None:
        self.rank = rank
        self.bytes_sent: dict[int, int] = {}
        self.allreduce_bytes = 0
        self.last_stamp = 0
        self.works: list[Any] = []  # the isends the last send_group issued
        self.op: Any = None  # the P2POp being sent (its group and peer)
        self.sent: dict[int, int] = {}  # per peer: stamps written
        self.reading: tuple[int, int] = (0, 0)  # (peer, index) the next recv_group reads
        self._fds: dict[tuple[int, int], int] = {}
        self._stamps = stamps

    def open_files(self, world: int) -> None:
        for a in range(world):
            for b in range(world):
                if a != b and self.rank in (a, b):
                    self._fds[(a, b)] = os.open(self._stamps / f"stamps-{a}-{b}", os.O_RDWR | os.O_CREAT, 0o600)

    def send_group(self, tensors: Sequence[torch.Tensor], peer: int, tags: Sequence[Any], timeout: Any = None,
                   stamp: int = 0) -> None:
        """Note ``stamp`` (when the message lands) for the receiver, then isend each tensor."""
        k = self.sent.get(peer, 0)
        os.pwrite(self._fds[(self.rank, peer)], struct.pack("q", stamp), 8 * k)
        self.sent[peer] = k + 1
        op = self.op
        self.works = [dist.isend(t, group=op.group, tag=op.tag, group_dst=op.group_peer) for t in tensors]

    def recv_group(self, peer: int, tags: Sequence[Any], timeout: Any = None) -> list[torch.Tensor]:
        peer, k = self.reading
        (self.last_stamp,) = struct.unpack("q", os.pread(self._fds[(peer, self.rank)], 8, 8 * k))
        return []

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Arrival:
    """A posted irecv; ``wait()`` waits for it, then for the emulated link to deliver it."""

    def __init__(self, work: Any, link: "Link", peer: int, index: int) -> None:
        self.work, self.link, self.peer, self.index = work, link, peer, index

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        if self.link.throttle is not None:
            self.link.wire.reading = (self.peer, self.index)
            self.link.throttle.recv_group(self.peer, [0])
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class Link:
    """This rank's side of the emulated link (``bandwidth`` bytes/s each way, None: unthrottled)."""

    def __init__(self, bandwidth: float | None) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        where = [_shared_directory() if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        self.wire = _Wire(rank, Path(where[0]))
        self.wire.open_files(world)
        self.throttle = None
        if bandwidth:
            from pulse_torch.emulation.link_board import shared_links_of_job
            from pulse_torch.emulation.throttle import ThrottledCommunicator

            self.throttle = ThrottledCommunicator(self.wire, bandwidth, nbytes, links=shared_links_of_job())
        dist.barrier()  # every rank holds its files open: the directory can go
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
        self.bytes = 0  # payload bytes this rank handed to isend
        self.posted: dict[int, int] = {}  # per peer: receives posted

    @property
    def waited_seconds(self) -> float:
        return self.throttle.throttled_seconds if self.throttle is not None else 0.0

    def batch_p2p(self, ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
        """What ``schedules._batch_p2p`` does on gloo, each op through the emulated link."""
        works: list[Any] = []
        for op in ops:
            if op.op is dist.isend:
                works += self._send(op)
            else:
                peer = op.peer
                index = self.posted.get(peer, 0)
                self.posted[peer] = index + 1
                work = dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
                works.append(_Arrival(work, self, peer, index))
        return works

    def _send(self, op: dist.P2POp) -> list[Any]:
        tensor = op.tensor
        self.bytes += nbytes(tensor)
        if self.throttle is None:
            return [dist.isend(tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)]
        self.wire.op = op
        self.throttle.send_group([tensor], op.peer, [0])
        return self.wire.works

    def close(self) -> None:
        self.wire.close()
        if self.throttle is not None:
            self.throttle.links.close()


def _shared_directory() -> str:
    from pulse_torch.emulation.link_board import board_directory

    return board_directory()


def install(link: Link) -> None:
    """Route pipelining's point-to-point ops through ``link`` (this process, from now on)."""
    from torch.distributed.pipelining import schedules

    schedules._batch_p2p = link.batch_p2p
