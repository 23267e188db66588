"""Every rank's emulated inbound link, where all of a host's ranks can book it.

A sender books its message's stretch of the receiver's inbound link at the
moment it sends (``pulse.link_slots.take_slot``), as ``pulse.sim.program``
does: a link carries the bytes when they are sent, not when the receiver gets
round to asking for them. With two senders feeding one receiver, only a board
both can write keeps their messages in the order they were sent.

``pulse.link_slots.InboundLinks``: one process (tests, a single rank).
``SharedLinks``: one small file per receiving rank in a directory of the host
(``/dev/shm`` where there is one), read and rewritten under ``fcntl.flock``
while a sender takes its slot. Stretches that ended before the
booking sender's ready stamp are dropped as it goes: they can block nothing, and
the file stays a few stretches long. Every rank opens every file before the job starts, and
then the directory is removed: the open files live on, and a job that is killed
leaves nothing behind.
"""
from __future__ import annotations

import array
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from pulse.link_slots import take_slot

_SLOT_WIDTH = 16  # bytes of one (start, end) pair of int64 microseconds


def now_us() -> int:
    """CLOCK_MONOTONIC in microseconds: one clock for every process of a host (the emulation's stamps)."""
    return time.monotonic_ns() // 1000


class SharedLinks:
    """Inbound links booked by the senders of every process of one host: ``directory`` holds one
    file per receiving rank, the (start, end) pairs its link gave."""

    def __init__(self, directory: str | os.PathLike, receivers: range | None = None,
                 clock: Callable[[], int] = now_us) -> None:
        self.directory = Path(directory)
        self.clock = clock  # the stamps' clock: stretches ended by its present are dropped
        self._fds: dict[int, int] = {}
        for receiver in receivers or ():
            self._fd(receiver)

    def _fd(self, receiver: int) -> int:
        if receiver not in self._fds:
            self._fds[receiver] = os.open(self.directory / f"inbound-{receiver}", os.O_RDWR | os.O_CREAT, 0o600)
        return self._fds[receiver]

    def book(self, receiver: int, ready: int, hold: int) -> int:
        """As ``InboundLinks.book``, while no other sender of the host books ``receiver``'s link."""
        fd = self._fd(receiver)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            flat = array.array("q")
            flat.frombytes(os.pread(fd, os.fstat(fd).st_size, 0))
            # a stretch that ended before this sender's ready stamp can block nothing; one that ended only
            # since (the stamp was taken before the lock, and a loaded host may hand the lock over late)
            # still can: kept, or the new stretch would overlap it
            horizon = min(self.clock(), ready)
            slots = [(begin, end) for begin, end in zip(flat[0::2], flat[1::2]) if end > horizon]
            start = take_slot(slots, ready, hold)
            kept = array.array("q", [v for slot in slots for v in slot])
            os.pwrite(fd, kept.tobytes(), 0)
            os.ftruncate(fd, len(slots) * _SLOT_WIDTH)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return start

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def board_directory() -> str:
    """A fresh directory for one job's board, in memory where the host allows."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="pulse-links-", dir=base)


def shared_links_of_job() -> SharedLinks:
    """Rank 0 makes the board's directory and every rank of the process group learns it and opens
    every rank's file; then rank 0 removes the directory. Collective: every rank calls it, once."""
    import torch.distributed as dist

    where = [board_directory() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    links = SharedLinks(where[0], range(dist.get_world_size()))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0], ignore_errors=True)
    return links
