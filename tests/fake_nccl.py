"""torch.distributed as ProcessGroupNCCL behaves, for threads standing in for ranks.

``FakeNccl(world).install(monkeypatch)`` replaces the functions of ``torch.distributed`` that
PULSE calls; each thread calls ``fake.join(rank)`` first and ``fake.leave(error)`` last.
Point-to-point messages follow NCCL's rules (``pulse.runtime.rendezvous``: order matching, one
FIFO per stream, a send larger than ``eager_bytes`` completes only with its receive);
``Work.wait()`` blocks its thread until the operation completed, and when every live thread waits
on something that cannot complete, each of them raises ``DeadlockError`` with the streams' heads,
or ``PeerFailed`` when a rank that left with an error is why (a crash is not a deadlock).

As strict as a device about what NCCL does silently (each raises ``MessageMisuse``)::

    sender                                    receiver
    isend(buf)  ── SentBuffer beside the bytes: (sender, seq, label), a reference to buf,
                   buf._version and a private snapshot (never delivered)
                   completion reads buf (NCCL reads it asynchronously, up to then) ─▶ irecv(out)
    buf modified or gone before the completion, or before wait() /   out's bytes remembered
    is_completed() said it was done: MessageMisuse                   with the SentBuffer; a
                                                                     receive labelled otherwise,
                                                                     or a consumer that takes it as
                                                                     another message: MessageMisuse

Labels: ``with fake.labelled(x):`` names the isends and irecvs inside (a send's n-th part in it
is ``(x, n)``'s part n); ``label_messages`` names every ``pulse_torch.comm`` message by its tag
and checks what ``recv_group`` hands the executor against them. ``mailbox=True`` gives gloo's
rules instead (matched by tag, every send buffered: the mailbox network the NCCL runs are
compared with). The fake counts what a device would make the host wait for: a
``wait(timeout=...)`` (ProcessGroupNCCL then polls from the host instead of ordering the stream)
and, through ``count_host_reads``, every read of a tensor's value on the host (``.cpu()``,
``.item()``, ``.tolist()``, ``.numpy()``, ``float()``), except torch.optim's reads of its step
counters: those live on the host on a device too (Adam's ``state["step"]`` is a CPU tensor unless
``capturable`` or ``fused``).
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.distributed as dist

from pulse.runtime.errors import DeadlockError
from pulse.runtime.rendezvous import P2POp, RendezvousStreams

HOST_READS = ("cpu", "item", "tolist", "numpy", "__float__")
BUFFERED = 1 << 62  # mailbox mode: every send completes at once, its bytes read then


class MessageMisuse(AssertionError):
    """What a device would do silently: a receive given another message than the one its sender
    meant for it, or a send buffer modified or released before its send completed."""


class PeerFailed(RuntimeError):
    """Every live rank waits, and a rank that left with an error is why: a crash, not a deadlock
    (a RuntimeError, as ProcessGroupNCCL raises one: ``pulse_torch.comm`` reports a failure)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare (NaN equals itself here)."""
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class SentBuffer:
    """One isend as it travels beside its bytes: who sent it, which message it is, and its buffer."""

    sender: int
    peer: int
    label: Hashable  # the sender's name for it (``labelled``), None when unnamed
    ref: Any  # weakref to the tensor isend was given: the fake keeps it no more alive than NCCL does
    version: int
    data_ptr: int
    snapshot: torch.Tensor | None  # a private copy to compare with, dropped once released
    seq: int = -1  # its position among the sender's messages on its channel
    part: int = 0  # its position among the sends made under one label
    parts: int = 1
    read: torch.Tensor | None = None  # its bytes as the completion read them: what the receive gets
    released: bool = False  # waited for, or seen completed: the sender may reuse the buffer

    def __str__(self) -> str:
        name = "unlabelled" if self.label is None else f"{self.label!r} part {self.part + 1}/{self.parts}"
        return f"rank {self.sender}'s send #{self.seq} to rank {self.peer} ({name})"

    def check(self, moment: str) -> None:
        """The buffer as isend saw it, or MessageMisuse naming what happened to it before ``moment``."""
        t = self.ref()
        if t is None:
            raise MessageMisuse(f"the buffer of {self} was freed before {moment}: NCCL reads it until then")
        if t.data_ptr() != self.data_ptr or t.untyped_storage().nbytes() == 0:
            raise MessageMisuse(f"the storage of {self}'s buffer was released before {moment}")
        if t._version != self.version or not torch.equal(_bytes(t), _bytes(self.snapshot)):
            raise MessageMisuse(f"the buffer of {self} was written (version {self.version} -> {t._version}) "
                                f"before {moment}: NCCL reads it asynchronously until then")


@dataclass(eq=False)
class PostedRecv:
    expected: Hashable  # the label the receiver posted it under, None when unnamed


@dataclass
class _Labelling:
    label: Hashable
    sends: list[SentBuffer] = field(default_factory=list)


class FakeGroup:
    def __init__(self, ident: int, ranks: list[int]) -> None:
        self.ident, self.ranks = ident, ranks


class FakeWork:
    def __init__(self, fake: "FakeNccl", done: Callable[[], bool], finish: Any = None, what: str = "",
                 sent: SentBuffer | None = None, guard: Callable[[], None] | None = None) -> None:
        self.fake, self.done, self.finish, self.what = fake, done, finish, what
        self.sent, self.guard = sent, guard

    def is_completed(self) -> bool:
        with self.fake.cond:
            self.fake.progress()
            if not self.done():
                return False
            if self.sent is not None:
                self.fake.release(self.sent, "is_completed() said it was done")
            return True

    def wait(self, timeout: Any = None) -> bool:
        fake = self.fake
        if timeout is not None:
            fake.host_waits[fake.rank()] += 1
        with fake.cond:
            while True:
                fake.progress()
                if self.done():
                    break
                fake.raise_if_failed()
                fake.blocked += 1
                fake.waiting[fake.rank()] = self
                stuck = not any(w.done() for w in fake.waiting.values())  # a woken rank that has not run yet
                if fake.blocked == fake.alive and stuck:  # everyone waits and nothing can move
                    fake.declare_stuck()
                    fake.blocked -= 1
                    fake.waiting.pop(fake.rank(), None)
                    fake.raise_if_failed()
                fake.cond.wait(timeout=5.0)
                fake.blocked -= 1
                fake.waiting.pop(fake.rank(), None)
            fake.cond.notify_all()
            if self.sent is not None:
                fake.release(self.sent, "its work's wait()")
            if self.guard is not None:
                self.guard()
        if self.finish is not None:
            self.finish()
        return True


class FakeNccl:
    def __init__(self, world: int, eager_bytes: int = 0, mailbox: bool = False) -> None:
        self.world, self.mailbox = world, mailbox
        self.streams = RendezvousStreams(BUFFERED if mailbox else eager_bytes)
        self.cond = threading.Condition()
        self.local = threading.local()
        self.alive, self.blocked = world, 0
        self.failed: tuple[type, str] | None = None  # (the error every waiting rank raises, its text)
        self.crashed: dict[int, str] = {}  # rank -> the error it left with
        self.waiting: dict[int, FakeWork] = {}  # rank -> what it waits for
        self.host_waits: Counter = Counter()
        self.host_reads: Counter = Counter()
        self.collectives: dict[tuple, dict] = {}
        self.seq: dict[tuple, int] = defaultdict(int)
        self.inflight: list[tuple[P2POp, Any]] = []  # ops whose completion the fake has not handled yet
        self.unreleased: list[SentBuffer] = []  # sends not yet waited for nor seen completed
        self.landed: dict[int, SentBuffer] = {}  # a filled receive buffer's storage address -> its message

    def rank(self) -> int:
        return getattr(self.local, "rank", -1)

    def join(self, rank: int) -> None:
        self.local.rank = rank
        self.local.labels = []

    def leave(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.alive -= 1
            if error is not None and not isinstance(error, (DeadlockError, PeerFailed)):
                self.crashed[self.rank()] = f"{type(error).__name__}: {error}"
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

    # -- message identity --------------------------------------------------------------
    @contextmanager
    def labelled(self, label: Hashable) -> Iterator[None]:
        """Name the isends and irecvs this thread makes inside (see the module docstring)."""
        naming = _Labelling(label)
        self.local.labels.append(naming)
        try:
            yield
        finally:
            self.local.labels.pop()
            for i, sent in enumerate(naming.sends):
                sent.part, sent.parts = i, len(naming.sends)

    def label_messages(self, monkeypatch: Any) -> None:
        """Name every ``pulse_torch.comm`` message by its first tensor's tag, and check that what
        ``recv_group`` returns are the bytes of the messages it names, as their sender sent them."""
        from pulse.traffic import MAX_TENSORS_PER_MESSAGE
        from pulse_torch.comm import TorchCommunicator, tag_int

        send_message, recv_group = TorchCommunicator._send_message, TorchCommunicator.recv_group

        def labelled_send(comm, tensors, tags, peer_rank, stamp):
            with self.labelled(("message", tag_int(tags[0]))):
                return send_message(comm, tensors, tags, peer_rank, stamp)

        def checked_recv(comm, peer_rank, tags, timeout=None):
            got = recv_group(comm, peer_rank, tags, timeout)
            for i in range(0, len(tags), MAX_TENSORS_PER_MESSAGE):
                self.check_received(got[i:i + MAX_TENSORS_PER_MESSAGE], peer_rank, ("message", tag_int(tags[i])))
            return got
        monkeypatch.setattr(TorchCommunicator, "_send_message", labelled_send)
        monkeypatch.setattr(TorchCommunicator, "recv_group", checked_recv)

    def check_received(self, tensors: Any, src: int, label: Hashable) -> None:
        """``tensors`` are views of one received buffer holding the last part of ``src``'s ``label``
        (each buffer taken once)."""
        with self.cond, self.misuse_is_final():
            homes = {t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0}
            sent = self.landed.pop(homes.pop(), None) if len(homes) == 1 else None
            if sent is None:
                raise MessageMisuse(f"rank {self.rank()} took {label!r} from rank {src} out of "
                                    f"{'no' if sent is None else len(homes) + 1} buffer(s) a received message "
                                    "filled and nobody took yet")
            if (sent.sender, sent.label, sent.part) != (src, label, sent.parts - 1):
                raise MessageMisuse(f"rank {self.rank()} took {label!r} from rank {src}, but its bytes are "
                                    f"{sent}: receives matched the sends in another order than the "
                                    "sender meant")

    # -- completion ------------------------------------------------------------------
    def progress(self) -> None:
        """Complete what can complete, then handle each completion: a send's buffer is read (and
        checked) now, a receive's message checked against the label it was posted under."""
        self.streams.progress()
        done = [(op, info) for op, info in self.inflight if op.done]
        self.inflight = [(op, info) for op, info in self.inflight if not op.done]
        with self.misuse_is_final():
            for op, info in done:
                if op.kind == "send":
                    info.check("its send completed")
                    info.read = info.ref().detach().clone()
                elif info.expected is not None and op.payload.label != info.expected:
                    raise MessageMisuse(f"rank {op.rank} posted a receive for {info.expected!r} from rank "
                                        f"{op.peer}, and NCCL's order gave it {op.payload}")

    @contextmanager
    def misuse_is_final(self) -> Iterator[None]:
        """A misuse found in any thread ends the run: every rank that waits raises it too."""
        try:
            yield
        except MessageMisuse as exc:
            if self.failed is None:
                self.failed = (MessageMisuse, str(exc))
            self.cond.notify_all()
            raise

    def release(self, sent: SentBuffer, moment: str) -> None:
        """The sender learnt its send completed: from now on it may reuse the buffer."""
        if sent.released:
            return
        with self.misuse_is_final():
            sent.check(moment)
        sent.released, sent.snapshot = True, None
        self.unreleased.remove(sent)

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            kind, text = self.failed
            raise kind(text)

    def declare_stuck(self) -> None:
        """Every live rank waits and nothing can move: a deadlock, or the wake of a crash."""
        lines = [f"rank {r} waits for {w.what}" for r, w in sorted(self.waiting.items())] + self.streams.heads()
        if self.crashed:
            self.failed = (PeerFailed, "\n".join([f"rank {r} left with {e}" for r, e in sorted(self.crashed.items())]
                                                 + lines))
        else:
            self.failed = (DeadlockError, "\n".join(["deadlock: every rank waits"] + lines))
        self.cond.notify_all()

    # -- torch.distributed ------------------------------------------------------------
    def _is_initialized(self) -> bool:
        return True

    def _get_rank(self, group: Any = None) -> int:
        return self.rank()

    def _get_world_size(self, group: Any = None) -> int:
        return len(group.ranks) if group is not None else self.world

    def _get_backend(self, group: Any = None) -> str:
        return "gloo" if self.mailbox else "nccl"

    def _new_group(self, ranks: Any = None, **kwargs: Any) -> FakeGroup:
        with self.cond:  # every thread makes the same groups in the same order: the n-th call is group n
            key = ("new_group", self.rank())
            n = self.seq[key]
            self.seq[key] += 1
        return FakeGroup(n, list(ranks) if ranks is not None else list(range(self.world)))

    def _channel(self, group: Any, tag: int) -> Hashable:
        """Messages that match by order: per group on NCCL (tags ignored), per group and tag on gloo."""
        gid = "world" if group is None else group.ident
        return (gid, tag) if self.mailbox else gid

    def _naming(self) -> _Labelling | None:
        labels = getattr(self.local, "labels", None)
        return labels[-1] if labels else None

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: Any = None) -> FakeWork:
        naming = self._naming()
        sent = SentBuffer(self.rank(), dst, naming.label if naming else None, weakref.ref(tensor), tensor._version,
                          tensor.data_ptr(), tensor.detach().clone())
        if naming is not None:
            naming.sends.append(sent)
        with self.cond:
            op = self.streams.send(self.rank(), dst, self._channel(group, tag), tensor.numel() * tensor.element_size(),
                                   sent, "isend")
            sent.seq = op.seq
            self.inflight.append((op, sent))
            self.unreleased.append(sent)
            self.progress()
            self.cond.notify_all()
        return FakeWork(self, lambda: op.done, what=str(op), sent=sent)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: Any = None) -> FakeWork:
        naming = self._naming()
        posted = PostedRecv(naming.label if naming else None)
        nbytes = tensor.numel() * tensor.element_size()
        with self.cond:  # gloo takes a message into a larger buffer (pulse_torch.comm's inline receives)
            op = self.streams.recv(self.rank(), src, self._channel(group, tag), None if self.mailbox else nbytes,
                                   "irecv")
            self.inflight.append((op, posted))
            self.progress()
            self.cond.notify_all()

        def finish() -> None:
            sent: SentBuffer = op.payload
            data = sent.read.reshape(-1).view(torch.uint8)
            if data.numel() > nbytes:
                raise MessageMisuse(f"{sent} ({data.numel()} B) landed in a {nbytes}-byte receive buffer")
            tensor.reshape(-1).view(torch.uint8)[:data.numel()].copy_(data)
            with self.cond:
                self.landed[tensor.untyped_storage().data_ptr()] = sent
        return FakeWork(self, lambda: op.done, finish, str(op))

    def _all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False, **kw: Any) -> FakeWork:
        members = tuple(group.ranks) if group is not None else tuple(range(self.world))
        with self.cond:
            key = (members, self.seq[(members, self.rank())])
            self.seq[(members, self.rank())] += 1
            slot = self.collectives.setdefault(key, {})
            slot[self.rank()] = tensor.detach().clone()
            self.cond.notify_all()
        version, what = tensor._version, f"all-reduce #{key[1]} over {members}"

        def guard() -> None:  # the collective reads and writes the buffer until its wait
            if tensor._version != version:
                with self.misuse_is_final():
                    raise MessageMisuse(f"rank {self.rank()} wrote the buffer of its {what} before its wait()")

        def finish() -> None:
            # NCCL matches collectives by their order on the communicator only: ranks that issue
            # their buckets in different orders reduce mismatched buffers (or hang), never an error
            shapes = {r: (tuple(slot[r].shape), slot[r].dtype) for r in members}
            if len(set(shapes.values())) > 1:
                with self.cond, self.misuse_is_final():
                    raise MessageMisuse(f"{what}: the ranks gave different buffers {shapes}: they issued "
                                        "their all-reduces in different orders")
            tensor.copy_(sum(slot[r] for r in members))
        work = FakeWork(self, lambda: len(slot) == len(members), finish, what, guard=guard)
        if not async_op:
            work.wait()
            return None
        return work

    def _barrier(self, group: Any = None, async_op: bool = False, **kw: Any) -> FakeWork:
        return self._all_reduce(torch.zeros(1), group, async_op)
