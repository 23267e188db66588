"""The model as the profile holds it: one window of layers real at a time, the rest stand-ins.

::

    windows       the chunks the per-action cost is fitted on (layer 0, then about 3 layers each)
    walk (once)   window by window: its layers made real, run forward on one microbatch, released;
                  recorded: the main-path tensor at every window's start and at the model's end,
                  every skip and every layer-made shared input (``Boundaries``)
    each window   [stand-in 0..a) ──▶ layers a..b-1, real ──▶ [stand-in b..L)]   run by the executor
                  a stand-in's forward hands back the recorded tensors, its backward gradients
                  shaped like its inputs: no layer of it exists, on the host or the device

So a rank holds one window's layers, their gradients, optimizer state and
activations at a time, never the whole model (a user's SDXL UNet, built whole with
its AdamW state per measurement, took about 41 GB). Making a window's layers real
and releasing them is the backend's (``ProfileRig.real_layers``: a diffusers
model's layers materialized from its skeleton, then put back on the meta device;
zoo layers are built with their chunk and freed with it). A window's runs are
closed (``WindowRun.close``) before its layers are released.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Sequence, TypeVar

from pulse.encoders import EncoderSet
from pulse.placement import from_cuts
from pulse.profiling.runs import feed_of, one_chunk_per_layer
from pulse.runtime.protocols import Backend, LossFn, Tensor
from pulse.runtime.wiring import MAIN, ChunkIO, Wiring
from pulse.spec import ModelSpec

T = TypeVar("T")
# (layer names) -> a context inside which those layers are real on this rank
RealLayers = Callable[[Sequence[str]], ContextManager[None]]
# A stand-in's input gradient: its input scaled by this (a gradient's shape, dtype and device, and
# nonzero, so no kernel of the window's backward takes a path a real gradient would not)
STAND_IN_GRADIENT = 1e-3


def nothing_to_make(layers: Sequence[str]) -> ContextManager[None]:
    """``RealLayers`` of a backend that builds a chunk's layers with the chunk (zoo layers)."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Window:
    """Layers ``start .. end - 1``: what is real at once."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class Boundaries:
    """What the real layers made on one microbatch, for the stand-ins to hand back."""

    main: dict[int, Tensor] = field(default_factory=dict)  # layer i -> its main-path input (i = L: the output)
    skips: dict[str, Tensor] = field(default_factory=dict)  # skip key -> its value
    shared: dict[str, Tensor] = field(default_factory=dict)  # layer-made shared input -> its value

    def outputs(self, io: ChunkIO) -> dict[str, Tensor]:
        """What the chunk ``io`` returns: the main path after its last layer, its skips, its shared inputs."""
        return {MAIN: self.main[io.end], **{k: self.skips[k] for k in io.produces},
                **{n: self.shared[n] for n in io.shared_made}}


class _StandIn:
    """A chunk outside the window: the recorded outputs it hands back."""

    def __init__(self, io: ChunkIO, outputs: dict[str, Tensor]) -> None:
        self.io, self.outputs = io, outputs


@dataclass
class _StandInContext:
    inputs: dict[str, Tensor]
    grad_names: frozenset[str]


_NO_WEIGHTS = object()  # a stand-in's weight half: nothing to do


class WindowBackend:
    """``real`` for the chunks inside ``window``; every other chunk a stand-in replaying ``recorded``.

    Everything that is not about a chunk (tensor arithmetic, ``from_numpy``, the forward context)
    is ``real``'s."""

    def __init__(self, real: Backend, window: Window, recorded: Boundaries) -> None:
        self.real, self.window, self.recorded = real, window, recorded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def is_real(self, io: ChunkIO) -> bool:
        return self.window.start <= io.start and io.end <= self.window.end

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> Any:
        return self.real.build_chunk(spec, io) if self.is_real(io) else _StandIn(io, self.recorded.outputs(io))

    def forward(self, chunk: Any, inputs: Mapping[str, Tensor], grad_names: frozenset[str]) -> tuple[dict, Any]:
        if isinstance(chunk, _StandIn):
            return dict(chunk.outputs), _StandInContext(dict(inputs), grad_names)
        return self.real.forward(chunk, inputs, grad_names)

    def _stand_in_gradients(self, ctx: _StandInContext) -> dict[str, Tensor]:
        return {k: self.real.scale(ctx.inputs[k], STAND_IN_GRADIENT) for k in ctx.grad_names}

    def backward(self, ctx: Any, output_grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if isinstance(ctx, _StandInContext):
            return self._stand_in_gradients(ctx)
        return self.real.backward(ctx, output_grads)

    def backward_input(self, ctx: Any, output_grads: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Any]:
        if isinstance(ctx, _StandInContext):
            return self._stand_in_gradients(ctx), _NO_WEIGHTS
        return self.real.backward_input(ctx, output_grads)

    def backward_weight(self, wctx: Any) -> None:
        if wctx is not _NO_WEIGHTS:
            self.real.backward_weight(wctx)

    def zero_grad(self, chunk: Any) -> None:
        if not isinstance(chunk, _StandIn):
            self.real.zero_grad(chunk)

    def parameters(self, chunk: Any) -> dict[str, Tensor]:
        return {} if isinstance(chunk, _StandIn) else self.real.parameters(chunk)

    def gradients(self, chunk: Any) -> dict[str, Tensor]:
        return {} if isinstance(chunk, _StandIn) else self.real.gradients(chunk)

    def set_gradients(self, chunk: Any, grads: Mapping[str, Tensor]) -> None:
        if not isinstance(chunk, _StandIn):
            self.real.set_gradients(chunk, grads)

    def optimizer_step(self, chunk: Any) -> None:
        if not isinstance(chunk, _StandIn):
            self.real.optimizer_step(chunk)


@dataclass
class WindowRun:
    """One window's run: the executor's in-process run, and which of its chunks are real (chunk -> first layer)."""

    run: Any
    real_chunks: dict[int, int]

    def close(self) -> None:
        """Drop the run's chunks: their layers, gradients and optimizer state are freed now, not at the
        next garbage collection (an executor's dispatch table of bound methods is a reference cycle)."""
        for executor in self.run.executors:
            executor.chunks.clear()


@dataclass
class WindowedModel:
    """A spec whose layers are made real a window at a time (``cuts``: the windows' boundaries)."""

    spec: ModelSpec
    cuts: list[int]
    backend_of: Callable[[], Backend]  # a fresh backend; its chunks are real inside ``real_layers`` only
    real_layers: RealLayers
    microbatch_size: int
    seed: int = 0
    _recorded: Boundaries | None = field(default=None, repr=False)
    _open: list[WindowRun] = field(default_factory=list, repr=False)  # the current window's runs

    @property
    def windows(self) -> list[Window]:
        return [Window(a, b) for a, b in zip(self.cuts, self.cuts[1:])]

    def names(self, window: Window) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.spec.layers[window.start:window.end])

    def heaviest(self) -> Window:
        """The window of the most forward FLOPs: the one whose working set stands for the model's."""
        return max(self.windows, key=lambda w: sum(l.flops for l in self.spec.layers[w.start:w.end]))

    def each_window(self, body: Callable[[Window], T], windows: Sequence[Window] | None = None) -> list[T]:
        """``body(window)`` with that window's layers real, window after window. The runs ``body`` made
        are closed (their chunks, optimizer state and gradients freed) before the layers are released.
        The walk that records the stand-ins' tensors runs first, not inside a window (it makes every
        window real in turn)."""
        self.boundaries()
        return self._each_window(body, windows)

    def _each_window(self, body: Callable[[Window], T], windows: Sequence[Window] | None = None) -> list[T]:
        out = []
        for window in self.windows if windows is None else windows:
            with self.real_layers(self.names(window)):
                try:
                    out.append(body(window))
                finally:
                    while self._open:
                        self._open.pop().close()
        return out

    def boundaries(self) -> Boundaries:
        """The recorded tensors (walked through the model once, window by window, on first use)."""
        if self._recorded is None:
            self._recorded = self._walk()
        return self._recorded

    def _walk(self) -> Boundaries:
        spec, recorded = self.spec, Boundaries()
        layers = list(range(spec.num_layers + 1))
        wiring = Wiring(spec, from_cuts("sequential", layers, [0] * spec.num_layers, 1, "direct", "profile"))
        feed = feed_of(spec, self.microbatch_size, 1, self.seed)
        # the main path where a stand-in ends: at a window's start, one layer before it (``run``'s fit layout)
        kept = {w.start for w in self.windows} | {w.start - 1 for w in self.windows}
        state: dict[str, Any] = {}

        def walk(window: Window) -> None:
            backend = self.backend_of()
            batch = feed.batch(0, 0, 0).map(backend.from_numpy)
            for i in range(window.start, window.end):
                io = wiring.ios[i]
                if i in kept and not io.first:
                    recorded.main[i] = state[MAIN]
                inputs = {MAIN: batch[MAIN] if io.first else state[MAIN],
                          **{n: recorded.shared[n] for n in io.shared_in},
                          **{k: recorded.skips[k] for k in io.consumes},
                          **{n: batch[n] for n in io.data_inputs}}
                outputs = backend.forward(backend.build_chunk(spec, io), inputs, frozenset())[0]  # graph dropped
                state[MAIN] = outputs[MAIN]
                recorded.skips.update({k: outputs[k] for k in io.produces})
                recorded.shared.update({n: outputs[n] for n in io.shared_made})
        self._each_window(walk)
        recorded.main[spec.num_layers] = state[MAIN]
        return recorded

    def run(self, window: Window, loss: LossFn, split: bool, microbatches: int = 1, fit: bool = False,
            source: Any = None, encoders: EncoderSet | None = None) -> WindowRun:
        """The run of ``window`` (inside ``each_window``): its layers one chunk each on one device; or,
        ``fit``, as one chunk where a pipeline runs it: on a second device, its input arriving as a
        message (the per-action fit, and a plan's chunks: ``span_costs``); the first chunk on one device.

        Fit layout: device 1 runs a stand-in before the window when there is room for one, so it makes
        its copy of the batch there, not in the window's forward; only the window of layers 1.. (with
        layer 0 alone on device 0) makes it in its forward, which is what ``D`` is read from::

            window 0..b:   [0..b) d0 ─▶ [b..L) d0          (the pipeline's first chunk: makes the batch)
            window 1..3:   [0] d0 ─▶ [1..3] d1 ─▶ [4..L) d0
            window a..b:   [0..a-1) d1 ─ [a-1] d0 ─▶ [a..b) d1 ─▶ [b..L) d0
        """
        n, a, b = self.spec.num_layers, window.start, window.end
        if fit and a == 0:
            chunks, devices = [(0, 0)], 1
        elif fit:
            before = [(0, 1), (a - 1, 0)] if a >= 2 else [(0, 0)]
            chunks, devices = before + [(a, 1)], 2  # (first layer, device) of each chunk
        else:
            chunks, devices = ([(0, 0)] if a > 0 else []) + [(i, 0) for i in range(a, b)], 1
        if b < n:
            chunks.append((b, 0))
        cuts, on = [s for s, _ in chunks] + [n], [d for _, d in chunks]
        real = {c: s for c, (s, _) in enumerate(chunks) if a <= s < b}
        backend = WindowBackend(self.backend_of(), window, self.boundaries())
        run = one_chunk_per_layer(self.spec, backend, loss, self.microbatch_size, split=split, seed=self.seed,
                                  microbatches=microbatches, cuts=cuts, source=source, encoders=encoders,
                                  devices=devices, on=on)
        self._open.append(WindowRun(run, real))
        return self._open[-1]
