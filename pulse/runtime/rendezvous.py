"""Point-to-point messages under NCCL's rules, as data: the in-process model of a device network.

What PyTorch's ProcessGroupNCCL and NCCL do with non-batched ``isend`` / ``irecv`` (HCCL through
torch_npu follows the same design), and what this model keeps::

    rank a                                   rank b
    stream (g, a|b): [send m0][recv n0][send m1] ...   one FIFO per rank and stream key: both
                        │ rendezvous                     directions between a and b in process
    stream (g, a|b): [recv m0][send n0] ...              group g share it (``getKeySendRecv``)

- an operation runs only at the head of its rank's FIFO for its stream key;
- the i-th send from a to b in a group matches the i-th receive at b from a in that group,
  whatever the tags say (NCCL has none);
- a send of at most ``eager_bytes`` completes at the head (its bytes wait in the peer's
  buffer); a larger one completes only together with its receive, which must be at the head
  of the receiver's FIFO at the same time (NCCL's rendezvous: the kernel blocks until then);
- a receive completes at the head once its send's bytes are there;
- a send's buffer is read when the send completes (``on_send_done``), not when it is posted:
  until then (and until the sender learns it completed) the buffer is NCCL's.

Stream keys are the caller's: ``pair_key`` gives NCCL's (one stream per pair, both directions);
a process group per direction gives a stream per direction. Nothing here blocks: ``progress``
completes what can complete, the caller decides what waiting means (``pulse.testing.fake_comm``
raises its would-block signal, a threaded test fake waits on a condition).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from pulse.errors import PlanError

# NCCL's default buffer per channel (NCCL_BUFFSIZE, 4 MiB): a send up to it can complete before its
# receive is posted. The in-process rendezvous mode uses 0 by default: every message waits for its
# receive, the strictest case, which a plan must survive whatever its message sizes.
NCCL_BUFFER_BYTES = 4 << 20


@dataclass
class P2POp:
    """One isend or irecv in flight."""

    kind: str  # "send" or "recv"
    rank: int
    peer: int
    group: Hashable
    seq: int  # its position among the group's messages from src to dst
    nbytes: int | None  # a receive may not know its size (the in-process fake)
    label: str
    key: Hashable = None  # which message: a send's own, the one a receive expects (None: unchecked)
    payload: Any = None  # a send's data; a receive's once it completed
    done: bool = False

    @property
    def channel(self) -> tuple[Hashable, int, int]:
        """(group, src, dst): the messages that match by order."""
        return (self.group, self.rank, self.peer) if self.kind == "send" else (self.group, self.peer, self.rank)

    def __str__(self) -> str:
        arrow = "to" if self.kind == "send" else "from"
        return f"{self.kind} #{self.seq} {arrow} rank {self.peer} ({self.label}, {self.nbytes} B)"


def pair_key(group: Hashable, rank: int, peer: int) -> tuple[Hashable, int, int]:
    """ProcessGroupNCCL's stream for a message between two ranks: both directions share it."""
    return (group, min(rank, peer), max(rank, peer))


@dataclass
class RendezvousStreams:
    """Every rank's operation FIFOs and the matching between them."""

    eager_bytes: int = 0
    on_send_done: Callable[[P2POp], None] | None = None  # as a send completes, before its bytes move on
    fifos: dict[tuple[int, Hashable], deque] = field(default_factory=lambda: defaultdict(deque))
    _sent: dict[tuple, int] = field(default_factory=lambda: defaultdict(int))
    _posted: dict[tuple, int] = field(default_factory=lambda: defaultdict(int))
    _recvs: dict[tuple, dict[int, P2POp]] = field(default_factory=lambda: defaultdict(dict))
    _buffered: dict[tuple, dict[int, P2POp]] = field(default_factory=lambda: defaultdict(dict))

    def send(self, rank: int, peer: int, group: Hashable, nbytes: int, payload: Any, label: str = "",
             key: Hashable = None) -> P2POp:
        seq = self._sent[(group, rank, peer)]
        self._sent[(group, rank, peer)] += 1
        return self._enqueue(P2POp("send", rank, peer, group, seq, nbytes, label, key, payload))

    def recv(self, rank: int, peer: int, group: Hashable, nbytes: int | None, label: str = "",
             key: Hashable = None) -> P2POp:
        seq = self._posted[(group, peer, rank)]
        self._posted[(group, peer, rank)] += 1
        op = self._enqueue(P2POp("recv", rank, peer, group, seq, nbytes, label, key))
        self._recvs[op.channel][seq] = op
        return op

    def _enqueue(self, op: P2POp) -> P2POp:
        self.fifos[(op.rank, pair_key(op.group, op.rank, op.peer))].append(op)
        return op

    def progress(self) -> bool:
        """Complete every operation that can complete now; True when any did."""
        moved_any = False
        while True:
            moved = False
            for (rank, key), fifo in list(self.fifos.items()):
                while fifo and self._run_head(fifo[0], key):
                    fifo.popleft()
                    moved = True
            if not moved:
                return moved_any
            moved_any = True

    def _run_head(self, op: P2POp, key: Hashable) -> bool:
        if op.done:  # a rendezvous receive completed by its send
            return True
        if op.kind == "send":
            if op.nbytes is not None and op.nbytes <= self.eager_bytes:
                self._read(op)
                self._buffered[op.channel][op.seq] = op
                op.done = True
                return True
            recv = self._recvs[op.channel].get(op.seq)
            peer_fifo = self.fifos.get((op.peer, key))
            if recv is None or not peer_fifo or peer_fifo[0] is not recv:
                return False
            self._read(op)
            self._deliver(op, recv)
            op.done = True
            return True
        sent = self._buffered[op.channel].pop(op.seq, None)
        if sent is None:
            return False
        self._deliver(sent, op)
        return True

    def _read(self, send: P2POp) -> None:
        """The send completes: where a device reads its buffer."""
        if self.on_send_done is not None:
            self.on_send_done(send)

    def _deliver(self, send: P2POp, recv: P2POp) -> None:
        wrong_size = recv.nbytes is not None and send.nbytes != recv.nbytes
        if wrong_size or (recv.key is not None and send.key != recv.key):  # NCCL would corrupt or overrun
            raise PlanError(f"rank {recv.rank} posted {recv} but the matching message is rank {send.rank}'s "
                            f"{send}: receives must be posted in the sender's order")
        del self._recvs[recv.channel][recv.seq]
        recv.payload, recv.done = send.payload, True

    def heads(self) -> list[str]:
        """Each non-empty FIFO's head, for a deadlock report."""
        return [f"rank {rank} stream {key}: {fifo[0]} ({len(fifo)} queued)"
                for (rank, key), fifo in sorted(self.fifos.items(), key=lambda kv: str(kv[0])) if fifo]
