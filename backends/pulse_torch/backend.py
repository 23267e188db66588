"""PULSE's PyTorch ``Backend``: chunks of ``build_layer`` modules run under autograd.

One chunk forward, as the stage executor sees it::

    inputs {"h", skips it consumes, shared inputs}
        │ detach; leaves require grad where ChunkIO.grad_names says
        ▼
    layer_i(h, shared, [skips whose dst is layer_i, spec order]) -> (h, made shared)
        │ a layer that is a skip source leaves its output in the skip table
        ▼
    outputs {"h", skips it produces, shared inputs it makes}  (detached copies)

Backward is ``torch.autograd.backward(outputs, grads)`` and reads the leaves'
``.grad``; the split backward of zero-bubble schedules takes the input half
with ``torch.autograd.grad(..., retain_graph=True)``, keeping the gradients
where the parameters' paths join it, and the weight half later from those
(``pulse_torch.weight_grads``): the graph is walked once. A chunk whose inputs
need no gradient (the first) does all of it in W, from its outputs.

Recomputation (chunks in ``recompute``, the plan's): the forward runs under
``torch.no_grad`` and keeps its inputs (detached) and the RNG state; the
backward (or B of a split one) first re-runs the forward with autograd from
that state, under the same ``forward_context`` (autocast), then proceeds as
above, so W walks the graph B rebuilt::

    F   no_grad: chunk(inputs) -> outputs        keep: inputs, RNG state
    B   enable_grad: chunk(inputs) -> graph      (same RNG draws: dropout matches)
        autograd as without recomputation; the graph is dropped after B (or W) Parameters are seeded per layer name
(``pulse_torch.model.layer_generator``), so any placement of a spec trains the
same weights as ``build_model(spec, seed=...)``.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from pulse.layers.chunk_layout import SkipWiring, param_name, run_chunk
from pulse.runtime.tensor_arithmetic import OperatorArithmetic
from pulse.runtime.wiring import ChunkIO
from pulse.spec import ModelSpec
from pulse_torch.layers import build_layer
from pulse_torch.model import layer_generator
from pulse_torch.optimizers import OptimizerSettings, optimizer_of, steps_here
from pulse_torch.weight_grads import WeightHalf, input_half, weight_half


class TorchChunk(nn.Module):
    """Layers ``io.start .. io.end - 1`` of a spec and the skip wiring between them."""

    def __init__(self, spec: ModelSpec, io: ChunkIO, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.io = io
        self.layers = nn.ModuleDict(layers)
        self.wiring = SkipWiring.of(spec, layers)
        self.optimizer: torch.optim.Optimizer | None = None

    def forward(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:  # type: ignore[override]
        return run_chunk(self.layers, self.wiring, self.io, inputs)


@dataclass
class _Saved:
    """What a chunk forward keeps for its backward: the graph's ends (``outputs`` None: the chunk
    recomputes; ``leaves`` are then its detached inputs and ``rng`` the state its forward drew from)."""

    chunk: TorchChunk
    leaves: dict[str, Tensor]
    outputs: dict[str, Tensor] | None
    grad_names: frozenset[str]
    rng: tuple[Tensor, Tensor | None] | None = None


@dataclass
class _WeightWork:
    """The weight half of a split backward: the gradients B kept (``half``), or, where B kept
    none, the graph's outputs and their gradients to walk from."""

    chunk: TorchChunk
    outputs: list[Tensor]
    grads: list[Tensor]
    half: WeightHalf | None = None


NORM_ROW = 1024  # elements each fp32 partial norm accumulates before the partials are added in fp64


def _square_sum(g: Tensor) -> Tensor:
    """Sum of ``g``'s squares, float64, in one pass over ``g``: fp32 norms of rows of ``NORM_ROW``
    elements (no temporary of ``g``'s size), squared and added in fp64; other dtypes through a
    float64 copy. A float64 copy of every gradient cost SD v2's larger stage 4 s a step on a CPU,
    ``square().sum()`` a third of that. Within fp32 rounding (~1e-7) of the fp64 sum, as exact as
    the fp32 all-reduce after it; a whole tensor's fp32 norm missed by 0.2% at 50M elements."""
    if g.dtype != torch.float32:
        return g.double().pow(2).sum()
    flat = g.reshape(-1)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1).double().square().sum()
    return rows + flat[whole:].double().square().sum()


# elements per fp32 norm on an accelerator: its reductions add in trees, not along one running sum
FOREACH_PIECE = 1 << 20


def squares_of(grads: list[Tensor], device: torch.device) -> Tensor:
    """Sum of every gradient's squares, float64, on ``device``.

    On a CPU each tensor in rows (``_square_sum``): its fp32 norm of a whole tensor adds along
    running sums (2.5e-5 off at 1 M elements, 0.7% at 50 M) and a launch costs little there. On an
    accelerator a per-tensor loop is ~10 kernel launches a tensor, host-bound: SD v2's 686 gradients
    took 84.6 ms on an H200 (13% of a 627 ms step), one ``torch._foreach_norm`` (what
    ``torch.nn.utils.clip_grad_norm_`` launches) 2.8 ms (benchmarks/results/step_parts.json); its
    norms of pieces of at most FOREACH_PIECE elements, squared and added in fp64."""
    if device.type != "cpu":
        return foreach_squares(grads, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += _square_sum(g)
    return total


def foreach_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """``squares_of`` on an accelerator: fp32 gradients in one foreach norm over pieces, others via fp64."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    pieces = [p for g in grads if g.dtype == torch.float32 for p in g.reshape(-1).split(FOREACH_PIECE)]
    if pieces:
        total += torch.stack(torch._foreach_norm(pieces)).double().square().sum()
    for g in grads:
        if g.dtype != torch.float32:
            total += g.double().pow(2).sum()
    return total


class TorchBackend(OperatorArithmetic):
    """``pulse.runtime.protocols.Backend`` for PyTorch.

    ``dtype`` is the training precision (floating inputs are cast to it);
    ``device`` where chunks live. ``optimizer`` (``pulse.optimizers``) and its
    hyper-parameters: one per chunk where it is element-wise (equal to one over the
    rank's chunks), one over all of the rank's chunks (``built``) where not
    (``pulse_torch.optimizers.optimizer_of``). Clipping by the pipeline's global norm is the training loop's
    (``pulse.train.loop.clip_gradients``): a chunk cannot see the global norm.
    """

    def __init__(self, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, recompute: Iterable[int] = (),
                 optimizer: str = "adamw") -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.optimizer_name = optimizer
        # the chunks this backend built, in order (a shared optimizer's); weak: a profile's released windows go
        self._chunk_refs: list[weakref.ref[TorchChunk]] = []
        self.ema: dict[str, Tensor] = {}  # EMA weights of this rank's parameters (``ema_update``)
        self.ema_steps = 0  # EMA updates so far: the loop counts them, checkpoints keep them
        self.recompute = frozenset(recompute)  # chunk indices (``Plan.recompute``)
        self.evaluating = False  # inside ``no_grad()``: forwards build no graph and keep nothing
        # What every chunk forward runs under, the recomputed one included (``job.with_autocast``)
        self.forward_context: Callable[[], ContextManager] = contextlib.nullcontext
        # The device's own overflow status, read and cleared: Ascend in saturation mode, where an fp16
        # overflow is +-max and never inf (``pulse_torch.device_support.saturation_overflow_flag``)
        self.device_overflow: Callable[[], bool] | None = None
        self._found_inf: Tensor | None = None  # the last unscale's found-inf (``overflowed``)
        # the chunks' gradients watched (``watch_gradients``): each told of every parameter W accumulates
        self._watchers: list[Callable[[Tensor], None]] = []

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> TorchChunk:
        layers = {}
        for layer in spec.layers[io.start:io.end]:
            layers[layer.name] = build_layer(layer, device=self.device, dtype=self.dtype,
                                             generator=layer_generator(self.seed, layer.name))
        return self.remember(TorchChunk(spec, io, layers))

    def remember(self, chunk: TorchChunk) -> TorchChunk:
        """Count ``chunk`` among the rank's (``built``): a shared optimizer steps them all."""
        self._chunk_refs.append(weakref.ref(chunk))
        return chunk

    @property
    def built(self) -> list[TorchChunk]:
        """The chunks this backend built that still exist, in the order it built them."""
        return [c for c in (ref() for ref in self._chunk_refs) if c is not None]

    # -- compute -------------------------------------------------------------------
    def place(self, t: Tensor) -> Tensor:
        """On this backend's device; floating tensors in the training dtype."""
        if not isinstance(t, Tensor):
            t = torch.as_tensor(t)
        dtype = self.dtype if t.is_floating_point() else t.dtype
        return t.to(device=self.device, dtype=dtype)

    def forward(self, chunk: TorchChunk, inputs: Mapping[str, Tensor],
                grad_names: frozenset[str]) -> tuple[dict[str, Tensor], _Saved]:
        # contiguous leaves: a channels-last input crashes a convolution's split weight gradient
        # (see layers/unet_layers.py Transformer2D); a no-op for the usual contiguous tensor
        placed = {k: self.place(v).detach().contiguous() for k, v in inputs.items()}
        if self.evaluating:  # a forward-only pass: nothing is kept for a backward
            with self.forward_context(), torch.no_grad():
                outputs = chunk(placed)
            return {k: v.detach() for k, v in outputs.items()}, None  # type: ignore[return-value]
        if chunk.io.index in self.recompute:
            rng = self._rng_state()
            with self.forward_context(), torch.no_grad():
                outputs = chunk(placed)
            return {k: v.detach() for k, v in outputs.items()}, _Saved(chunk, placed, None, grad_names, rng)
        saved = self._run_with_graph(chunk, placed, grad_names)
        return {k: v.detach() for k, v in saved.outputs.items()}, saved

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[None]:
        """A forward-only pass (``pulse.runtime.forward_only``): chunk forwards under ``torch.no_grad``,
        their contexts empty (a validation loss needs no graph, and builds none)."""
        before, self.evaluating = self.evaluating, True
        try:
            yield
        finally:
            self.evaluating = before

    def _run_with_graph(self, chunk: TorchChunk, placed: Mapping[str, Tensor],
                        grad_names: frozenset[str]) -> _Saved:
        leaves = {k: v.detach().requires_grad_() if k in grad_names and v.is_floating_point() else v
                  for k, v in placed.items()}
        with self.forward_context(), torch.enable_grad():
            outputs = chunk(leaves)
        return _Saved(chunk, leaves, outputs, grad_names)

    def _rng_state(self) -> tuple[Tensor, Tensor | None]:
        """The CPU generator's state and this device's (as ``torch.utils.checkpoint`` keeps them)."""
        accel = None if self.device.type == "cpu" else _device_module(self.device).get_rng_state(self.device)
        return torch.get_rng_state(), accel

    def _graph(self, ctx: _Saved) -> _Saved:
        """``ctx`` with a graph: itself, or the recomputed forward's from the inputs and RNG state it kept.

        The generators are forked, so the recomputation draws what the forward drew (dropout
        masks match) and the draws of the rest of the step are not shifted."""
        if ctx.outputs is not None:
            return ctx
        cpu, accel = ctx.rng
        devices = [] if accel is None else [self.device]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(cpu)
            if accel is not None:
                _device_module(self.device).set_rng_state(accel, self.device)
            return self._run_with_graph(ctx.chunk, ctx.leaves, ctx.grad_names)

    def _pairs(self, ctx: _Saved, output_grads: Mapping[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Outputs that carry a graph and their gradients (a missing gradient is zero)."""
        outs, grads = [], []
        for k, g in output_grads.items():
            out = ctx.outputs.get(k)
            if out is not None and out.requires_grad:
                outs.append(out)
                grads.append(g.to(device=out.device, dtype=out.dtype))
        return outs, grads

    def _input_grads(self, ctx: _Saved, found: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
        return {k: found[k] if found.get(k) is not None else torch.zeros_like(ctx.leaves[k])
                for k in ctx.grad_names}

    def backward(self, ctx: _Saved, output_grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        ctx = self._graph(ctx)
        outs, grads = self._pairs(ctx, output_grads)
        if outs:
            torch.autograd.backward(outs, grads)
        return self._input_grads(ctx, {k: ctx.leaves[k].grad for k in ctx.grad_names})

    def backward_input(self, ctx: _Saved,
                       output_grads: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], _WeightWork]:
        ctx = self._graph(ctx)
        outs, grads = self._pairs(ctx, output_grads)
        names = sorted(k for k in ctx.grad_names if ctx.leaves[k].requires_grad)
        found: dict[str, Tensor | None] = {}
        half = None
        if outs and names:
            got, half = input_half(outs, grads, [ctx.leaves[k] for k in names], trainable(ctx.chunk))
            found = dict(zip(names, got))
        return self._input_grads(ctx, found), _WeightWork(ctx.chunk, outs, grads, half)

    def backward_weight(self, wctx: _WeightWork) -> None:
        if wctx.half is not None:
            weight_half(wctx.half, self._accumulated if self._watchers else None)
            return
        params = trainable(wctx.chunk)
        if not wctx.outputs or not params:
            return
        # accumulated into .grad as autograd reaches each parameter (a parameter it does not reach is
        # left alone): autograd.grad made every gradient of the chunk before any was added, one more
        # copy of them all at once (1.6 GB over SD v2's encoder on one rank)
        torch.autograd.backward(wctx.outputs, wctx.grads, inputs=params)

    # -- parameters -------------------------------------------------------------------
    def zero_grad(self, chunk: TorchChunk) -> None:
        for p in chunk.parameters():
            p.grad = None

    def parameters(self, chunk: TorchChunk) -> dict[str, Tensor]:
        return {param_name(layer, n): p for layer, m in chunk.layers.items() for n, p in m.named_parameters()}

    def parameter_layers(self, chunk: TorchChunk) -> dict[str, int]:
        """Each parameter's layer in the chunk (0 its first): the data-parallel buckets are cut
        by layer (``pulse.grad_buckets``). A module two layers share counts as the first's."""
        layer_of: dict[int, int] = {}
        for index, module in enumerate(chunk.layers.values()):
            for p in module.parameters():
                layer_of.setdefault(id(p), index)
        return {name: layer_of[id(p)] for name, p in self.parameters(chunk).items()}

    def watch_gradients(self, chunk: TorchChunk, on_final: Callable[[str, Tensor], None]) -> Callable[[], None]:
        """Call ``on_final(name, gradient)`` as each parameter's gradient is accumulated, until the
        returned function is called: the data-parallel buckets of a chunk's last backward launch
        layer by layer while it runs (``pulse.runtime.grad_sync``), as DDP's hooks do. Autograd's
        accumulation calls each parameter's post-accumulate hook; the split backward's W, which
        accumulates itself (``weight_half``), reports to every watcher in ``self._watchers``."""
        named = {id(p): name for name, p in self.parameters(chunk).items()}

        def report(p: Tensor) -> None:
            if id(p) in named:
                on_final(named[id(p)], p.grad)

        params = self.parameters(chunk)
        handles = [p.register_post_accumulate_grad_hook(report) for p in params.values() if p.requires_grad]
        self._watchers.append(report)
        for name, p in params.items():  # a frozen one gets no gradient: final now, as zeros (``gradients``)
            if not p.requires_grad:
                on_final(name, torch.zeros_like(p))

        def unwatch() -> None:
            for handle in handles:
                handle.remove()
            self._watchers.remove(report)

        return unwatch

    def _accumulated(self, p: Tensor) -> None:
        for report in self._watchers:
            report(p)

    def gradients(self, chunk: TorchChunk) -> dict[str, Tensor]:
        """Accumulated gradients; a parameter autograd never reached reads as zeros."""
        return {n: p.grad if p.grad is not None else torch.zeros_like(p)
                for n, p in self.parameters(chunk).items()}

    def set_gradients(self, chunk: TorchChunk, grads: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.parameters(chunk).items():
                p.grad = grads[n].to(device=p.device, dtype=p.dtype).clone()

    def optimizer_settings(self) -> OptimizerSettings:
        return OptimizerSettings(self.optimizer_name, self.lr, self.betas, self.eps, self.weight_decay)

    def optimizer_of(self, chunk: TorchChunk) -> torch.optim.Optimizer:
        """The chunk's optimizer, built on first use (the executor builds chunks, the launcher steps them,
        a resume fills their state): ``pulse_torch.optimizers.optimizer_of``."""
        return optimizer_of(chunk, self.built or [chunk], self.optimizer_settings(), trainable)

    def optimizer_step(self, chunk: TorchChunk) -> None:
        if not trainable(chunk):  # LoRA: a chunk whose layers hold no adapters (conv_in, a resnet block)
            return
        optimizer = self.optimizer_of(chunk)
        if steps_here(chunk, self.built or [chunk], trainable):  # a rank's shared optimizer steps once
            optimizer.step()

    def grad_square_sum(self, chunks: Iterable[TorchChunk]) -> float:
        """Sum of the squared parameter gradients (float64): the loop's clipping adds the pipeline's."""
        grads = [g.detach() for c in chunks for g in self.gradients(c).values()]
        return float(squares_of(grads, self.device))

    def scale_gradients(self, chunks: Iterable[TorchChunk], factor: float) -> None:
        """Every gradient times ``factor`` in one foreach call (``clip_grads_with_norm_``'s): on an
        accelerator a launch per gradient is host-bound (see ``squares_of``)."""
        grads = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, factor)

    def unscale_gradients(self, chunks: Iterable[TorchChunk], scale: float) -> None:
        """Divide by the fp16 loss scale and find inf/NaN in one kernel per dtype on the device
        (``torch.amp.GradScaler``'s ``torch._amp_foreach_non_finite_check_and_unscale_``)."""
        self._found_inf = self._unscale([p.grad for c in chunks for p in c.parameters() if p.grad is not None],
                                        1.0 / scale)

    def overflowed(self, chunks: Iterable[TorchChunk]) -> bool:
        """The last unscale's found-inf (a check without unscaling if none ran), or the device's
        own overflow flag (Ascend saturation mode); one read of each on the host."""
        found = self._found_inf
        if found is None:
            found = self._unscale([p.grad for c in chunks for p in c.parameters() if p.grad is not None], 1.0)
        self._found_inf = None
        flagged = self.device_overflow() if self.device_overflow is not None else False
        return bool(found.item() > 0) or flagged

    def _unscale(self, grads: list[Tensor], factor: float) -> Tensor:
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = torch.full((1,), factor, dtype=torch.float32, device=self.device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with torch.no_grad():
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
        return found

    def set_learning_rate(self, chunks: Iterable[TorchChunk], lr: float) -> None:
        self.lr = lr  # optimizers built later start with it
        for c in chunks:
            for group in (c.optimizer.param_groups if c.optimizer is not None else []):
                group["lr"] = lr

    def ema_update(self, chunks: Iterable[TorchChunk], decay: float) -> None:
        """ema -= (1 - decay) * (ema - parameter), fp32, by parameter name; a new name copies.

        diffusers' ``EMAModel.step`` expression, not ``decay * ema + (1 - decay) * p``: the same
        average in exact arithmetic, and bit for bit EMAModel's on float32 weights."""
        with torch.no_grad():
            for c in chunks:
                for name, p in self.parameters(c).items():
                    if name not in self.ema:
                        self.ema[name] = p.detach().float().clone()
                    else:
                        ema = self.ema[name]
                        ema.sub_((1.0 - decay) * (ema - p.detach().float()))

    # -- tensors -------------------------------------------------------------------------
    def nbytes(self, t: Tensor) -> int:
        return t.numel() * t.element_size()

    def peak_memory_bytes(self) -> int | None:
        """The most bytes this process's tensors held on its device at once (None on a CPU: nothing
        counts them); the training loop puts every rank's into log.json (``pulse.train.loop``)."""
        from pulse_torch.memory import peak_bytes

        return peak_bytes(self.device)

    def zeros_like(self, t: Tensor) -> Tensor:
        return torch.zeros_like(t)

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """One contiguous buffer (a data-parallel gradient bucket; empty for a chunk that trains nothing)."""
        if not tensors:  # LoRA: a chunk without adapters still takes part in its bucket's all-reduce
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([t.reshape(-1) for t in tensors])

    def split_like(self, flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
        """``flatten``'s inverse: pieces of ``flat`` shaped as ``like``."""
        return [p.view_as(t) for p, t in zip(torch.split(flat, [t.numel() for t in like]), like)]

    def to_numpy(self, t: Tensor) -> Any:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            t = t.float()
        return t.numpy()

    def from_numpy(self, a: Any) -> Tensor:
        return self.place(torch.from_numpy(np.ascontiguousarray(a)))


def trainable(chunk: nn.Module) -> list[Tensor]:
    """What a chunk's AdamW steps: every parameter, or with a frozen base (LoRA) the adapters only."""
    return [p for p in chunk.parameters() if p.requires_grad]


def _device_module(device: torch.device) -> Any:
    """``torch.cuda``, ``torch.npu`` (torch_npu), ...: where a device type keeps its RNG."""
    return getattr(torch, device.type)
