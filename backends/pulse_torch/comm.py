"""PULSE's ``Communicator`` over torch.distributed (gloo on CPU, NCCL on CUDA, HCCL via torch_npu).

One transfer (every tensor of one ``pulse.traffic.Transfer``, ``send_group``) is
two point-to-point messages the first time (``pulse_torch.wire`` has the format)::

    sender                                   receiver
    isend(header: tag, stamp, count,    ───▶ irecv(header)  -> tag, shapes, dtypes
          each tensor's dtype and shape)     allocate one buffer
    isend(payload: the tensors' bytes)  ───▶ irecv(payload) .wait(timeout) -> views

and one message from then on, when tags match messages (gloo): a tag's message
has the same size every step, both sides remember it, so the payload rides
inline behind the header (``header + payload`` into a buffer of that size; a
payload that grew goes apart as above) and the receiver can post the receive
before the sender sends (``post_recv``: the executor posts a few receives
ahead). Why: gloo moves a message only once its receive is posted; a receive
posted after the send costs a handshake through the sender's progress thread,
which on a host whose cores are computing waits for a core (measured: ~1 ms
median, tails of 5-10 ms, per message), while a posted receive lets the
sender write at once.

On gloo each direction between two ranks has its own process group (``p2p_groups``,
made by ``pulse_torch.dist.direction_groups``), so its own TCP connection and progress
thread: with both directions on one connection, a send issued while the peer's
message to this rank was arriving blocked the caller, and two ranks computing and
exchanging one message each way per ~0.45 ms block spent 1.6 ms per exchange on the
messages against 0.4 ms with a connection per direction
(``benchmarks/gloo_exchange.py``; a 2-fold wave of tiny-uvit at P = 2: 36 -> 32 ms/step).

``bytes_sent`` counts tensor bytes only (what ``pulse.traffic`` and the
simulator predict); ``header_bytes`` counts the headers apart.

Matching. Gloo matches messages by (peer, tag): both halves carry
``MessageTag.as_int()`` and a receive takes exactly the message it names.
NCCL and HCCL ignore tags and match by order per pair, and a schedule's
receive order on one rank need not be its peer's send order (V schedules
often differ: the peer sends mb1's activation before mb0's gradient, the
receiver wants the gradient first). So without tags (``match_by_tag=False``,
the default off gloo) a receive drains the peer's messages in send order,
keeping those that arrive before their turn (the tag in the header says
whose they are) until their own receive asks. Nothing deadlocks that would
not deadlock with tags: every message drained was sent before the wanted one.

Sends are asynchronous and their ``Work`` handles are kept until
``wait_sends()`` (the launcher calls it at the end of every step, and every
collective calls it first). Beyond freeing buffers: on NCCL/HCCL a send may
block until its receive is posted, and waiting on every send before a
collective or the next step never leaves a rank inside a collective while
its peer still waits on that rank's send. Gloo honours
``Work.wait(timeout)``; every timeout and every peer failure becomes
``pulse.runtime.CommTimeout`` naming the peer and the message.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from pulse.errors import PlanError
from pulse.runtime.errors import CommTimeout
from pulse.traffic import MAX_TENSORS_PER_MESSAGE
from pulse_torch.wire import HEADER_BYTES, decode_header, encode_header, pack, payload_bytes, unpack

def tag_int(tag: Any) -> int:
    """``MessageTag.as_int()``, or the tag itself when it is an int already."""
    return tag.as_int() if hasattr(tag, "as_int") else int(tag)


@dataclass(frozen=True)
class SentMessage:
    """One payload sent: what the tests read to check what crossed the wire."""

    peer: int
    tag: int
    name: str  # payload name ("h", "temb", "a->b"); "" for an untyped tag
    direction: str  # "F", "B" or ""
    nbytes: int


@dataclass
class _PendingSend:
    # Both Work handles are kept: gloo drops a send whose Work is garbage-
    # collected before it completes (tried on torch 2.13: the receiver times
    # out even when the tensor itself is kept alive).
    works: tuple[Any, ...]  # the header (with the payload inline) and the payload apart, if it is
    tensors: tuple[Tensor, ...]  # what they send, alive until the sends complete
    peer: int
    what: str

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


@dataclass
class PendingAllReduce:
    """An all-reduce in flight (``TorchCommunicator.all_reduce_async``)."""

    comm: "TorchCommunicator"
    work: Any
    buffer: Tensor
    timeout: float | None
    what: str

    def wait(self) -> Tensor:
        self.comm._wait(lambda: self.work, self.timeout, self.what)
        return self.buffer


def _delta(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


class TorchCommunicator:
    """``pulse.runtime.protocols.Communicator`` for one process of a torch.distributed job.

    ``groups`` maps a sorted tuple of global ranks to its process group; the
    whole world needs no entry. Groups must be created on every rank in the
    same order (torch's rule), so they are made up front (``register_group``,
    or ``from_context`` with the groups ``dist.init_distributed`` built).
    The launcher calls ``wait_sends()`` after each ``StageExecutor.run_step``
    (the executor does not know about pending sends). After a timeout gloo
    closes the connection to that peer: a ``CommTimeout`` ends the job.
    """

    def __init__(self, *, device: str | torch.device = "cpu", timeout: float | None = None,
                 groups: dict[tuple[int, ...], Any] | None = None, match_by_tag: bool | None = None,
                 p2p_groups: tuple[Any, Any] | None = None) -> None:
        if not dist.is_initialized():
            raise PlanError("torch.distributed is not initialised: call "
                            "pulse_torch.dist.init_distributed (under torchrun) first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device)
        self.timeout = timeout  # used when a call passes none
        self.groups: dict[tuple[int, ...], Any] = dict(groups or {})
        self.bytes_sent: dict[int, int] = {}
        self.header_bytes: dict[int, int] = {}
        self.wire_messages: dict[int, int] = {}  # point-to-point messages put on the wire, per peer
        self.allreduce_bytes = 0
        self.log: list[SentMessage] = []
        self._pending: list[_PendingSend] = []
        # Tags on the wire only where the backend honours them (see the module docstring).
        self.match_by_tag = dist.get_backend() == "gloo" if match_by_tag is None else match_by_tag
        self.early: dict[tuple[int, int], tuple[list[Tensor], int]] = {}  # (peer, tag) -> (tensors, stamp) drained early
        self.last_stamp = 0  # the header stamp of the message recv() returned last
        self.peak_early = 0  # most payloads held early at once (0 when matching by tag)
        # (peer, tag) -> payload bytes of that tag's last message, sent / received: the inline size
        self.sent_sizes: dict[tuple[int, int], int] = {}
        self.recv_sizes: dict[tuple[int, int], int] = {}
        self.posted: dict[tuple[int, int], tuple[Any, Tensor, int]] = {}  # (peer, tag) -> (work, buffer, inline)
        self.p2p_groups = p2p_groups  # (to a higher rank, to a lower rank): see the module docstring

    @classmethod
    def from_context(cls, ctx: Any, timeout: float | None = None,
                     match_by_tag: bool | None = None) -> "TorchCommunicator":
        """From a ``pulse_torch.dist.DistContext``: its device and its data-parallel / pipeline groups."""
        groups = {}
        if getattr(ctx, "dp_group", None) is not None:
            groups[tuple(sorted(ctx.layout.dp_ranks()))] = ctx.dp_group
        if getattr(ctx, "pp_group", None) is not None:
            groups[tuple(sorted(ctx.layout.pp_ranks()))] = ctx.pp_group
        return cls(device=ctx.device, timeout=timeout, groups=groups, match_by_tag=match_by_tag,
                   p2p_groups=getattr(ctx, "p2p_groups", None))

    def direction_group(self, src: int, dst: int) -> Any:
        """The process group of messages from ``src`` to ``dst`` (None: the default group)."""
        if self.p2p_groups is None:
            return None
        return self.p2p_groups[0] if src < dst else self.p2p_groups[1]

    def register_group(self, ranks: Sequence[int]) -> None:
        """Create the process group of ``ranks``; every rank must call this, in the same order."""
        key = tuple(sorted(ranks))
        group = dist.new_group(list(key))
        if self.rank in key:
            self.groups[key] = group

    # -- point to point ------------------------------------------------------------
    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None,
             stamp: int = 0) -> None:
        """Send one tensor asynchronously (a message of one)."""
        self.send_group([tensor], peer_rank, [tag], timeout, stamp)

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.recv_group(peer_rank, [tag], timeout)[0]

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None, stamp: int = 0) -> None:
        """Send ``tensors`` asynchronously, as few wire messages as ``pulse_torch.wire`` allows
        (each tagged with its first tensor's tag); ``stamp`` rides in the headers."""
        self._reap()
        for i in range(0, len(tensors), MAX_TENSORS_PER_MESSAGE):
            self._send_message(list(tensors[i:i + MAX_TENSORS_PER_MESSAGE]),
                               list(tags[i:i + MAX_TENSORS_PER_MESSAGE]), peer_rank, stamp)

    def _send_message(self, tensors: list[Tensor], tags: list[Any], peer_rank: int, stamp: int) -> None:
        code = tag_int(tags[0])
        header = encode_header(tensors, code, stamp).to(self.device).view(torch.uint8)
        payload = pack(tensors, self.device)
        wire = code if self.match_by_tag else 0
        what = f"{tags[0]}{f' (+{len(tags) - 1} more)' if len(tags) > 1 else ''} to rank {peer_rank}"
        inline = self.sent_sizes.get((peer_rank, code), 0) if self.match_by_tag else 0
        parts = (torch.cat([header, payload]),) if 0 < payload.numel() <= inline else (header, payload)
        if self.match_by_tag:
            self.sent_sizes[(peer_rank, code)] = payload.numel()
        try:
            group = self.direction_group(self.rank, peer_rank)
            works = tuple(dist.isend(part, peer_rank, tag=wire, group=group) for part in parts)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: sending {what} failed ({exc})") from None
        self._pending.append(_PendingSend(works, parts, peer_rank, what))
        self.wire_messages[peer_rank] = self.wire_messages.get(peer_rank, 0) + len(parts)
        self.header_bytes[peer_rank] = self.header_bytes.get(peer_rank, 0) + HEADER_BYTES
        for t, tag in zip(tensors, tags):
            nbytes = t.numel() * t.element_size()
            self.bytes_sent[peer_rank] = self.bytes_sent.get(peer_rank, 0) + nbytes
            self.log.append(SentMessage(peer_rank, tag_int(tag), str(getattr(tag, "name", "")),
                                        str(getattr(tag, "direction", "")), nbytes))

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        """The tensors ``send_group`` sent under ``tags``; ``last_stamp`` holds the last header's stamp."""
        out: list[Tensor] = []
        for i in range(0, len(tags), MAX_TENSORS_PER_MESSAGE):
            part = list(tags[i:i + MAX_TENSORS_PER_MESSAGE])
            got = self._recv_message(peer_rank, part, timeout)
            if len(got) != len(part):
                raise PlanError(f"rank {self.rank}: {part[0]} from rank {peer_rank} carried {len(got)} tensors, "
                                f"expected {len(part)}: sender and receiver disagree on the message")
            out += got
        return out

    def _recv_message(self, peer_rank: int, tags: list[Any], timeout: float | None) -> list[Tensor]:
        code = tag_int(tags[0])
        what = f"{tags[0]} from rank {peer_rank}"
        if (peer_rank, code) in self.early:
            tensors, self.last_stamp = self.early.pop((peer_rank, code))
            return tensors
        while True:  # with tags: one pass; without: drain in send order until ours arrives
            got, tensors, stamp = self._recv_one(peer_rank, code if self.match_by_tag else 0, timeout, what)
            if got == code:
                self.last_stamp = stamp
                return tensors
            if self.match_by_tag or (peer_rank, got) in self.early:
                raise PlanError(f"rank {self.rank}: waiting for {what} (tag {code}), got tag {got}: "
                                "another message used the same tag")
            self.early[(peer_rank, got)] = (tensors, stamp)
            self.peak_early = max(self.peak_early, len(self.early))

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        """Post the receives of ``tags`` from ``peer_rank`` now, so that the sender can write them
        as soon as it sends (see the module docstring); ``recv_group`` later takes them. Only when
        tags match messages: without tags a receive takes whatever comes next."""
        if not self.match_by_tag:
            return
        for i in range(0, len(tags), MAX_TENSORS_PER_MESSAGE):
            key = (peer_rank, tag_int(tags[i]))
            if key not in self.posted:
                self.posted[key] = self._post(*key)

    def _post(self, peer: int, code: int) -> tuple[Any, Tensor, int]:
        inline = self.recv_sizes.get((peer, code), 0)
        buf = torch.empty(HEADER_BYTES + inline, dtype=torch.uint8, device=self.device)
        try:
            return dist.irecv(buf, peer, tag=code, group=self.direction_group(peer, self.rank)), buf, inline
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: receiving tag {code} from rank {peer} failed ({exc})") from None

    def _recv_one(self, peer: int, wire: int, timeout: float | None,
                  what: str) -> tuple[int, list[Tensor], int]:
        """The next message from ``peer`` under wire tag ``wire``: (its PULSE tag, tensors, stamp)."""
        work, first, inline = self.posted.pop((peer, wire), None) or self._post(peer, wire)
        self._wait(lambda: work, timeout, f"the header of {what}")
        got, layout, stamp = decode_header(first[:HEADER_BYTES].view(torch.int64).cpu())
        size = payload_bytes(layout)
        if 0 < size <= inline:  # the payload came inline
            buf = first[HEADER_BYTES:HEADER_BYTES + size]
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            group = self.direction_group(peer, self.rank)
            self._wait(lambda: dist.irecv(buf, peer, tag=wire, group=group), timeout, what)
        if self.match_by_tag:
            self.recv_sizes[(peer, wire)] = size
        return got, unpack(buf, layout), stamp

    def wait_sends(self, timeout: float | None = None) -> None:
        """Block until every send so far has completed (call before a step ends)."""
        pending, self._pending = self._pending, []
        for p in pending:
            for work in p.works:
                self._wait(lambda: work, timeout, f"the send of {p.what}")

    def _reap(self) -> None:
        """Forget sends that completed (their buffers can go)."""
        self._pending = [p for p in self._pending if not p.done()]

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        self.wait_sends(timeout)
        key = tuple(sorted(group))
        pg = self._group(key)
        t = tensor.detach()
        buf = t if t.is_contiguous() and t.device == self.device else t.to(self.device).contiguous()
        self._wait(lambda: dist.all_reduce(buf, group=pg, async_op=True), timeout,
                   f"all-reduce of {buf.numel()} elements over ranks {list(key)}")
        self.allreduce_bytes += buf.numel() * buf.element_size()
        return buf

    def all_reduce_async(self, tensor: Tensor, group: Sequence[int],
                         timeout: float | None = None) -> "PendingAllReduce":
        """Start the element-wise sum over ``group``; ``.wait()`` returns it.

        For the data-parallel buckets launched during backward (``pulse.runtime.grad_sync``):
        they use the data-parallel process group, not the one pipeline messages travel on,
        so a pending receive can never swallow them.
        """
        key = tuple(sorted(group))
        pg = self._group(key)
        buf = tensor.detach().to(self.device).contiguous()
        what = f"all-reduce of {buf.numel()} elements over ranks {list(key)}"
        try:
            work = dist.all_reduce(buf, group=pg, async_op=True)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: {what} failed ({exc})") from None
        self.allreduce_bytes += buf.numel() * buf.element_size()
        return PendingAllReduce(self, work, buf, timeout, what)

    def sum_values(self, values: Sequence[float], timeout: float | None = None) -> list[float]:
        """Bookkeeping numbers (loss, byte counts) summed over the world; not counted as traffic.

        float64 keeps byte counts exact; HCCL on Ascend gets float32, which not every version
        reduces in float64."""
        dtype = torch.float32 if self.device.type == "npu" else torch.float64
        buf = torch.tensor([float(v) for v in values], dtype=dtype, device=self.device)
        self._wait(lambda: dist.all_reduce(buf, async_op=True), timeout, "all-reduce of the step's statistics")
        return [float(v) for v in buf.cpu().tolist()]

    def barrier(self, timeout: float | None = None) -> None:
        self.wait_sends(timeout)
        # Not gloo's monitored_barrier, though it names missing ranks: it is
        # built on point-to-point messages tagged 0, 1, 2, ..., which a
        # pending pipeline receive with the same tag would swallow.
        self._wait(lambda: dist.barrier(async_op=True), timeout, f"barrier over all {self.world_size} ranks")

    def _group(self, key: tuple[int, ...]) -> Any:
        if key == tuple(range(self.world_size)):
            return None  # the default (world) group
        if key not in self.groups:
            raise PlanError(f"rank {self.rank}: no process group for ranks {list(key)}; create it on "
                            "every rank with register_group (or init_distributed) before the step")
        return self.groups[key]

    def _wait(self, start: Callable[[], Any], timeout: float | None, what: str) -> None:
        """Start an operation and wait for it; timeouts and peer failures become CommTimeout."""
        seconds = self.timeout if timeout is None else timeout
        try:
            work = start()
            if seconds is None:
                work.wait()
            else:
                work.wait(timeout=_delta(seconds))
        except RuntimeError as exc:  # gloo: "Timed out waiting ...", "Connection closed by peer", ...
            reason = "timed out" if "timed out" in str(exc).lower() else "failed"
            limit = f" after {seconds:g} s" if seconds is not None and reason == "timed out" else ""
            raise CommTimeout(f"rank {self.rank}: {what} {reason}{limit} ({exc})") from None
