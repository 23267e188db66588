"""torch.distributed as ProcessGroupNCCL behaves, for threads standing in for ranks.

``FakeNccl(world).install(monkeypatch)`` replaces the functions of ``torch.distributed`` that
PULSE calls; each thread calls ``fake.join(rank)`` first. Point-to-point messages follow NCCL's
rules (``pulse.runtime.rendezvous``: order matching, one FIFO per stream, a send larger than
``eager_bytes`` completes only with its receive); ``Work.wait()`` blocks its thread until the
operation completed, and when every live thread waits on something that cannot complete, each
of them raises ``DeadlockError`` with the streams' heads. The fake counts what a device would
make the host wait for: a ``wait(timeout=...)`` (ProcessGroupNCCL then polls from the host
instead of ordering the stream) and, through ``count_host_reads``, every read of a tensor's
value on the host (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``float()``), except
torch.optim's reads of its step counters: those live on the host on a device too (Adam's
``state["step"]`` is a CPU tensor unless ``capturable`` or ``fused``).
"""
from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from typing import Any

import torch
import torch.distributed as dist

from pulse.runtime.errors import DeadlockError
from pulse.runtime.rendezvous import RendezvousStreams

HOST_READS = ("cpu", "item", "tolist", "numpy", "__float__")


class FakeGroup:
    def __init__(self, ident: int, ranks: list[int]) -> None:
        self.ident, self.ranks = ident, ranks


class FakeWork:
    def __init__(self, fake: "FakeNccl", done: Any, finish: Any = None, what: str = "") -> None:
        self.fake, self.done, self.finish, self.what = fake, done, finish, what

    def is_completed(self) -> bool:
        with self.fake.cond:
            self.fake.streams.progress()
            return self.done()

    def wait(self, timeout: Any = None) -> bool:
        fake = self.fake
        if timeout is not None:
            fake.host_waits[fake.rank()] += 1
        with fake.cond:
            while True:
                fake.streams.progress()
                if self.done():
                    break
                if fake.failed is not None:
                    raise DeadlockError(fake.failed)
                fake.blocked += 1
                fake.waiting[fake.rank()] = self
                stuck = not any(w.done() for w in fake.waiting.values())  # a woken rank that has not run yet
                if fake.blocked == fake.alive and stuck:  # everyone waits and nothing can move
                    fake.failed = "\n".join(["deadlock: every rank waits"]
                                            + [f"rank {r} waits for {w.what}" for r, w in sorted(fake.waiting.items())]
                                            + fake.streams.heads())
                    fake.cond.notify_all()
                    fake.blocked -= 1
                    fake.waiting.pop(fake.rank(), None)
                    raise DeadlockError(fake.failed)
                fake.cond.wait(timeout=5.0)
                fake.blocked -= 1
                fake.waiting.pop(fake.rank(), None)
            fake.cond.notify_all()
        if self.finish is not None:
            self.finish()
        return True


class FakeNccl:
    def __init__(self, world: int, eager_bytes: int = 0) -> None:
        self.world, self.streams = world, RendezvousStreams(eager_bytes)
        self.cond = threading.Condition()
        self.local = threading.local()
        self.alive, self.blocked, self.failed = world, 0, None
        self.waiting: dict[int, FakeWork] = {}  # rank -> what it waits for
        self.host_waits: Counter = Counter()
        self.host_reads: Counter = Counter()
        self.collectives: dict[tuple, dict] = {}
        self.seq: dict[tuple, int] = defaultdict(int)

    def rank(self) -> int:
        return getattr(self.local, "rank", -1)

    def join(self, rank: int) -> None:
        self.local.rank = rank

    def leave(self) -> None:
        with self.cond:
            self.alive -= 1
            self.cond.notify_all()

    def install(self, monkeypatch: Any) -> "FakeNccl":
        for name in ("is_initialized", "get_rank", "get_world_size", "get_backend", "new_group", "isend",
                     "irecv", "all_reduce", "barrier"):
            monkeypatch.setattr(dist, name, getattr(self, "_" + name))
        return self

    def count_host_reads(self, monkeypatch: Any) -> None:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if self.rank() >= 0 and "torch/optim/" not in caller.replace("\\", "/"):
                    self.host_reads[(self.rank(), _name)] += 1
                return _original(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)

    # -- torch.distributed ------------------------------------------------------------
    def _is_initialized(self) -> bool:
        return True

    def _get_rank(self, group: Any = None) -> int:
        return self.rank()

    def _get_world_size(self, group: Any = None) -> int:
        return len(group.ranks) if group is not None else self.world

    def _get_backend(self, group: Any = None) -> str:
        return "nccl"

    def _new_group(self, ranks: Any = None, **kwargs: Any) -> FakeGroup:
        with self.cond:  # every thread makes the same groups in the same order: the n-th call is group n
            key = ("new_group", self.rank())
            n = self.seq[key]
            self.seq[key] += 1
        return FakeGroup(n, list(ranks) if ranks is not None else list(range(self.world)))

    def _gid(self, group: Any) -> Any:
        return "world" if group is None else group.ident

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: Any = None) -> FakeWork:
        with self.cond:
            op = self.streams.send(self.rank(), dst, self._gid(group), tensor.numel() * tensor.element_size(),
                                   tensor.detach().clone(), "isend")
            self.streams.progress()
            self.cond.notify_all()
        return FakeWork(self, lambda: op.done, what=str(op))

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: Any = None) -> FakeWork:
        with self.cond:
            op = self.streams.recv(self.rank(), src, self._gid(group), tensor.numel() * tensor.element_size(), "irecv")
            self.streams.progress()
            self.cond.notify_all()
        return FakeWork(self, lambda: op.done, lambda: tensor.copy_(op.payload), str(op))

    def _all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False, **kw: Any) -> FakeWork:
        members = tuple(group.ranks) if group is not None else tuple(range(self.world))
        with self.cond:
            key = (members, self.seq[(members, self.rank())])
            self.seq[(members, self.rank())] += 1
            slot = self.collectives.setdefault(key, {})
            slot[self.rank()] = tensor.detach().clone()
            self.cond.notify_all()

        def finish() -> None:
            tensor.copy_(sum(slot[r] for r in members))
        work = FakeWork(self, lambda: len(slot) == len(members), finish, f"all-reduce #{key[1]} over {members}")
        if not async_op:
            work.wait()
            return None
        return work

    def _barrier(self, group: Any = None, async_op: bool = False, **kw: Any) -> FakeWork:
        return self._all_reduce(torch.zeros(1), group, async_op)
