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
messages against 0.4 ms with a connection per direction.

``bytes_sent`` counts tensor bytes only (what ``pulse.traffic`` and the
simulator predict); ``header_bytes`` counts the headers apart.

Matching. Gloo matches messages by (peer, tag): both halves carry
``MessageTag.as_int()`` and a receive takes exactly the message it names.
NCCL and HCCL ignore tags and match by order per pair, and a schedule's
receive order on one rank need not be its peer's send order (V schedules
often differ: the peer sends mb1's activation before mb0's gradient, the
receiver wants the gradient first). So without tags (``match_by_tag=False``,
the default off gloo) the receiver posts its receives in the sender's order,
which the plan gives (``expect_inbound``, from ``pulse.runtime.message_order``):
a message wanted later lands in its own posted buffer. A message class (one
transfer, direction and slot, every microbatch alike) sends a header with its
first message only; later ones are their bytes alone, into buffers sized from
the header both sides remember. Nothing deadlocks that would not deadlock with
tags: every receive posted before the wanted one is for a message sent before it.

On NCCL and HCCL, what keeps a pipeline from hanging (``tests/test_device_messages.py``
runs this module under a fake ProcessGroupNCCL; ``pulse.runtime.rendezvous`` the rules):

- a process group per direction (``p2p_groups``) on every backend: one group puts both
  directions between two ranks on one stream, and a send larger than NCCL's buffer holds
  that stream until its receive runs, so two ranks that both send first wait forever;
- the host never waits for a message: ``Work.wait()`` without a timeout orders the
  compute stream after it (with a timeout ProcessGroupNCCL polls from the host), and the
  process group's timeout is the watchdog; the step's loss stays on the device until the
  loop's one ``sum_values`` (``tests/test_device_messages.py`` counts the host's reads);
- receives are posted ahead (``post_recv``, as far as message layouts are known), so a
  transfer overlaps the compute before the receive that takes it.

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
from pulse.runtime.message_order import OrderedMessages
from pulse.runtime.protocols import CommunicatorDefaults
from pulse.traffic import MAX_TENSORS_PER_MESSAGE
from pulse_torch.wire import HEADER_BYTES, decode_header, encode_header, pack, payload_bytes, unpack

DEVICE_RECV_LOOKAHEAD = 4


def layout_of(tensors: Sequence[Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's shape and dtype: what a header says (``pulse_torch.wire``)."""
    return [(tuple(t.shape), t.dtype) for t in tensors]


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


class TorchCommunicator(CommunicatorDefaults):
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
        # (peer, key) -> (work, buffer, layout, stamp): receives posted in the sender's order, not yet taken
        self.in_order: dict[tuple[int, int], tuple[Any, Tensor, Any, int]] = {}
        self.last_stamp = 0  # the header stamp of the message recv() returned last
        self.peak_early = 0  # most payloads held early at once (0 when matching by tag)
        # (peer, tag) -> payload bytes of that tag's last message, sent / received: the inline size
        self.sent_sizes: dict[tuple[int, int], int] = {}
        self.recv_sizes: dict[tuple[int, int], int] = {}
        self.posted: dict[tuple[int, int], tuple[Any, Tensor, int]] = {}  # (peer, tag) -> (work, buffer, inline)
        self.p2p_groups = p2p_groups  # (to a higher rank, to a lower rank): see the module docstring
        # On a device (NCCL, HCCL) a wait is a stream dependency, not a host poll: the process
        # group's own timeout is the watchdog (``Work.wait(timeout)`` would block the host).
        self.stream_ordered = dist.get_backend() in ("nccl", "hccl")
        # How many receives the executor posts ahead. A posted receive holds its buffer in device
        # memory, which the memory model does not price: on a device a few suffice to overlap a
        # transfer with the compute before it (gloo needs many: it moves a message only once posted).
        self.recv_lookahead = DEVICE_RECV_LOOKAHEAD if self.stream_ordered else None
        self.ordered = OrderedMessages()  # without tags: receives in the sender's order, the plan's

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

    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        """Each peer's messages to this rank in one step, in the peer's send order, each as its tensors'
        keys (the executor reads it off the plan: ``pulse.runtime.message_order``); what receives
        follow without tags. A message is named by its first tensor's key."""
        self.ordered.expect({peer: [m[0] for m in messages] for peer, messages in order.items()})

    def set_shapes(self, key: Any) -> None:
        """The coming step's shapes key (its aspect-ratio bucket, the same on every rank): without tags,
        each message class's layout is learnt, and its receives sized, per key
        (``pulse.runtime.message_order.OrderedMessages``)."""
        self.ordered.use_shapes(key)

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
        payload = pack(tensors, self.device)
        wire = code if self.match_by_tag else 0
        what = f"{tags[0]}{f' (+{len(tags) - 1} more)' if len(tags) > 1 else ''} to rank {peer_rank}"
        if self.match_by_tag:
            header = encode_header(tensors, code, stamp).to(self.device).view(torch.uint8)
            inline = self.sent_sizes.get((peer_rank, code), 0)
            parts = (torch.cat([header, payload]),) if 0 < payload.numel() <= inline else (header, payload)
            self.sent_sizes[(peer_rank, code)] = payload.numel()
        elif self.ordered.needs_header(peer_rank, code, layout_of(tensors)):
            parts = (encode_header(tensors, code, stamp).to(self.device).view(torch.uint8), payload)
        else:
            parts = (payload,)
        try:
            group = self.direction_group(self.rank, peer_rank)
            works = tuple(dist.isend(part, peer_rank, tag=wire, group=group) for part in parts)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: sending {what} failed ({exc})") from None
        self._pending.append(_PendingSend(works, parts, peer_rank, what))
        self.wire_messages[peer_rank] = self.wire_messages.get(peer_rank, 0) + len(parts)
        if self.match_by_tag or len(parts) == 2:
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
        if not self.match_by_tag:
            return self._recv_in_order(peer_rank, code, timeout, what)
        got, tensors, stamp = self._recv_one(peer_rank, code, timeout, what)
        if got != code:
            raise PlanError(f"rank {self.rank}: waiting for {what} (tag {code}), got tag {got}: "
                            "another message used the same tag")
        self.last_stamp = stamp
        return tensors

    # -- without tags (NCCL, HCCL): in the sender's order, as the plan gives it ---------------------
    def _recv_in_order(self, peer: int, code: int, timeout: float | None, what: str) -> list[Tensor]:
        self._post_in_order(peer, code, timeout)
        held = [k for p, k in self.in_order if p == peer]  # this peer's posted receives, in its send order
        if code not in held:
            raise PlanError(f"rank {self.rank}: {what} received twice in one step")
        self.peak_early = max(self.peak_early, held.index(code))  # earlier messages held ahead of their turn
        work, buf, layout, stamp = self.in_order.pop((peer, code))
        self._wait(lambda: work, timeout, what)
        self.ordered.cursor.received(peer, code)
        self.last_stamp = stamp
        return unpack(buf, layout)

    def _post_in_order(self, peer: int, code: int, timeout: float | None, ahead: bool = False) -> None:
        """Post the receives of ``peer``'s messages up to ``code``, in its send order. A message of a
        class no header described yet gets its header received first, and waited for (once per
        class: the first step); posting ahead stops before such a message."""
        group = self.direction_group(peer, self.rank)
        for key in self.ordered.cursor.peek(peer, code):
            layout, stamp = self.ordered.known_layout(peer, key), 0
            if layout is None:
                if ahead:
                    return
                head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                self._wait(lambda: dist.irecv(head, peer, tag=0, group=group), timeout,
                           f"the header of message {key} from rank {peer}")
                got, layout, stamp = decode_header(head.view(torch.int64).cpu())
                if got != key:
                    raise PlanError(f"rank {self.rank}: expected message {key} from rank {peer}, its header says "
                                    f"{got}: the two ranks disagree on the plan's message order")
                self.ordered.learn(peer, key, layout)
            self.ordered.cursor.to_post(peer, key)
            buf = torch.empty(payload_bytes(layout), dtype=torch.uint8, device=self.device)
            try:
                work = dist.irecv(buf, peer, tag=0, group=group)
            except RuntimeError as exc:
                raise CommTimeout(f"rank {self.rank}: receiving message {key} from rank {peer} "
                                  f"failed ({exc})") from None
            self.in_order[(peer, key)] = (work, buf, layout, stamp)

    @property
    def early(self) -> dict[tuple[int, int], Any]:
        """Receives posted in the sender's order and not yet taken (none once a step is over)."""
        return self.in_order

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        """Post the receives of ``tags`` from ``peer_rank`` now, so that the sender can write them
        as soon as it sends (see the module docstring); ``recv_group`` later takes them. Only when
        tags match messages. Without tags, the receives of the peer's messages up to this one, in the
        peer's send order, as far as their layouts are known (a message's first step learns it)."""
        if not self.match_by_tag:
            for i in range(0, len(tags), MAX_TENSORS_PER_MESSAGE):
                self._post_in_order(peer_rank, tag_int(tags[i]), None, ahead=True)
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
        """The message from ``peer`` under tag ``wire``: (its PULSE tag, tensors, stamp)."""
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

    def sum_values(self, values: Sequence[float | Tensor], timeout: float | None = None) -> list[float]:
        """Bookkeeping numbers (loss, byte counts) summed over the world; not counted as traffic.

        A value may be a tensor on the device (the step's summed loss): it joins the others there,
        and the one read of the sums is the step's only wait of the host for the device.
        float64 keeps byte counts exact; HCCL on Ascend gets float32, which not every version
        reduces in float64."""
        dtype = torch.float32 if self.device.type == "npu" else torch.float64
        host = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in values], dtype=dtype)
        buf = host.to(self.device, non_blocking=self.stream_ordered)
        for i, v in enumerate(values):
            if torch.is_tensor(v):
                buf[i] = v.detach().reshape(()).to(device=self.device, dtype=dtype)
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
        """Start an operation and wait for it; timeouts and peer failures become CommTimeout.

        On a device the wait orders the current stream after the operation and returns (the host
        goes on queueing work); the process group's timeout, set when the job joined, is the
        watchdog. On gloo the host waits, at most ``timeout`` seconds."""
        seconds = None if self.stream_ordered else (self.timeout if timeout is None else timeout)
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
