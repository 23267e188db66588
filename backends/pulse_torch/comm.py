"""PULSE's ``Communicator`` over torch.distributed (gloo on CPU, NCCL on CUDA, HCCL via torch_npu).

One tensor on the wire is two point-to-point messages::

    sender                                   receiver
    isend(header: int64[3 + 8] = tag,   ───▶ irecv(header)  -> tag, shape, dtype
          ndim, dtype code, shape)           allocate the buffer
    isend(payload)                      ───▶ irecv(payload) .wait(timeout)

The receiver cannot size its buffer otherwise: a tensor's shape depends on the
microbatch size and the payload name, which the wiring knows but the bytes do
not. ``bytes_sent`` counts payload bytes only (what ``pulse.traffic`` and the
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

MAX_DIMS = 8
HEADER_LEN = 3 + MAX_DIMS + 1  # the last slot: a link-emulation stamp (``pulse_torch.throttle``), else 0
HEADER_BYTES = HEADER_LEN * 8
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


def encode_header(t: Tensor, tag: int, stamp: int = 0) -> Tensor:
    """int64[HEADER_LEN]: (tag, ndim, dtype code, shape..., zeros, stamp)."""
    if t.dim() > MAX_DIMS or t.dtype not in _CODE:
        raise PlanError(f"cannot send a {t.dim()}-d {t.dtype} tensor (at most {MAX_DIMS} dims, "
                        f"dtypes {', '.join(str(d) for d in DTYPES)})")
    head = [tag, t.dim(), _CODE[t.dtype], *t.shape]
    return torch.tensor(head + [0] * (HEADER_LEN - 1 - len(head)) + [stamp], dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    """(tag, shape, dtype) of the payload that follows."""
    values = [int(v) for v in header.tolist()]
    tag, ndim, code = values[:3]
    shape = values[3:3 + ndim]
    if not (0 <= ndim <= MAX_DIMS and 0 <= code < len(DTYPES)) or min(shape, default=0) < 0:
        raise PlanError(f"malformed message header {values}: a message that is not ours "
                        "(or half of one) arrived where a header was expected")
    return tag, tuple(shape), DTYPES[code]


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
    works: tuple[Any, Any]  # header and payload sends
    tensors: tuple[Tensor, Tensor]  # header and payload, alive until the send completes
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
                 groups: dict[tuple[int, ...], Any] | None = None, match_by_tag: bool | None = None) -> None:
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
        self.allreduce_bytes = 0
        self.log: list[SentMessage] = []
        self._pending: list[_PendingSend] = []
        # Tags on the wire only where the backend honours them (see the module docstring).
        self.match_by_tag = dist.get_backend() == "gloo" if match_by_tag is None else match_by_tag
        self.early: dict[tuple[int, int], tuple[Tensor, int]] = {}  # (peer, tag) -> (payload, stamp) drained early
        self.last_stamp = 0  # the header stamp of the message recv() returned last
        self.peak_early = 0  # most payloads held early at once (0 when matching by tag)

    @classmethod
    def from_context(cls, ctx: Any, timeout: float | None = None,
                     match_by_tag: bool | None = None) -> "TorchCommunicator":
        """From a ``pulse_torch.dist.DistContext``: its device and its data-parallel / pipeline groups."""
        groups = {}
        if getattr(ctx, "dp_group", None) is not None:
            groups[tuple(sorted(ctx.layout.dp_ranks()))] = ctx.dp_group
        if getattr(ctx, "pp_group", None) is not None:
            groups[tuple(sorted(ctx.layout.pp_ranks()))] = ctx.pp_group
        return cls(device=ctx.device, timeout=timeout, groups=groups, match_by_tag=match_by_tag)

    def register_group(self, ranks: Sequence[int]) -> None:
        """Create the process group of ``ranks``; every rank must call this, in the same order."""
        key = tuple(sorted(ranks))
        group = dist.new_group(list(key))
        if self.rank in key:
            self.groups[key] = group

    # -- point to point ------------------------------------------------------------
    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None,
             stamp: int = 0) -> None:
        """Send asynchronously; ``stamp`` rides in the header (``last_stamp`` on the receiver)."""
        self._reap()
        code = tag_int(tag)
        payload = tensor.detach().to(self.device).contiguous()
        header = encode_header(payload, code, stamp).to(self.device)
        wire = code if self.match_by_tag else 0
        what = f"{tag} to rank {peer_rank}"
        try:
            works = (dist.isend(header, peer_rank, tag=wire), dist.isend(payload, peer_rank, tag=wire))
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: sending {what} failed ({exc})") from None
        self._pending.append(_PendingSend(works, (header, payload), peer_rank, what))
        nbytes = payload.numel() * payload.element_size()
        self.bytes_sent[peer_rank] = self.bytes_sent.get(peer_rank, 0) + nbytes
        self.header_bytes[peer_rank] = self.header_bytes.get(peer_rank, 0) + HEADER_BYTES
        self.log.append(SentMessage(peer_rank, code, str(getattr(tag, "name", "")),
                                    str(getattr(tag, "direction", "")), nbytes))

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        code = tag_int(tag)
        what = f"{tag} from rank {peer_rank}"
        if (peer_rank, code) in self.early:
            buf, self.last_stamp = self.early.pop((peer_rank, code))
            return buf
        while True:  # with tags: one pass; without: drain in send order until ours arrives
            got, buf, stamp = self._recv_one(peer_rank, code if self.match_by_tag else 0, timeout, what)
            if got == code:
                self.last_stamp = stamp
                return buf
            if self.match_by_tag or (peer_rank, got) in self.early:
                raise PlanError(f"rank {self.rank}: waiting for {what} (tag {code}), got tag {got}: "
                                "another message used the same tag")
            self.early[(peer_rank, got)] = (buf, stamp)
            self.peak_early = max(self.peak_early, len(self.early))

    def _recv_one(self, peer: int, wire: int, timeout: float | None, what: str) -> tuple[int, Tensor, int]:
        """The next message from ``peer`` under wire tag ``wire``: (its PULSE tag, payload, stamp)."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(lambda: dist.irecv(header, peer, tag=wire), timeout, f"the header of {what}")
        cpu = header.cpu()
        got, shape, dtype = decode_header(cpu)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(lambda: dist.irecv(buf, peer, tag=wire), timeout, what)
        return got, buf, int(cpu[-1])

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
