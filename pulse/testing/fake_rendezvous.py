"""The fake network's rendezvous mode: messages that move as NCCL and HCCL move them.

``FakeNetwork(..., rendezvous=RendezvousRules())`` gives every rank a ``RendezvousCommunicator``:
its messages go through ``pulse.runtime.rendezvous.RendezvousStreams`` (order matching, one FIFO
per stream key, a send larger than ``eager_bytes`` completes only with its receive) instead of
tag-keyed mailboxes, and it follows the same policy as ``pulse_torch.comm`` on a device:

- a process group per direction between two ranks (``channels="direction"``), so sends to a peer
  and receives from it never queue behind each other; ``channels="pair"`` is what one process
  group gives on NCCL (both directions on one stream), kept to show what it does to a V;
- receives posted in the sender's order (``pulse.runtime.message_order.inbound_order``, handed in
  by the executor), a message wanted later kept in its own posted receive;
- sends never wait (their completion is awaited at a collective and at the step's end), and a
  send's tensors are read when it completes, as a device reads its buffer: a tensor written
  between ``send_group`` and the completion, or before ``wait_sends`` learnt of it, is an error.

A wait that cannot complete raises ``WouldBlock`` and ``run_all_ranks`` tries another rank; when
none can move it reports the deadlock with every stream's head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pulse.errors import PlanError
from pulse.testing.fake_comm import FakeCommunicator, LoggedMessage, WouldBlock
from pulse.runtime.message_order import InboundCursor, split_tags
from pulse.runtime.protocols import Tensor
from pulse.runtime.rendezvous import P2POp, RendezvousStreams


@dataclass(frozen=True)
class RendezvousRules:
    """How the fake network moves point-to-point messages in rendezvous mode."""

    eager_bytes: int = 0  # 0: every message waits for its receive (NCCL's buffer is 4 MiB)
    channels: str = "direction"  # "direction": a process group per direction; "pair": one for both

    def __post_init__(self) -> None:
        if self.channels not in ("direction", "pair"):
            raise PlanError(f"rendezvous channels must be 'direction' or 'pair', not {self.channels!r}")

    def group(self, src: int, dst: int) -> str:
        if self.channels == "pair":
            return "world"
        return "up" if src < dst else "down"


@dataclass(eq=False)
class HandedOver:
    """A send's tensors as the executor handed them over (no copy), and private copies to check
    them against until the sender learns the send completed."""

    values: list[Tensor]
    copies: list[Tensor]

    def check(self, backend: Any, what: str, moment: str) -> None:
        for v, c in zip(self.values, self.copies):
            if _raw(backend, v) != _raw(backend, c):
                raise PlanError(f"{what}: a tensor it sends was written before {moment}; NCCL and HCCL read "
                                "a send's buffer asynchronously until then")


def _raw(backend: Any, t: Tensor) -> bytes:
    return np.ascontiguousarray(backend.to_numpy(t)).tobytes()


def read_at_completion(network: Any, op: P2POp) -> None:
    """``RendezvousStreams.on_send_done``: the send's tensors, checked, read into what its receive gets."""
    handed: HandedOver = op.payload
    handed.check(network.backend, f"rank {op.rank}'s {op}", "the send completed")
    op.payload = [network.wire_copy(v) for v in handed.values]


class RendezvousCommunicator(FakeCommunicator):
    """One rank's communicator in rendezvous mode (see the module docstring)."""

    def __init__(self, network: Any, rank: int, streams: RendezvousStreams, rules: RendezvousRules) -> None:
        super().__init__(network, rank)
        self.streams, self.rules = streams, rules
        self.cursor = InboundCursor()
        self._posted: dict[tuple[int, int], P2POp] = {}  # (peer, key) -> its receive
        self._sends: list[tuple[P2POp, HandedOver]] = []
        streams.on_send_done = lambda op: read_at_completion(network, op)

    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        """Each peer's messages to this rank in one step, in the peer's send order (by global rank),
        each as its tensors' keys; a message is named by its first."""
        self.cursor.expect({peer: [m[0] for m in messages] for peer, messages in order.items()})

    # -- sending -----------------------------------------------------------------
    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        backend = self.network.backend
        for part in split_tags(list(tags)):
            values = list(tensors[:len(part)])
            tensors = tensors[len(part):]
            nbytes = sum(backend.nbytes(v) for v in values)
            handed = HandedOver(values, [self.network.wire_copy(v) for v in values])
            self._sends.append((self.streams.send(self.rank, peer_rank, self.rules.group(self.rank, peer_rank),
                                                  nbytes, handed, str(part[0]), key=part[0].as_int()), handed))
            for tag, v in zip(part, values):
                self.bytes_sent[peer_rank] += backend.nbytes(v)
                self.network.log.append(LoggedMessage(self.rank, peer_rank, tag, backend.nbytes(v)))
        self.streams.progress()

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        self.send_group([tensor], peer_rank, [tag], timeout)

    def wait_sends(self, timeout: float | None = None) -> None:
        self.streams.progress()
        waiting = [op for op, _ in self._sends if not op.done]
        if waiting:
            raise WouldBlock(f"the completion of its {waiting[0]} (and {len(waiting) - 1} more sends)")
        for op, handed in self._sends:
            handed.check(self.network.backend, f"rank {self.rank}'s {op}", "wait_sends learnt it completed")
        self._sends.clear()

    # -- receiving ---------------------------------------------------------------
    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        """Post, in the peer's send order, every receive up to the message of ``tags``."""
        for part in split_tags(list(tags)):
            self._post_through(peer_rank, part[0].as_int())

    def _post_through(self, peer: int, key: int) -> P2POp | None:
        group = self.rules.group(peer, self.rank)
        for k in self.cursor.to_post(peer, key):
            self._posted[(peer, k)] = self.streams.recv(self.rank, peer, group, None, f"message {k}", key=k)
        return self._posted.get((peer, key))

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        parts = split_tags(list(tags))
        ops = [self._post_through(peer_rank, p[0].as_int()) for p in parts]
        self.streams.progress()
        for part, op in zip(parts, ops):
            if op is None:
                raise PlanError(f"rank {self.rank} receives {part[0]} from rank {peer_rank} twice in one step")
            if not op.done:
                raise WouldBlock(f"{part[0]} from rank {peer_rank} (posted as its {op})")
        out: list[Tensor] = []
        for part, op in zip(parts, ops):
            del self._posted[(peer_rank, part[0].as_int())]
            self.cursor.received(peer_rank, part[0].as_int())
            out += op.payload
        return out

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.recv_group(peer_rank, [tag], timeout)[0]

    # -- collectives wait for this rank's sends first, as pulse_torch.comm does ---------------
    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        self.wait_sends(timeout)
        return super().all_reduce(tensor, group, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        self.wait_sends(timeout)
        super().barrier(timeout)
