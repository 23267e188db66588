"""PULSE's MindSpore ``Backend``: chunks of ``build_layer`` cells, differentiated by ``mindspore.vjp``.

One chunk, as the stage executor sees it::

    F   inputs {"h", skips it consumes, shared inputs}
          ─ chunk(inputs) ─▶ outputs {"h", skips it produces, shared inputs it makes}
          keep: the inputs (no tape)
    B   outputs, vjp_fn = mindspore.vjp(fn, *float inputs, weights=chunk's parameters)
          (fn re-runs the chunk; data inputs such as timesteps and masks are closed over)
        vjp_fn(output gradients) -> input gradients (returned), parameter gradients (accumulated)

Why B re-runs the forward: MindSpore's PyNative autodiff keeps one live tape
(the "top cell"); a ``vjp_fn`` works only while no later differentiated
forward has started, i.e. backwards in LIFO order. A pipeline runs them in
FIFO order (1F1B: F0 F1 B0 ...), so the tape cannot be kept from F to B; each
B rebuilds it and uses it at once. It is chunk-level activation
recomputation: one extra forward per chunk and microbatch, and only the
chunk's inputs held between F and B, whatever ``Plan.recompute`` says; so
``pulse train --backend mindspore`` writes and prices its plans with every
chunk recomputing (``pulse_mindspore.traits``: ``always_recomputes``). The results are exact (CPU kernels are
deterministic; the test compares with the single-device model).

Split backward (zero-bubble B then W): ``vjp_fn`` gives input and parameter
gradients in one call, so B computes both, returns the input half and keeps
the parameter half, which W accumulates. Exact numbers; W's late compute (its
memory timing) is not reproduced.

Parameters are seeded per layer name (``pulse_mindspore.model.layer_rng``), so
any placement of a spec trains the same weights as ``build_model(spec, seed)``;
``load_weights`` then replaces them (a diffusers pipeline's UNet:
``pulse_mindspore.diffusers_weights.weights_loader``), chunk by chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from pulse.errors import PulseError
from pulse.layers.chunk_layout import SkipWiring, chunk_output_names, run_chunk
from pulse.runtime.tensor_arithmetic import OperatorArithmetic
from pulse.runtime.wiring import MAIN, ChunkIO
from pulse.spec import ModelSpec
from pulse_mindspore.cpu_mode import launch_blocking_on_cpu
from pulse_mindspore.optimizers import build_optimizer, set_learning_rate
from pulse_mindspore.device_support import bf16_refusal
from pulse_mindspore.layers import build_layer
from pulse_mindspore.layers.basic import GroupNorm, LayerNorm
from pulse_mindspore.layers.registry import name_parameters
from pulse_mindspore.model import FLOATS, layer_rng, qualified_params, to_tensor


NORMS = (GroupNorm, LayerNorm)  # kept in float32 under mixed precision, as torch's autocast keeps them


def distinct(tensors: Iterable[Tensor]) -> list[Tensor]:
    """The tensors, a repeated object replaced by a copy.

    vjp identifies arguments by object: one tensor passed as two arguments
    (a chunk's "h" that is also a skip it hands on locally) gets the sum of
    both gradients for each. Copies keep them apart.
    """
    seen: set[int] = set()
    out = []
    for t in tensors:
        out.append(t.copy() if id(t) in seen else t)
        seen.add(id(t))
    return out


@dataclass
class _OptimizerSlot:
    """Holds a chunk's optimizer outside MindSpore's cell tree (see ``MindSporeChunk``)."""

    optimizer: Any = None


class MindSporeChunk(nn.Cell):
    """Layers ``io.start .. io.end - 1`` of a spec, the skip wiring between them, gradients and optimizer."""

    def __init__(self, spec: ModelSpec, io: ChunkIO, layers: dict[str, nn.Cell]) -> None:
        super().__init__()
        self.io = io
        self.layers = nn.CellDict(layers)
        for name, cell in layers.items():
            name_parameters(cell, name)  # unique: "<layer>.<path>"
        self.wiring = SkipWiring.of(spec, layers)
        self.params: dict[str, Parameter] = qualified_params(layers)
        self.grads: dict[str, Tensor | None] = dict.fromkeys(self.params)
        self.view_grads: set[str] = set()  # parameters whose vjp gradient is a view (``_accumulate``)
        # A plain holder: an optimizer set as a Cell attribute would become a sub-cell
        # and MindSpore would re-prefix the names of the parameters it holds.
        self.opt = _OptimizerSlot()
        self.out_names = chunk_output_names(io)

    def construct(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return run_chunk(self.layers, self.wiring, self.io, inputs)


@dataclass
class _Saved:
    """What a chunk forward keeps for its backward: its inputs (the forward is recomputed)."""

    chunk: MindSporeChunk
    inputs: dict[str, Tensor]
    grad_names: frozenset[str]


@dataclass
class _WeightWork:
    """The weight half of a split backward: parameter gradients computed by B, accumulated by W."""

    chunk: MindSporeChunk
    grads: tuple[Tensor, ...]


class MindSporeBackend(OperatorArithmetic):
    """``pulse.runtime.protocols.Backend`` for MindSpore (PyNative mode).

    ``dtype`` is the training precision (floating inputs are cast to it);
    float32 on the CPU, whose Conv2D kernel takes no float64. AdamW
    (``pulse_mindspore.optimizers.EagerAdamW``, PyTorch's update rule) applies
    per chunk: AdamW is element-wise, so one optimizer per chunk equals one
    over the rank's chunks. Clipping by the pipeline's global norm is the
    training loop's (``pulse.train.loop.clip_gradients``).
    """

    def __init__(self, *, dtype: ms.Type = ms.float32, seed: int = 0, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 load_weights: Callable[[ModelSpec, Mapping[str, nn.Cell]], None] | None = None,
                 compute_dtype: ms.Type | None = None, optimizer: str = "adamw") -> None:
        self.dtype = dtype
        self.optimizer_name = optimizer  # pulse_mindspore.optimizers: AdamW or AdaFactor
        # Mixed precision: the cells compute in compute_dtype (fp16 / bf16) from the float32 parameters,
        # which stay the optimizer's (their gradients come back float32 through the casts); norms in float32.
        self.compute_dtype = compute_dtype
        if compute_dtype == ms.bfloat16:  # a worker's own guard: `pulse train` refused it first if it saw the 910A
            refusal = bf16_refusal(ms.get_context("device_target"))
            if refusal is not None:
                raise PulseError(refusal)
        self.seed = seed
        self.load_weights = load_weights  # sets a new chunk's cells from stored weights (None: seeded values)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.ema: dict[str, Tensor] = {}  # EMA weights of this rank's parameters, on its device (``ema_update``)
        self.ema_steps = 0  # EMA updates so far: the loop counts them (its warm-up's t)
        launch_blocking_on_cpu()

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> MindSporeChunk:
        layers = {layer.name: build_layer(layer, rng=layer_rng(self.seed, layer.name), dtype=self.dtype)
                  for layer in spec.layers[io.start:io.end]}
        if self.load_weights is not None:
            self.load_weights(spec, layers)
        chunk = MindSporeChunk(spec, io, layers)
        if self.compute_dtype is not None:
            chunk.to_float(self.compute_dtype)
            for cell in chunk.cells_and_names():
                if isinstance(cell[1], NORMS):
                    cell[1].to_float(ms.float32)
        return chunk

    # -- compute -------------------------------------------------------------------
    def place(self, t: Any) -> Tensor:
        """A MindSpore tensor; floating ones in the training dtype, integers kept. Under mixed precision an
        activation keeps the compute dtype it arrived in (as inside one model; half the bytes on the wire)."""
        if self.compute_dtype is not None and isinstance(t, Tensor) and t.dtype == self.compute_dtype:
            return t
        return to_tensor(t, self.dtype)

    def forward(self, chunk: MindSporeChunk, inputs: Mapping[str, Any],
                grad_names: frozenset[str]) -> tuple[dict[str, Tensor], _Saved]:
        placed = {k: self.place(v) for k, v in inputs.items()}
        outputs = chunk(placed)  # no tape: the graph is rebuilt by backward (see the module doc)
        return outputs, _Saved(chunk, placed, grad_names)

    def _run_vjp(self, ctx: _Saved, output_grads: Mapping[str, Any]) -> tuple[dict[str, Tensor], tuple]:
        """Recompute the chunk under ``mindspore.vjp`` and pull the output gradients back at once.

        Returns the input gradient of every grad name and the parameter
        gradients in ``chunk.params`` order. "h" is always a vjp argument (vjp
        needs one; the first chunk's is the float latent); data inputs
        (timesteps, text, masks) are closed over.
        """
        chunk, placed = ctx.chunk, ctx.inputs
        arg_names = tuple(k for k in placed if placed[k].dtype in FLOATS and (k in ctx.grad_names or k == MAIN))
        fixed = {k: v for k, v in placed.items() if k not in arg_names}

        def fn(*xs: Tensor) -> tuple[Tensor, ...]:
            outs = chunk({**fixed, **dict(zip(arg_names, xs))})
            return tuple(outs[k] for k in chunk.out_names)

        weights = list(chunk.params.values()) or None
        outputs, vjp_fn = ms.vjp(fn, *distinct(placed[k] for k in arg_names), weights=weights)
        sens = tuple(self.place(output_grads[k]).astype(out.dtype) if k in output_grads else ops.zeros_like(out)
                     for k, out in zip(chunk.out_names, outputs))
        got = vjp_fn(sens)
        input_grads, weight_grads = (got[0], got[1]) if weights else (got, ())
        found = dict(zip(arg_names, input_grads))
        grads = {k: found[k] if k in found else ops.zeros_like(placed[k]) for k in ctx.grad_names}
        return grads, tuple(weight_grads)

    def backward(self, ctx: _Saved, output_grads: Mapping[str, Any]) -> dict[str, Tensor]:
        grads, weight_grads = self._run_vjp(ctx, output_grads)
        self._accumulate(ctx.chunk, weight_grads)
        return grads

    def backward_input(self, ctx: _Saved,
                       output_grads: Mapping[str, Any]) -> tuple[dict[str, Tensor], _WeightWork]:
        grads, weight_grads = self._run_vjp(ctx, output_grads)
        return grads, _WeightWork(ctx.chunk, weight_grads)

    def backward_weight(self, wctx: _WeightWork) -> None:
        self._accumulate(wctx.chunk, wctx.grads)

    def _accumulate(self, chunk: MindSporeChunk, weight_grads: Sequence[Tensor]) -> None:
        """The first set becomes the chunk's; later ones are added into it in place (``have + g`` would
        make a third tensor beside both, and MindSpore's pool keeps what it once held). Where vjp handed
        back a view (a bias's gradient reshaped from its conv's), in-place ops refuse it: those few are
        added out of place, and remembered, as the same parameters' gradients are views every step."""
        for name, g in zip(chunk.params, weight_grads):
            have = chunk.grads[name]
            if have is None:
                chunk.grads[name] = g
            elif name in chunk.view_grads:
                chunk.grads[name] = have + g
            else:
                try:
                    ops.assign_add(have, g)
                except RuntimeError as exc:
                    if "view" not in str(exc):
                        raise
                    chunk.view_grads.add(name)
                    chunk.grads[name] = have + g

    # -- parameters -------------------------------------------------------------------
    def zero_grad(self, chunk: MindSporeChunk) -> None:
        chunk.grads = dict.fromkeys(chunk.params)

    def parameters(self, chunk: MindSporeChunk) -> dict[str, Parameter]:
        return dict(chunk.params)

    def parameter_layers(self, chunk: MindSporeChunk) -> dict[str, int]:
        """Each parameter's layer in the chunk (its names are "<layer>.<path>"): the data-parallel
        buckets are cut by layer (``pulse.grad_buckets``), and all launch at the chunk's AR, its vjp
        yielding no gradient before it ends (``buckets_at_chunk_end``)."""
        out: dict[str, int] = {}
        for i, layer in enumerate(chunk.layers.keys()):
            out.update({name: i for name in chunk.params if name.startswith(f"{layer}.") and name not in out})
        return out

    def gradients(self, chunk: MindSporeChunk) -> dict[str, Tensor]:
        """Accumulated gradients; a parameter no backward reached reads as zeros."""
        return {n: g if g is not None else ops.zeros_like(chunk.params[n]) for n, g in chunk.grads.items()}

    def set_gradients(self, chunk: MindSporeChunk, grads: Mapping[str, Any]) -> None:
        chunk.grads = {n: self.place(grads[n]) for n in chunk.params}

    def optimizer_step(self, chunk: MindSporeChunk) -> None:
        if not chunk.params:
            return
        self.optimizer_of(chunk)(tuple(self.gradients(chunk).values()))

    def optimizer_of(self, chunk: MindSporeChunk) -> Any:
        """The chunk's AdamW (its moments follow ``chunk.params``' order), built on first use: the
        executor builds chunks, the launcher steps them, a resume fills their state
        (``pulse_mindspore.checkpoint``)."""
        slot = chunk.opt
        if slot.optimizer is None:
            slot.optimizer = build_optimizer(self.optimizer_name, list(chunk.params.values()), self.lr, self.betas,
                                             self.eps, self.weight_decay)
        return slot.optimizer

    def grad_square_sum(self, chunks: Iterable[MindSporeChunk]) -> float:
        """Sum of the squared parameter gradients: the loop's clipping adds the pipeline's.

        Summed on the device (float32 per tensor, as torch's ``clip_grad_norm_``) and read by the
        host once: one copy a step, not one per parameter."""
        squares = [ops.sum(ops.square(g.astype(ms.float32))) for c in chunks for g in self.gradients(c).values()]
        return float(ops.stack(squares).sum().asnumpy()) if squares else 0.0

    def scale_gradients(self, chunks: Iterable[MindSporeChunk], factor: float) -> None:
        for c in chunks:  # one tensor at a time: a new dict would hold every old gradient beside its scaled copy
            for n, g in c.grads.items():
                if g is not None:
                    c.grads[n] = g * factor

    def unscale_gradients(self, chunks: Iterable[MindSporeChunk], scale: float) -> None:
        self.scale_gradients(chunks, 1.0 / scale)

    def overflowed(self, chunks: Iterable[MindSporeChunk]) -> bool:
        """Not ``mindspore.amp.all_finite`` of the gradients: on Ascend 910A (and 910B in
        MS_ASCEND_CHECK_OVERFLOW_MODE=SATURATION_MODE) it reads and clears the float-status registers
        instead of looking at the values, which saturate to +-max there; elsewhere AllFinite."""
        from mindspore import amp

        grads = [g for c in chunks for g in self.gradients(c).values()]
        return bool(grads) and not bool(amp.all_finite(grads))

    def set_learning_rate(self, chunks: Iterable[MindSporeChunk], lr: float) -> None:
        self.lr = lr  # optimizers built later start with it
        for c in chunks:
            if c.opt.optimizer is not None:
                set_learning_rate(c.opt.optimizer, lr)

    def ema_update(self, chunks: Iterable[MindSporeChunk], decay: float) -> None:
        """ema = decay * ema + (1 - decay) * parameter, float32 on the device, by name; the first call copies.

        Updated in place (``Tensor.copy_``): nothing crosses to the host until the EMA is saved
        (``pulse_mindspore.train.ema_state``). ``copy_`` of the expression, not ``mul_``/``add_``:
        on MindSpore 2.10 CPU ``mul_`` by a Python float rounds differently from ``*`` (and numpy)."""
        for c in chunks:
            for name, p in self.parameters(c).items():
                value = p.astype(ms.float32)  # the parameter itself when float32: read, never written
                if name not in self.ema:
                    self.ema[name] = ops.deepcopy(value)  # its own memory: the weights move on
                else:
                    ema = self.ema[name]
                    ema.copy_(ema * decay + value * (1.0 - decay))

    # -- tensors -------------------------------------------------------------------------
    def nbytes(self, t: Tensor) -> int:
        return int(t.nbytes)

    def peak_memory_bytes(self) -> int | None:
        """The most bytes this process's tensors held on its device at once (``mindspore.runtime.
        max_memory_allocated``, MindSpore >= 2.5; ``mindspore.hal``'s before); None on a CPU, where
        MindSpore counts nothing (it returns 0). The training loop puts every rank's into log.json."""
        if ms.get_context("device_target") == "CPU":
            return None
        runtime = getattr(ms, "runtime", None)
        query = getattr(runtime, "max_memory_allocated", None) or ms.hal.max_memory_allocated
        return int(query())

    def zeros_like(self, t: Tensor) -> Tensor:
        return ops.zeros_like(t)

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """One contiguous buffer (a data-parallel gradient bucket)."""
        return ops.cat([t.reshape(-1) for t in tensors])

    def split_like(self, flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
        """``flatten``'s inverse: pieces of ``flat`` shaped as ``like``."""
        return [p.reshape(t.shape) for p, t in zip(ops.split(flat, [int(t.size) for t in like]), like)]

    def to_numpy(self, t: Tensor) -> np.ndarray:
        if t.dtype == ms.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            t = t.astype(ms.float32)
        return t.asnumpy()

    def from_numpy(self, a: Any) -> Tensor:
        return self.place(np.asarray(a))
