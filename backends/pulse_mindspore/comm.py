"""PULSE's ``Communicator`` over MindSpore: HCCL on Ascend; on CPU, mccl all-reduce plus gloo send/recv.

What works where (MindSpore 2.10, tried under msrun)::

                         Ascend (HCCL)        CPU (mccl)
    all_reduce (group)   yes                  yes (ops.communication; comm_func's kernel is missing)
    barrier              1-element all-reduce (CPU has no Barrier kernel)
    isend / irecv        yes                  no: irecv has no kernel, isend returns without sending

So on CPU the point-to-point messages of a pipeline plan (pp > 1) go over
another carrier: a torch.distributed gloo group (``pulse_mindspore.transport``,
torch imported lazily), while every all-reduce stays on mccl. Without torch,
``send``/``recv`` on CPU say so in one line instead of hanging. The protocol
below is the same on every carrier; a carrier only moves one tensor to one peer.

One tensor on the wire is two messages, as in ``pulse_torch.comm``::

    sender                                       receiver
    isend(header: int32[3 + 8] = tag,  ───▶  irecv(header) -> tag, shape, dtype
          ndim, dtype code, shape)             allocate the buffer
    isend(payload)                     ───▶  irecv(payload)

irecv must be handed a buffer of the right shape and dtype, which only the
header knows. HCCL matches point-to-point messages by order per pair (its
send/recv take no tag), and a schedule's receive order need not be its peer's
send order. Once the executor hands over the plan's message order
(``expect_inbound``, ``pulse.runtime.message_order``), receives are posted in
the sender's order (ahead, ``post_recv``, as far as shapes are known), and a
tensor class (transfer, direction, slot: alike every microbatch) sends its
header with its first message only: both sides remember its shape and dtype,
and the host reads no header after the first step. Without that order (a
communicator used on its own), a receive drains the peer's messages in send
order and keeps those that arrive before their turn until their own receive asks. The gloo
carrier sends with one tag, so it delivers in the same order (gloo matches by
peer and tag, in order). Byte counts are payload bytes (the tensors'), headers
counted apart, whatever the carrier.

Timeouts. MindSpore's ``CommHandle.wait()`` takes no timeout and the handle
cannot be polled (gloo's wait is bounded only by its group's timeout), so every
wait runs on the communicator's one long-lived helper thread
(``pulse_mindspore.wait_worker``: not a thread per wait) and the caller gives up
after ``timeout`` seconds with ``CommTimeout`` (the stuck operation cannot be
cancelled: the job must end, as after a gloo timeout). The host blocks where
it reads a result, not in ``wait()`` (on mccl ``wait()`` returns at once; on
Ascend it orders the device streams), so the helper thread also reads what
the host needs: every result on CPU, headers and statistics everywhere. A
peer that dies makes gloo's receive fail at once (connection closed), which
becomes ``CommTimeout`` with gloo's first line. A
payload on Ascend stays on the device, its wait bounded by HCCL's own limits:
``HCCL_CONNECT_TIMEOUT`` (building links) and ``HCCL_EXEC_TIMEOUT`` (one
operation), which ``pulse_mindspore.train`` sets from ``--timeout`` before
``init()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from pulse.errors import PlanError
from pulse.runtime.errors import CommTimeout
from pulse.runtime.grad_sync import DeferredAllReduce
from pulse.runtime.message_order import OrderedMessages
from pulse.runtime.protocols import CommunicatorDefaults
from pulse_mindspore.transport import GlooTransport, HcclTransport, LibOp, NoTransport, Op, Transport, \
    gloo_available, split_result
from pulse_mindspore.wait_worker import WaitWorker

MAX_DIMS = 8
HEADER_LEN = 3 + MAX_DIMS
HEADER_BYTES = HEADER_LEN * 4  # int32: MessageTag.as_int() is 31 bits
DTYPES: tuple[Any, ...] = (ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int64, ms.int32, ms.int16,
                           ms.int8, ms.uint8, ms.bool_)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
P2P_DEVICES = ("Ascend",)  # where MindSpore's isend/irecv have kernels (HCCL)
ASYNC_BUCKET_DEVICES = ("Ascend",)  # where a bucket's all-reduce runs while the rank computes


def p2p_devices() -> tuple[str, ...]:
    """Where a pipeline's send/recv can run: Ascend (HCCL), and CPU when torch brings gloo."""
    return P2P_DEVICES + (("CPU",) if gloo_available() else ())


def p2p_unsupported(device_target: str) -> str:
    """The one line a point-to-point call on a device without a carrier raises."""
    return (f"point-to-point send/recv needs Ascend (HCCL) or, on CPU, torch (its gloo carries the "
            f"messages): MindSpore {ms.__version__} on {device_target} (mccl) has all-reduce but no "
            "send/recv and torch is not importable; install torch, use --pp 1 (data parallel) here, "
            "or --backend torch")


def encode_header(t: Tensor, tag: int) -> np.ndarray:
    """int32[HEADER_LEN]: (tag, ndim, dtype code, shape..., zeros)."""
    if len(t.shape) > MAX_DIMS or t.dtype not in _CODE:
        raise PlanError(f"cannot send a {len(t.shape)}-d {t.dtype} tensor (at most {MAX_DIMS} dims, "
                        f"dtypes {', '.join(str(d) for d in DTYPES)})")
    head = [tag, len(t.shape), _CODE[t.dtype], *t.shape]
    return np.array(head + [0] * (HEADER_LEN - len(head)), dtype=np.int32)


def decode_header(header: np.ndarray) -> tuple[int, tuple[int, ...], Any]:
    """(tag, shape, dtype) of the payload that follows."""
    values = [int(v) for v in np.asarray(header).reshape(-1)]
    tag, ndim, code = values[:3]
    shape = values[3:3 + ndim]
    if not (0 <= ndim <= MAX_DIMS and 0 <= code < len(DTYPES)) or min(shape, default=0) < 0:
        raise PlanError(f"malformed message header {values}: a message that is not ours "
                        "(or half of one) arrived where a header was expected")
    return tag, tuple(shape), DTYPES[code]


def tag_int(tag: Any) -> int:
    """``MessageTag.as_int()``, or the tag itself when it is an int already."""
    return tag.as_int() if hasattr(tag, "as_int") else int(tag)


def default_lib() -> ModuleType:
    """The collective functions: ``mindspore.ops.communication`` (2.9+), else ``communication.comm_func``.

    comm_func is deprecated since 2.9 and its all_reduce has no CPU kernel in
    2.10; both take (tensor, dst/src, group, tag) for isend/irecv and
    (tensor, group=..., async_op=...) for all_reduce.
    """
    try:
        from mindspore.ops import communication as ops_comm
        return ops_comm
    except ImportError:
        from mindspore.communication import comm_func
        return comm_func


@dataclass
class _PendingSend:
    ops: tuple[Op, ...]  # the header (if sent) and payload sends (they keep their buffers alive)
    peer: int
    what: str


# point-to-point messages to a higher rank, and to a lower one (``transport.HcclTransport``)
P2P_GROUPS = ("pulse_p2p_up", "pulse_p2p_down")


class MindSporeCommunicator(CommunicatorDefaults):
    """``pulse.runtime.protocols.Communicator`` for one worker of an msrun job (after ``init()``).
    A transfer's tensors go one message each (``send_group``/``recv_group``: the defaults).

    ``groups`` other than the world and single ranks are made up front with
    ``register_group``, which every rank calls for every group in one order
    (``mindspore.communication.create_group`` on the members; the carrier's
    group, gloo's on a CPU pipeline, on all). The launcher calls ``wait_sends()`` after each
    step. ``lib``, ``management``, ``device_target`` and ``transport`` are
    injectable so the tests can stand in for the communication library.

    The carrier of sends and receives (``transport``, when not given): HCCL on
    Ascend; on CPU, with ``p2p`` (the plan pipelines), a gloo group joined
    here by every worker at once (``GlooTransport.join``), else none: a
    data-parallel job on CPU never opens the gloo group it does not use.
    """

    def __init__(self, *, timeout: float | None = None, device_target: str | None = None,
                 lib: Any = None, management: Any = None, transport: Transport | None = None,
                 p2p: bool = False) -> None:
        if management is None:
            from mindspore import communication as management
        self.mgmt = management
        self.lib = default_lib() if lib is None else lib
        self.rank = int(management.get_rank())
        self.world_size = int(management.get_group_size())
        self.world_group = str(management.GlobalComm.WORLD_COMM_GROUP)
        self.device_target = device_target or ms.get_context("device_target")
        self.host_sync = self.device_target == "CPU"  # see "Timeouts" in the module docstring
        self.timeout = timeout  # used when a call passes none
        self.groups: dict[tuple[int, ...], str] = {}
        self.bytes_sent: dict[int, int] = {}
        self.header_bytes: dict[int, int] = {}
        self.allreduce_bytes = 0
        self.early: dict[tuple[int, int], Tensor] = {}  # (peer, tag) -> payload drained before its turn
        self.peak_early = 0
        self._pending: list[_PendingSend] = []
        self.waiter = WaitWorker(f"pulse-wait-rank{self.rank}")  # bounds every wait (one thread)
        self.ordered = OrderedMessages()  # the plan's message order, once the executor hands it over
        self.in_order: dict[tuple[int, int], Op] = {}  # (peer, key) -> its receive, posted in send order
        self.transport = transport or self._default_transport(p2p)

    def _default_transport(self, p2p: bool) -> Transport:
        if self.device_target in P2P_DEVICES:
            world = list(range(self.world_size))
            for name in P2P_GROUPS:  # every rank, in the same order: a group per direction
                self.mgmt.create_group(name, world)
            return HcclTransport(self.lib, P2P_GROUPS, self.rank)
        why = f"rank {self.rank}: {p2p_unsupported(self.device_target)}"
        if p2p and gloo_available():
            return GlooTransport.join(self.rank, self.world_size, self.timeout)
        if gloo_available():
            why = f"rank {self.rank}: this job was set up without point-to-point messages (p2p=False)"
        return NoTransport(why)

    def register_group(self, ranks: Sequence[int]) -> None:
        """Create the group of ``ranks`` on its members; the world and single ranks need none. Every rank
        calls it for every group, in the same order: the carrier's group (``Transport.add_group``, gloo's on
        a CPU pipeline) is made by the whole world."""
        key = tuple(sorted(ranks))
        if len(key) <= 1 or key == tuple(range(self.world_size)):
            return
        self.transport.add_group(key)
        if self.rank not in key:
            return
        name = "pulse_" + "_".join(map(str, key))
        self.mgmt.create_group(name, list(key))
        self.groups[key] = name

    # -- point to point ------------------------------------------------------------
    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        """Each peer's messages to this rank in one step, in the peer's send order, each as its tensors'
        keys (the executor reads it off the plan: ``pulse.runtime.message_order``). From then on a
        tensor is a message of its own, posted in that order, with a header only the first time its
        class (transfer, direction, slot) crosses: its later messages are its bytes alone."""
        self.ordered.expect({peer: [k for m in messages for k in m] for peer, messages in order.items()})

    def set_shapes(self, key: Any) -> None:
        """The coming step's shapes key (its aspect-ratio bucket, the same on every rank): without tags,
        each message class's layout is learnt, and its receives sized, per key
        (``pulse.runtime.message_order.OrderedMessages``)."""
        self.ordered.use_shapes(key)

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        code = tag_int(tag)
        tensor = tensor.contiguous()  # the library sends the buffer as it lies in memory
        what = f"{tag} to rank {peer_rank}"
        header = not self.ordered.cursor.order or self.ordered.needs_header(
            peer_rank, code, (tuple(tensor.shape), tensor.dtype))
        parts = ((Tensor(encode_header(tensor, code)),) if header else ()) + (tensor,)
        try:  # one wire tag: messages match by order per pair (see the module docstring)
            sent = tuple(self.transport.isend(part, peer_rank) for part in parts)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: sending {what} failed ({_first_line(exc)})") from None
        self._pending.append(_PendingSend(sent, peer_rank, what))
        self.bytes_sent[peer_rank] = self.bytes_sent.get(peer_rank, 0) + int(tensor.nbytes)
        if header:
            self.header_bytes[peer_rank] = self.header_bytes.get(peer_rank, 0) + HEADER_BYTES

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        """Post the receives of the peer's messages up to these, in its send order, as far as their
        layouts are known (once the plan's order was handed over; else nothing)."""
        if self.ordered.cursor.order:
            for tag in tags:
                self._post_in_order(peer_rank, tag_int(tag), None, ahead=True)

    def _post_in_order(self, peer: int, code: int, timeout: float | None, ahead: bool = False) -> None:
        for key in self.ordered.cursor.peek(peer, code):
            layout = self.ordered.known_layout(peer, key)
            if layout is None:  # its class's first message: its header says its shape and dtype
                if ahead:
                    return
                _, header = self._irecv((HEADER_LEN,), ms.int32, peer, timeout,
                                        f"the header of message {key} from rank {peer}", host=True)
                got, shape, dtype = decode_header(header)
                if got != key:
                    raise PlanError(f"rank {self.rank}: expected message {key} from rank {peer}, its header "
                                    f"says {got}: the two ranks disagree on the plan's message order")
                layout = (shape, dtype)
                self.ordered.learn(peer, key, layout)
            self.ordered.cursor.to_post(peer, key)
            try:
                self.in_order[(peer, key)] = self.transport.irecv(layout[0], layout[1], peer)
            except RuntimeError as exc:
                raise CommTimeout(f"rank {self.rank}: receiving message {key} from rank {peer} failed "
                                  f"({_first_line(exc)})") from None

    def _recv_in_order(self, peer: int, code: int, timeout: float | None, what: str) -> Tensor:
        self._post_in_order(peer, code, timeout)
        held = [k for p, k in self.in_order if p == peer]
        if code not in held:
            raise PlanError(f"rank {self.rank}: {what} received twice in one step")
        self.peak_early = max(self.peak_early, held.index(code))  # earlier messages held ahead of their turn
        op = self.in_order.pop((peer, code))
        self._wait(op, timeout, what)
        self.ordered.cursor.received(peer, code)
        out = op.result()
        assert out is not None
        return out

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        code = tag_int(tag)
        what = f"{tag} from rank {peer_rank}"
        if self.ordered.cursor.order:
            return self._recv_in_order(peer_rank, code, timeout, what)
        if (peer_rank, code) in self.early:
            return self.early.pop((peer_rank, code))
        while True:  # drain in send order until ours arrives
            got, buf = self._recv_one(peer_rank, timeout, what)
            if got == code:
                return buf
            if (peer_rank, got) in self.early:
                raise PlanError(f"rank {self.rank}: waiting for {what} (tag {code}), got tag {got} twice: "
                                "two messages used the same tag")
            self.early[(peer_rank, got)] = buf
            self.peak_early = max(self.peak_early, len(self.early))

    def _recv_one(self, peer: int, timeout: float | None, what: str) -> tuple[int, Tensor]:
        """The next message from ``peer``: (its PULSE tag, its payload)."""
        _, header = self._irecv((HEADER_LEN,), ms.int32, peer, timeout, f"the header of {what}", host=True)
        got, shape, dtype = decode_header(header)
        payload, _ = self._irecv(shape, dtype, peer, timeout, what)
        return got, payload

    def _irecv(self, shape: tuple[int, ...], dtype: Any, peer: int, timeout: float | None, what: str,
               host: bool = False) -> tuple[Tensor, np.ndarray | None]:
        try:
            op = self.transport.irecv(shape, dtype, peer)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: receiving {what} failed ({_first_line(exc)})") from None
        data = self._wait(op, timeout, what, host)
        out = op.result()
        assert out is not None
        return out, data

    def wait_sends(self, timeout: float | None = None) -> None:
        """Block until every send so far has completed (call before a step ends)."""
        pending, self._pending = self._pending, []
        for p in pending:
            for op in p.ops:
                self._wait(op, timeout, f"the send of {p.what}")

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        """The sum over ``group``, in place on ``tensor`` where MindSpore does it in place."""
        self.wait_sends(timeout)
        key = tuple(sorted(group))
        out = self._sum(tensor, key, timeout, f"all-reduce of {tensor.size} elements over ranks {list(key)}")
        self.allreduce_bytes += int(tensor.nbytes)
        return out

    def all_reduce_async(self, tensor: Tensor, group: Sequence[int],
                         timeout: float | None = None) -> "DeferredAllReduce | LaunchedAllReduce":
        """A data-parallel bucket (``pulse.runtime.grad_sync``), launched at its chunk's AR action.

        Ascend: HCCL's all-reduce starts now, asynchronously (``mindspore.ops.communication.all_reduce``
        with ``async_op=True`` returns a CommHandle, "an asynchronous work handle":
        https://www.mindspore.cn/docs/zh-CN/stable/api_python/ops/mindspore.ops.communication.all_reduce.html),
        and overlaps the rest of the backward; ``wait()`` at the step's end orders the streams.
        CPU (mccl): deferred to ``wait()``. Tried on MindSpore 2.10 under msrun: with ops launched
        blocking (``launch_blocking_on_cpu``, PULSE's CPU setting) the async call returns only when
        every peer has made it (3.0 s behind a peer 3 s late), so launched at AR it would hold the
        rank mid-step for its slowest replica, overlapping nothing. ``pulse_mindspore.traits``
        tells the simulator which (``deferred_buckets`` on CPU only).
        """
        if self.device_target not in ASYNC_BUCKET_DEVICES:
            return DeferredAllReduce(self, tensor, list(group), timeout)
        key = tuple(sorted(group))
        what = f"data-parallel bucket of {tensor.size} elements over ranks {list(key)}"
        op = self._launch(tensor, key, what)  # no wait_sends first: the loop waits for them at the step's end
        self.allreduce_bytes += int(tensor.nbytes)
        return LaunchedAllReduce(self, op, timeout, what)

    def barrier(self, timeout: float | None = None) -> None:
        """Nobody leaves until everybody arrived: a one-element all-reduce over the world (not counted)."""
        self.wait_sends(timeout)
        self._sum(Tensor(np.ones(1, np.float32)), tuple(range(self.world_size)), timeout,
                  f"barrier over all {self.world_size} ranks")

    def sum_values(self, values: Sequence[float], timeout: float | None = None) -> list[float]:
        """Bookkeeping numbers (loss, byte counts) summed over the world; not counted as traffic."""
        buf = Tensor(np.asarray(values, np.float32))
        out = self._sum(buf, tuple(range(self.world_size)), timeout, "all-reduce of the step's statistics", True)
        return [float(v) for v in out.asnumpy()]  # read (and waited for) in _sum's helper thread already

    def _sum(self, tensor: Tensor, key: tuple[int, ...], timeout: float | None, what: str,
             host: bool = False) -> Tensor:
        op = self._launch(tensor, key, what)
        if op.handle is not None:
            self._wait(op, timeout, what, host)
        out = op.result()
        assert out is not None
        return out

    def _launch(self, tensor: Tensor, key: tuple[int, ...], what: str) -> LibOp:
        """Start the sum of ``tensor`` over ``key`` (a group of one: nothing to add, no handle). A sum starts
        once every rank of its group is there (``Transport.meet``: mccl's own wait is short)."""
        name = self._group_name(key)
        if name is None:
            return LibOp(None, tensor)
        self.transport.meet(None if name == self.world_group else key)
        buf = tensor.copy() if isinstance(tensor, Parameter) else tensor  # never reduce into a weight
        try:
            out, handle = split_result(self.lib.all_reduce(buf, group=name, async_op=True), buf)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: {what} failed ({_first_line(exc)})") from None
        return LibOp(handle, out)

    def _group_name(self, key: tuple[int, ...]) -> str | None:
        if self.rank not in key:
            raise PlanError(f"rank {self.rank} is not in the group {list(key)} it was asked to reduce over")
        if len(key) == 1:
            return None
        if key == tuple(range(self.world_size)):
            return self.world_group
        if key not in self.groups:
            raise PlanError(f"rank {self.rank}: no communication group for ranks {list(key)}; create it on "
                            "its members with register_group before the step")
        return self.groups[key]

    def _wait(self, op: Op, timeout: float | None, what: str, host: bool = False) -> np.ndarray | None:
        """Wait at most ``timeout`` seconds for ``op`` and, when the host needs it (``host``, or
        on CPU always), for its result's data, which is returned as numpy."""
        seconds = self.timeout if timeout is None else timeout

        def finish() -> np.ndarray | None:
            op.wait()
            out = op.result()
            if out is not None and (host or self.host_sync):
                return out.asnumpy()  # reading the result is what waits for the peers
            return None

        try:
            return self.waiter.run(finish, seconds)
        except TimeoutError:
            raise CommTimeout(f"rank {self.rank}: {what} timed out after {seconds:g} s "
                              "(a peer is stuck or gone; the operation cannot be cancelled, end the job)") from None
        except Exception as exc:  # noqa: BLE001  (the library's failure, in one line)
            raise CommTimeout(f"rank {self.rank}: {what} failed ({_first_line(exc)})") from None


@dataclass
class LaunchedAllReduce:
    """A bucket whose all-reduce is already running (Ascend); ``wait()`` bounds it and returns the sum."""

    comm: MindSporeCommunicator
    op: LibOp
    timeout: float | None
    what: str

    def wait(self) -> Tensor:
        self.comm._wait(self.op, self.timeout, self.what)
        out = self.op.result()
        assert out is not None
        return out


def _first_line(exc: BaseException) -> str:
    """MindSpore errors carry a C++ stack after a blank line: keep the message."""
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip() and not s.startswith("-")]
    return lines[0] if lines else type(exc).__name__
