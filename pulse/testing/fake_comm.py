"""All ranks of a plan in one process: an in-memory network and a cooperative runner.

``FakeNetwork`` holds one mailbox for every rank; ``FakeCommunicator`` is one
rank's view of it. Nothing blocks: a receive whose message is not there yet,
or an all-reduce some group member has not reached, raises ``WouldBlock``
before changing any state. ``run_all_ranks`` keeps running every rank that can
progress, in rank order (deterministic), and when none can, raises a
``DeadlockError`` naming each blocked rank and what it waits for::

    rank 0 (device 0): action #0 0RB0:1 waits for gradient 'h' of mb0 (transfer #0) from rank 1
    rank 1 (device 1): action #0 1RF0:0 waits for activation 'h' of mb0 (transfer #0) from rank 0

Every message goes through a numpy copy (the "wire"), so no rank can touch
another's tensors, and bytes are counted per peer as a real link would see.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import reduce
from typing import Any, Sequence

import numpy as np

from pulse.errors import PlanError
from pulse.runtime.errors import DeadlockError
from pulse.runtime.executor import StageExecutor, StepStats
from pulse.runtime.protocols import Backend, CommunicatorDefaults, Tensor
from pulse.schedule.validate import format_grid


class WouldBlock(Exception):
    """Internal to the fake: the call cannot complete yet; retry it later."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class LoggedMessage:
    src: int
    dst: int
    tag: Any  # a MessageTag: direction, transfer, microbatch, slot, payload name
    nbytes: int


@dataclass
class _Collective:
    inputs: dict[int, Tensor | None] = field(default_factory=dict)
    result: Tensor | None = None
    taken: set[int] = field(default_factory=set)


class FakeNetwork:
    """The shared mailboxes, the message log and the collectives in progress.

    ``rendezvous``: move point-to-point messages as NCCL and HCCL do instead of through
    tag-keyed mailboxes (``pulse.testing.fake_rendezvous``)."""

    def __init__(self, world_size: int, backend: Backend, rendezvous: Any = None) -> None:
        self.world_size = world_size
        self.backend = backend
        self.mailbox: dict[tuple[int, int, Any], Tensor] = {}
        self.log: list[LoggedMessage] = []
        self.collectives: dict[tuple[tuple[int, ...], int], _Collective] = {}
        self.streams = None
        if rendezvous is None:
            self.comms = [FakeCommunicator(self, r) for r in range(world_size)]
        else:
            from pulse.testing.fake_rendezvous import RendezvousCommunicator  # it builds on this module
            from pulse.runtime.rendezvous import RendezvousStreams

            self.streams = RendezvousStreams(rendezvous.eager_bytes)
            self.comms = [RendezvousCommunicator(self, r, self.streams, rendezvous) for r in range(world_size)]

    def communicator(self, rank: int) -> "FakeCommunicator":
        return self.comms[rank]

    def wire_copy(self, t: Tensor) -> Tensor:
        return self.backend.from_numpy(np.array(self.backend.to_numpy(t), copy=True))

    def bytes_between(self, src: int, dst: int) -> int:
        return self.comms[src].bytes_sent.get(dst, 0)


class FakeCommunicator(CommunicatorDefaults):
    """One rank's ``Communicator`` on a ``FakeNetwork``; timeouts are ignored (deadlocks are detected).

    A bucket's ``all_reduce_async`` (the default) sums at ``wait()``: one thread has no background,
    and every rank sums in the same order."""

    def __init__(self, network: FakeNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank
        self.bytes_sent: dict[int, int] = defaultdict(int)
        self.allreduce_bytes = 0
        self._seq: dict[tuple[int, ...], int] = defaultdict(int)

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        key = (self.rank, peer_rank, tag)
        if key in self.network.mailbox:
            raise PlanError(f"rank {self.rank} sends {tag} to rank {peer_rank} twice before it is received")
        nbytes = self.network.backend.nbytes(tensor)
        self.network.mailbox[key] = self.network.wire_copy(tensor)
        self.bytes_sent[peer_rank] += nbytes
        self.network.log.append(LoggedMessage(self.rank, peer_rank, tag, nbytes))

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.recv_group(peer_rank, [tag], timeout)[0]

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        """Every tensor of ``tags``, or ``WouldBlock`` before taking any (a retry starts over)."""
        for tag in tags:
            if (peer_rank, self.rank, tag) not in self.network.mailbox:
                raise WouldBlock(f"{tag} from rank {peer_rank}")
        return [self.network.mailbox.pop((peer_rank, self.rank, tag)) for tag in tags]

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        result = self._collective(tensor, group, "all-reduce")
        assert result is not None
        return self.network.wire_copy(result)

    def barrier(self, timeout: float | None = None) -> None:
        self._collective(None, range(self.network.world_size), "barrier")

    def _collective(self, tensor: Tensor | None, group: Sequence[int], what: str) -> Tensor | None:
        """Arrive (once per call site, retries allowed); complete when every member arrived."""
        members = tuple(sorted(group))
        seq = self._seq[members]
        slot = self.network.collectives.setdefault((members, seq), _Collective())
        if self.rank not in slot.inputs and tensor is not None:
            self.allreduce_bytes += self.network.backend.nbytes(tensor)
        slot.inputs[self.rank] = tensor
        missing = [r for r in members if r not in slot.inputs]
        if missing:
            raise WouldBlock(f"{what} #{seq} over ranks {list(members)}: ranks {missing} have not reached it")
        if slot.result is None and tensor is not None:
            slot.result = reduce(self.network.backend.add,
                                 [self.network.wire_copy(slot.inputs[r]) for r in members])
        slot.taken.add(self.rank)
        if len(slot.taken) == len(members):
            del self.network.collectives[(members, seq)]
        self._seq[members] += 1
        return slot.result


def run_all_ranks(executors: Sequence[StageExecutor], zero_grad: bool = True) -> dict[int, StepStats]:
    """One training step of every rank, interleaved cooperatively; stats by global rank.

    Each sweep runs every unfinished rank, in rank order, as far as it can go.
    A sweep in which no rank moves while work remains is a deadlock.
    """
    ordered = sorted(executors, key=lambda ex: ex.rank)
    for ex in ordered:
        ex.begin_step(zero_grad)
    while True:
        pending = [ex for ex in ordered if not ex.done]
        if not pending:
            return {ex.rank: ex.stats for ex in ordered}
        blocked: dict[int, str] = {}
        progressed = False
        for ex in pending:
            try:
                while not ex.done:
                    ex.run_next()
                    progressed = True
            except WouldBlock as wait:
                blocked[ex.rank] = wait.reason
        if not progressed:
            raise DeadlockError(deadlock_report(ordered, blocked))


def deadlock_report(executors: Sequence[StageExecutor], blocked: dict[int, str]) -> str:
    lines = [f"deadlock: no rank can progress ({len(blocked)} of {len(executors)} ranks blocked)"]
    for ex in executors:
        if ex.rank in blocked:
            lines.append(f"  rank {ex.rank} (device {ex.device}): {ex.next_label()} "
                         f"waits for {blocked[ex.rank]}")
        else:
            lines.append(f"  rank {ex.rank} (device {ex.device}): finished")
    replicas: dict[tuple[int, ...], list[StageExecutor]] = defaultdict(list)
    for ex in executors:
        replicas[tuple(ex.ranks)].append(ex)
    for ranks, members in replicas.items():
        marks = {(ex.device, ex.position): "blocked" for ex in members
                 if ex.rank in blocked and ex.position < len(ex.actions)}
        if marks:
            title = f"pipeline of ranks {list(ranks)}:" if len(replicas) > 1 else ""
            lines += ([title] if title else []) + [format_grid(members[0].schedule, marks)]
    streams = getattr(executors[0].comm, "streams", None) if executors else None
    if streams is not None:  # rendezvous mode: what each stream waits on
        lines += ["stream heads:"] + [f"  {h}" for h in streams.heads()]
    return "\n".join(lines)
