"""What the runtime asks of a framework: the ``Backend`` and ``Communicator`` protocols.

Tensors are opaque to the core: it never looks inside one, it only hands them
to the backend (``add``, ``scale``, ``nbytes``, ...) and to the communicator.

Payload names (the keys of every tensor dict crossing these interfaces)::

    "h"          the main-path activation (a chunk's input and output)
    "temb", ...  shared inputs, by ``SharedInput.name``
    "a->b"       a skip tensor, by ``SkipEdge.key``

A chunk forward reads {"h", the skips it consumes, the shared inputs} and
returns {"h", the skips it produces, the shared inputs it produces}. Its
backward receives gradients for (a subset of) those outputs and returns one
gradient for every input named in ``grad_names``.

How PyTorch implements the compute half with autograd::

    def forward(self, chunk, inputs, grad_names):
        leaves = {k: (v.detach().requires_grad_() if k in grad_names else v)
                  for k, v in inputs.items()}
        with torch.enable_grad():
            outputs = chunk(leaves)
        return {k: v.detach() for k, v in outputs.items()}, (leaves, outputs, grad_names)

    def backward(self, ctx, output_grads):
        leaves, outputs, grad_names = ctx
        pairs = [(outputs[k], g) for k, g in output_grads.items() if outputs[k].requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return {k: leaves[k].grad if leaves[k].grad is not None
                else torch.zeros_like(leaves[k]) for k in grad_names}

Split backward (schedules with W): ``backward_input`` is ``torch.autograd.grad
(outs, [leaves[k] for k in grad_names], grads, retain_graph=True,
allow_unused=True)`` and returns (outs, grads) as the weight context;
``backward_weight`` is ``torch.autograd.backward(outs, grads, inputs=params)``.
A loss hook: ``out = outputs["h"].detach().requires_grad_(); loss =
F.mse_loss(out, batch["target"]); loss.backward(); return loss.item(),
{"h": out.grad}``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pulse.runtime.grad_sync import DeferredAllReduce
from pulse.runtime.wiring import ChunkIO
from pulse.spec import ModelSpec

Tensor = Any  # a framework tensor (torch.Tensor, mindspore.Tensor, numpy.ndarray)
ChunkHandle = Any  # whatever the backend builds for one chunk (an nn.Module, a Cell, ...)
SavedContext = Any  # what a forward keeps for its backward
WeightContext = Any  # what a split backward keeps for its weight half (the W action)
TensorDict = Mapping[str, Tensor]

# Every rank calls this for each microbatch it touches; it returns the same
# tensors on every rank of a pipeline: "h" (the first layer's input), the data
# shared inputs (timesteps, text context) and whatever the loss needs.
Batches = Callable[[int], TensorDict]
# (last chunk's outputs, the microbatch's batch dict) -> (loss value, d loss / d output)
LossFn = Callable[[TensorDict, TensorDict], "tuple[float, dict[str, Tensor]]"]


class DeviceClock(Protocol):
    """The accelerator's own clock, read where the host queues work (CUDA / NPU events).

    A call returns once its kernels are queued, so the host's clock around an action measures the
    enqueue, not the work. ``pulse profile`` times each action between two marks instead, while the
    host runs ahead as in training; a backend that has one sets it as ``device_clock`` (an optional
    attribute: none on a CPU, whose calls return when their work is done)."""

    def mark(self) -> Any:
        """A stamp the device takes when its queue reaches this point."""

    def seconds(self, start: Any, end: Any) -> float:
        """Device seconds from ``start`` to ``end`` (waits until the device has taken ``end``)."""


@runtime_checkable
class Backend(Protocol):
    """One per framework: builds chunks, runs them, owns parameters and optimizer."""

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> ChunkHandle:
        """The module for layers ``io.start .. io.end - 1``, built from ``Layer.attrs``.

        Parameters must not depend on where the chunk runs (seed per layer), so
        that every placement trains the same model.
        """
        ...

    def forward(self, chunk: ChunkHandle, inputs: TensorDict,
                grad_names: frozenset[str]) -> tuple[dict[str, Tensor], SavedContext]:
        """Run the chunk; keep in the context what ``backward`` will need."""
        ...

    def backward(self, ctx: SavedContext, output_grads: TensorDict) -> dict[str, Tensor]:
        """Accumulate parameter gradients; return a gradient for every name in ``grad_names``.

        An output missing from ``output_grads`` has a zero gradient; an input
        the chunk does not read gets zeros of its shape.
        """
        ...

    def backward_input(self, ctx: SavedContext,
                       output_grads: TensorDict) -> tuple[dict[str, Tensor], WeightContext]:
        """The input half of a split backward (schedules with W actions); may raise NotImplementedError."""
        ...

    def backward_weight(self, wctx: WeightContext) -> None:
        """The weight half: accumulate parameter gradients."""
        ...

    def zero_grad(self, chunk: ChunkHandle) -> None: ...

    def parameters(self, chunk: ChunkHandle) -> dict[str, Tensor]:
        """Parameters by a name unique in the model ("<layer>.<param>")."""
        ...

    def gradients(self, chunk: ChunkHandle) -> dict[str, Tensor]:
        """Accumulated parameter gradients, same names as ``parameters``."""
        ...

    def set_gradients(self, chunk: ChunkHandle, grads: TensorDict) -> None: ...

    def optimizer_step(self, chunk: ChunkHandle) -> None: ...

    def nbytes(self, t: Tensor) -> int: ...

    def add(self, a: Tensor, b: Tensor) -> Tensor: ...

    def scale(self, t: Tensor, factor: float) -> Tensor: ...

    def zeros_like(self, t: Tensor) -> Tensor: ...

    def to_numpy(self, t: Tensor) -> Any: ...

    def from_numpy(self, a: Any) -> Tensor: ...


@runtime_checkable
class Communicator(Protocol):
    """Point-to-point and collective messages between global ranks: every call the executor makes.

    ``bytes_sent[peer]`` counts the tensor payload bytes this rank sent to
    ``peer`` (headers some implementations need, e.g. a shape before a
    torch.distributed recv, are not counted): the numbers the simulator
    predicts. ``allreduce_bytes`` counts the tensor bytes handed to
    all_reduce, kept apart so pipeline traffic stays comparable.
    ``tag`` is a ``pulse.runtime.wiring.MessageTag``; ``tag.as_int()``
    gives frameworks that want an integer one that is unique per message.
    ``group`` is a list of global ranks (map it to a process group once).
    A call that gives up after ``timeout`` seconds raises
    ``pulse.runtime.CommTimeout``; the executor adds where it was stuck.

    ``recv_lookahead`` and the methods from ``send_group`` on have neutral answers in
    ``CommunicatorDefaults``, which a communicator with nothing special to do there inherits.
    """

    rank: int
    bytes_sent: dict[int, int]
    allreduce_bytes: int
    # How many receives the executor posts ahead with ``post_recv`` (each holds a buffer);
    # None or 0: the executor's own ``RECV_LOOKAHEAD``.
    recv_lookahead: int | None

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None: ...

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor: ...

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        """The element-wise sum over ``group`` (global ranks), returned (in place where the framework can)."""
        ...

    def barrier(self, timeout: float | None = None) -> None: ...

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        """One transfer's tensors (``tags[i]`` names ``tensors[i]``), as few wire messages as the
        framework allows (``pulse.traffic``); default: one ``send`` per tensor."""
        ...

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        """The tensors ``send_group`` sent under ``tags``, in that order; default: one ``recv`` per tag."""
        ...

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        """Post the receive of ``tags`` from ``peer_rank`` before its action is reached (gloo moves a
        message only once its receive is posted; a device overlaps the transfer with compute);
        ``recv_group`` later takes it. Default: nothing (the receive is made when it is reached)."""
        ...

    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        """Each peer's messages to this rank in one step, in the peer's send order, each as its
        tensors' ``as_int()`` keys (``pulse.runtime.message_order.inbound_order``), given once when
        the executor is built: what a communicator that matches messages by order (NCCL, HCCL)
        posts its receives by. Default: nothing (messages matched by tag need no order)."""
        ...

    def set_shapes(self, key: Any) -> None:
        """The coming step's shapes key: what its messages' shapes depend on besides the plan (the
        step's aspect-ratio bucket, ``pulse.train.bucket_sampler``; None without buckets), the same
        on every rank. A communicator that sizes receives from what it learnt (NCCL, HCCL) learns per
        key. Default: nothing (every message says its shapes)."""
        ...

    def all_reduce_async(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Any:
        """Start ``all_reduce``; return an object whose ``wait()`` gives the sum (the data-parallel
        buckets of ``pulse.runtime.grad_sync``). Default: the sum is taken at ``wait()``."""
        ...


class CommunicatorDefaults:
    """The neutral half of ``Communicator`` for a class that implements ``send``, ``recv`` and
    ``all_reduce``: per-tensor groups, no receive posted early, no message order to learn, an
    all-reduce run when waited for. Every communicator inherits it or implements these itself
    (``recv_group`` too where a receive may give up to be retried, as the fake's would-block:
    the loop here would drop what it took before)."""

    recv_lookahead: int | None = None

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        for tag, tensor in zip(tags, tensors):
            self.send(tensor, peer_rank, tag, timeout)  # type: ignore[attr-defined]

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        return [self.recv(peer_rank, tag, timeout) for tag in tags]  # type: ignore[attr-defined]

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        return None

    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        return None

    def set_shapes(self, key: Any) -> None:
        return None

    def all_reduce_async(self, tensor: Tensor, group: Sequence[int],
                         timeout: float | None = None) -> DeferredAllReduce:
        return DeferredAllReduce(self, tensor, list(group), timeout)


class CommunicatorWrapper:
    """A communicator around ``inner`` that changes a few calls (an emulated link, a recording):
    every ``Communicator`` member, and anything else ``inner`` offers, goes to ``inner`` unless
    the subclass overrides it, so a wrapper never hides what the wrapped one does."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (mid-construction, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def recv_lookahead(self) -> int | None:
        return self.inner.recv_lookahead

    @property
    def bytes_sent(self) -> dict[int, int]:
        return self.inner.bytes_sent

    @property
    def allreduce_bytes(self) -> int:
        return self.inner.allreduce_bytes

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        self.inner.send(tensor, peer_rank, tag, timeout)

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.inner.recv(peer_rank, tag, timeout)

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        self.inner.send_group(tensors, peer_rank, tags, timeout)

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        return self.inner.recv_group(peer_rank, tags, timeout)

    def post_recv(self, peer_rank: int, tags: Sequence[Any]) -> None:
        self.inner.post_recv(peer_rank, tags)

    def expect_inbound(self, order: dict[int, list[tuple[int, ...]]]) -> None:
        self.inner.expect_inbound(order)

    def set_shapes(self, key: Any) -> None:
        self.inner.set_shapes(key)

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        return self.inner.all_reduce(tensor, group, timeout)

    def all_reduce_async(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Any:
        return self.inner.all_reduce_async(tensor, group, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)
