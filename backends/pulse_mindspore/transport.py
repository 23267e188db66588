"""The raw carriers under ``MindSporeCommunicator``: one message to one peer, no protocol.

::

    MindSporeCommunicator (comm.py): header + payload, order-safe drains, byte counts, timeouts
        │ isend(tensor, peer) -> op          irecv(shape, dtype, peer) -> op
        │ op.wait() blocks until done; op.result() is the received Tensor (after wait)
        ├── HcclTransport   Ascend: mindspore.ops.communication isend/irecv (HCCL), a group per direction
        ├── GlooTransport   CPU: the tensor's bytes over a torch.distributed gloo group
        └── NoTransport     CPU without torch, or a job that needs no send/recv: refuses in one line

Why gloo on CPU: MindSpore 2.10's CPU collectives (mccl) have all-reduce but
no send/recv (irecv has no CPU kernel; isend returns without sending). torch
is imported here lazily, only when a CPU pipeline asks for the carrier; the
all-reduces stay on mccl (``comm.py``).

Every carrier sends with one wire tag (0): HCCL matches point-to-point
messages by order per pair and takes no tag, and gloo matches by (peer, tag)
in order, so with a single tag both deliver a pair's messages in send order,
which is what the communicator's drain relies on.

Gloo rendezvous. msrun exports to every worker ``MS_SCHED_HOST`` and
``MS_SCHED_PORT`` (its scheduler), ``MS_WORKER_NUM`` and ``RANK_ID``. The
gloo group meets at a ``TCPStore`` served by rank 0 at ``MS_SCHED_HOST``,
port ``PULSE_GLOO_PORT`` (``pulse train`` exports a free one next to msrun's
``--master_port``), else ``MS_SCHED_PORT + 1``. Ranks and world size are
MindSpore's (``get_rank()``, ``get_group_size()`` after ``init()``), so both
groups number the workers alike. When the host is a loopback address, gloo's
own connections are put on ``lo`` (``GLOO_SOCKET_IFNAME``, unless exported).
torch's TCPStore takes no bind address (its server would listen on every
interface), so rank 0 binds the socket to ``MS_SCHED_HOST`` itself and hands it
over (``master_listen_fd``). Tested on one node only.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import socket
from math import prod
from typing import Any, MutableMapping, Protocol

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from pulse.errors import PlanError
from pulse.runtime.errors import CommTimeout

PORT_ENV = "PULSE_GLOO_PORT"


class Op(Protocol):
    def wait(self) -> None: ...

    def result(self) -> Tensor | None: ...


class Transport(Protocol):
    name: str

    def isend(self, tensor: Tensor, peer: int) -> Op: ...

    def irecv(self, shape: tuple[int, ...], dtype: Any, peer: int) -> Op: ...

    def add_group(self, ranks: tuple[int, ...]) -> None:
        """Called by every rank of the world for every group, in the same order (``register_group``)."""

    def meet(self, ranks: tuple[int, ...] | None = None) -> None:
        """Return once every rank of ``ranks`` (None: the world) has called it, or at once where the
        collectives need no help: see ``GlooTransport.meet``."""


def gloo_available() -> bool:
    """torch is importable (asked of importlib: importing it costs seconds and is not needed yet)."""
    return importlib.util.find_spec("torch") is not None


def split_result(result: Any, buf: Tensor) -> tuple[Tensor, Any]:
    """(output tensor, handle) from any of MindSpore's return conventions.

    In-place mode (2.10's default) returns the handle and writes into ``buf``;
    the functional mode returns (output, handle).
    """
    if isinstance(result, tuple):
        out, handle = result
        return (buf if out is None else out), handle
    return buf, result


class LibOp:
    """A MindSpore communication handle and the tensor it fills (None for a send, which keeps
    the tensor it sends alive until the op is dropped after its wait)."""

    def __init__(self, handle: Any, out: Tensor | None = None, keep: Tensor | None = None) -> None:
        self.handle, self.out, self.keep = handle, out, keep

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def result(self) -> Tensor | None:
        return self.out


class NoMeeting:
    """Carriers whose sums need no meeting first: HCCL's collectives wait as long as HCCL_EXEC_TIMEOUT (set
    from --timeout), and without a pipeline the ranks' steps are alike and reach each all-reduce together."""

    def add_group(self, ranks: tuple[int, ...]) -> None:
        pass

    def meet(self, ranks: tuple[int, ...] | None = None) -> None:
        pass


class HcclTransport(NoMeeting):
    """MindSpore's own isend/irecv (HCCL on Ascend), a communication group per direction.

    HCCL, like NCCL, runs a rank pair's point-to-point operations of one group on one stream in
    the order they were issued, and a send waits there for its receive: with both directions in
    one group, two ranks that each send to the other first wait forever (``pulse.runtime.
    rendezvous`` models it, ``tests/test_rendezvous.py`` shows the schedules it hangs). So the
    messages to a higher rank go in ``groups[0]`` and those to a lower one in ``groups[1]``, every
    rank's group over the whole world (``MindSporeCommunicator`` creates both on every rank)."""

    name = "hccl"

    def __init__(self, lib: Any, groups: tuple[str, str], rank: int) -> None:
        self.lib, self.groups, self.rank = lib, groups, rank

    def group(self, src: int, dst: int) -> str:
        return self.groups[0] if src < dst else self.groups[1]

    def isend(self, tensor: Tensor, peer: int) -> Op:
        return LibOp(self.lib.isend(tensor, dst=peer, group=self.group(self.rank, peer), tag=0), keep=tensor)

    def irecv(self, shape: tuple[int, ...], dtype: Any, peer: int) -> Op:
        buf = ops.zeros(shape, dtype)  # irecv fills a buffer of the header's shape and dtype
        out, handle = split_result(self.lib.irecv(buf, src=peer, group=self.group(peer, self.rank), tag=0), buf)
        return LibOp(handle, out)


class NoTransport(NoMeeting):
    """Where no carrier exists (or none was asked for): every call is ``why``, nothing is sent."""

    name = "none"

    def __init__(self, why: str) -> None:
        self.why = why

    def isend(self, tensor: Tensor, peer: int) -> Op:
        raise PlanError(self.why)

    def irecv(self, shape: tuple[int, ...], dtype: Any, peer: int) -> Op:
        raise PlanError(self.why)


class _GlooOp:
    """A gloo send or receive; a receive's bytes become a MindSpore tensor after ``wait()``."""

    def __init__(self, work: Any, buf: Any, shape: tuple[int, ...] | None = None, nptype: Any = None) -> None:
        self.work, self.buf, self.shape, self.nptype = work, buf, shape, nptype  # buf alive until done

    def wait(self) -> None:
        self.work.wait()

    def result(self) -> Tensor | None:
        if self.shape is None:
            return None
        return Tensor(self.buf.numpy().view(self.nptype).reshape(self.shape))


class GlooTransport:
    """MindSpore tensors as bytes over torch.distributed's gloo (CPU).

    A tensor travels as its raw bytes (a uint8 torch tensor): any dtype,
    bfloat16 included, crosses unchanged, and the receiver rebuilds it from
    the header's shape and dtype. The payload's byte count is the tensor's.
    """

    name = "gloo"
    _listener: socket.socket | None = None  # rank 0: the store's socket, kept open while the job runs

    def __init__(self, dist: Any, torch: Any, timeout: float | None = None) -> None:
        self.dist, self.torch = dist, torch
        self.wait = datetime.timedelta(seconds=timeout or 300.0)
        self.groups: dict[tuple[int, ...], Any] = {}  # a gloo group beside each of mccl's (add_group)

    @classmethod
    def join(cls, rank: int, world_size: int, timeout: float | None,
             environ: MutableMapping[str, str] = os.environ) -> "GlooTransport":
        """Every worker calls this once, after MindSpore's ``init()`` (it blocks until all have)."""
        host, port = gloo_rendezvous(environ)
        if host.startswith("127.") or host == "localhost":
            environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too
        import torch
        import torch.distributed as dist

        wait = datetime.timedelta(seconds=timeout or 300.0)
        try:  # a port taken or a worker that never comes: one line, like every communication failure
            if not dist.is_initialized():
                listener = _listen(host, port) if rank == 0 else None
                extra = {"master_listen_fd": listener.fileno()} if listener is not None else {}
                store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=wait, **extra)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait)
                cls._listener = listener  # the store serves on it for the job's lifetime
        except (OSError, RuntimeError, ValueError) as exc:
            first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
            raise CommTimeout(f"rank {rank}: joining the gloo group at {host}:{port} failed ({first})") from None
        return cls(dist, torch, timeout)

    def isend(self, tensor: Tensor, peer: int) -> Op:
        data = self.torch.from_numpy(np.ascontiguousarray(tensor.asnumpy()).reshape(-1).view(np.uint8))
        return _GlooOp(self.dist.isend(data, peer, tag=0), data)

    def irecv(self, shape: tuple[int, ...], dtype: Any, peer: int) -> Op:
        nptype = np.dtype(ms.dtype_to_nptype(dtype))
        buf = self.torch.empty(prod(shape) * nptype.itemsize, dtype=self.torch.uint8)
        return _GlooOp(self.dist.irecv(buf, peer, tag=0), buf, tuple(shape), nptype)

    def add_group(self, ranks: tuple[int, ...]) -> None:
        """A gloo group of ``ranks``, so that a sum over them can meet first (``meet``). torch's
        ``new_group`` is a collective over the whole world ("all processes ... enter this function,
        even if they are not going to be members of the group"), hence every rank adds every group, in
        the same order; its timeout is the job's (new_group's own default is gloo's 30 minutes)."""
        self.groups[ranks] = self.dist.new_group(list(ranks), timeout=self.wait)

    def meet(self, ranks: tuple[int, ...] | None = None) -> None:
        """A barrier over ``ranks``' gloo group (None: the world), bounded by the job's ``--timeout``.
        mccl's CPU all-reduce gives up when a peer is 30 s late ("Ring ReduceScatter wait receiving ...
        failed", whatever MS_RECEIVE_MSG_TIMEOUT says); a pipeline's ranks reach the step's sums that far
        apart at real size (SD v2's pp 2: worker 1's AdamW step over 754 M parameters), and at pp x dp a
        pipeline's ranks reach the gradient norm's sum as far apart, so they meet here first."""
        group = None if ranks is None else self.groups.get(ranks)
        if ranks is not None and group is None:
            raise PlanError(f"rank {self.dist.get_rank()}: no gloo group for ranks {list(ranks)}; add it on "
                            "every rank (register_group) before the step")
        try:
            if group is None:
                self.dist.barrier()
            else:
                self.dist.barrier(group=group)
        except RuntimeError as exc:
            first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
            rank = self.dist.get_rank()
            raise CommTimeout(f"rank {rank}: the gloo barrier before an all-reduce failed ({first})") from None

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def _listen(host: str, port: int) -> socket.socket:
    """The store's socket, bound to ``host`` only: TCPStore's own server would listen on every
    interface (``*:PORT``), so rank 0 hands it this socket (``master_listen_fd``), as
    ``pulse_torch.launch`` does for torchrun's store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def gloo_rendezvous(environ: MutableMapping[str, str] = os.environ) -> tuple[str, int]:
    """(host, port) of the gloo group's TCPStore, from what msrun (and ``pulse train``) export."""
    host = environ.get("MS_SCHED_HOST") or "127.0.0.1"
    if environ.get(PORT_ENV):
        text, source = environ[PORT_ENV], PORT_ENV
        offset = 0
    elif environ.get("MS_SCHED_PORT"):
        text, source = environ["MS_SCHED_PORT"], "MS_SCHED_PORT"
        offset = 1  # the scheduler holds its own port; the store takes the next
    else:
        raise PlanError(f"the gloo carrier needs a rendezvous port: run under msrun (MS_SCHED_PORT) "
                        f"or export {PORT_ENV}")
    if not text.isdigit() or not 0 < int(text) + offset < 65536:
        raise PlanError(f"{source}={text!r} is not a TCP port")
    return host, int(text) + offset
