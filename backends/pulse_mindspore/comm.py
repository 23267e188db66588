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
send order, so a receive drains the peer's messages in send order and keeps
those that arrive before their turn until their own receive asks. The gloo
carrier sends with one tag, so it delivers in the same order (gloo matches by
peer and tag, in order). Byte counts are payload bytes (the tensors'), headers
counted apart, whatever the carrier.

Timeouts. MindSpore's ``CommHandle.wait()`` takes no timeout and the handle
cannot be polled (gloo's wait is bounded only by its group's timeout), so every
wait runs in a helper thread and the caller gives up
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

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from pulse.errors import PlanError
from pulse.runtime.errors import CommTimeout
from pulse.runtime.grad_sync import DeferredAllReduce
from pulse_mindspore.transport import GlooTransport, HcclTransport, LibOp, NoTransport, Op, Transport, \
    gloo_available, split_result

MAX_DIMS = 8
HEADER_LEN = 3 + MAX_DIMS
HEADER_BYTES = HEADER_LEN * 4  # int32: MessageTag.as_int() is 31 bits
DTYPES: tuple[Any, ...] = (ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int64, ms.int32, ms.int16,
                           ms.int8, ms.uint8, ms.bool_)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
P2P_DEVICES = ("Ascend",)  # where MindSpore's isend/irecv have kernels (HCCL)


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
    ops: tuple[Op, Op]  # header and payload sends (they keep their buffers alive)
    peer: int
    what: str


class MindSporeCommunicator:
    """``pulse.runtime.protocols.Communicator`` for one worker of an msrun job (after ``init()``).

    ``groups`` other than the world and single ranks are made up front with
    ``register_group`` (``mindspore.communication.create_group``, called by
    the group's members only). The launcher calls ``wait_sends()`` after each
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
        self.transport = transport or self._default_transport(p2p)

    def _default_transport(self, p2p: bool) -> Transport:
        if self.device_target in P2P_DEVICES:
            return HcclTransport(self.lib, self.world_group)
        why = f"rank {self.rank}: {p2p_unsupported(self.device_target)}"
        if p2p and gloo_available():
            return GlooTransport.join(self.rank, self.world_size, self.timeout)
        if gloo_available():
            why = f"rank {self.rank}: this job was set up without point-to-point messages (p2p=False)"
        return NoTransport(why)

    def register_group(self, ranks: Sequence[int]) -> None:
        """Create the group of ``ranks`` on its members; the world and single ranks need none."""
        key = tuple(sorted(ranks))
        if len(key) <= 1 or key == tuple(range(self.world_size)) or self.rank not in key:
            return
        name = "pulse_" + "_".join(map(str, key))
        self.mgmt.create_group(name, list(key))
        self.groups[key] = name

    # -- point to point ------------------------------------------------------------
    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        code = tag_int(tag)
        tensor = tensor.contiguous()  # the library sends the buffer as it lies in memory
        header = Tensor(encode_header(tensor, code))
        what = f"{tag} to rank {peer_rank}"
        try:  # one wire tag: messages match by order per pair (see the module docstring)
            sent = (self.transport.isend(header, peer_rank), self.transport.isend(tensor, peer_rank))
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: sending {what} failed ({_first_line(exc)})") from None
        self._pending.append(_PendingSend(sent, peer_rank, what))
        self.bytes_sent[peer_rank] = self.bytes_sent.get(peer_rank, 0) + int(tensor.nbytes)
        self.header_bytes[peer_rank] = self.header_bytes.get(peer_rank, 0) + HEADER_BYTES

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        code = tag_int(tag)
        what = f"{tag} from rank {peer_rank}"
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
                         timeout: float | None = None) -> "DeferredAllReduce":
        """A data-parallel bucket (``pulse.runtime.grad_sync``). The sum runs at ``wait()``: CPU
        mccl has no asynchronous all-reduce, so on MindSpore the buckets do not overlap the
        backward yet (on Ascend, ``mindspore.ops.communication.all_reduce(async_op=True)`` would)."""
        return DeferredAllReduce(self, tensor, list(group), timeout)

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
        name = self._group_name(key)
        if name is None:  # a group of one: nothing to add
            return tensor
        buf = tensor.copy() if isinstance(tensor, Parameter) else tensor  # never reduce into a weight
        try:
            out, handle = split_result(self.lib.all_reduce(buf, group=name, async_op=True), buf)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.rank}: {what} failed ({_first_line(exc)})") from None
        self._wait(LibOp(handle, out), timeout, what, host)
        return out

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
        failure: list[BaseException] = []
        data: list[np.ndarray] = []

        def finish() -> None:
            try:
                op.wait()
                out = op.result()
                if out is not None and (host or self.host_sync):
                    data.append(out.asnumpy())  # reading the result is what waits for the peers
            except Exception as exc:  # noqa: BLE001  (reported below, in the caller's thread)
                failure.append(exc)

        if seconds is None:
            finish()
        else:
            worker = threading.Thread(target=finish, name=f"pulse-wait-{what[:40]}", daemon=True)
            worker.start()
            worker.join(seconds)
            if worker.is_alive():
                raise CommTimeout(f"rank {self.rank}: {what} timed out after {seconds:g} s "
                                  "(a peer is stuck or gone; the operation cannot be cancelled, end the job)")
        if failure:
            raise CommTimeout(f"rank {self.rank}: {what} failed ({_first_line(failure[0])})")
        return data[0] if data else None


def _first_line(exc: BaseException) -> str:
    """MindSpore errors carry a C++ stack after a blank line: keep the message."""
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip() and not s.startswith("-")]
    return lines[0] if lines else type(exc).__name__
