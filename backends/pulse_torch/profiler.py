"""A measuring ``Profiler``: time every layer's forward and backward on this device.

::

    latents, data inputs ──▶ layer 0 ──▶ layer 1 ──▶ ...   one layer built at a time: built,
                                                            timed, run once more for the next
                                                            layer's input, freed
    per layer:  warm-up reps, then reps of  [forward | backward]  -> medians
                bytes autograd saved for backward (pulse_torch.saved_bytes: parameters and
                copies of them excluded)

The result is the same ``pulse.costs.CostTable`` the analytic profiler makes
(source ``measured:torch-<device>``), so the partitioners and the tuner take
either. ``python -m pulse_torch.profile --model tiny-unet --microbatch-size 2
--out costs.yaml`` writes one; ``pulse plan --costs costs.yaml`` reads it.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, TypeVar

import torch
from torch import Tensor, nn

from pulse.args.model_args import add_diffusers_argument, parse_options
from pulse.zoo.loading import load_model
from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.profiling.timing import TORCH_DEVICE_TIMING
from pulse.spec import ModelSpec
from pulse_torch.layers import build_layer, make_inputs
from pulse_torch.model import layer_generator
from pulse_torch.saved_bytes import counting

LayerInputs = tuple[Tensor, dict[str, Tensor], list[Tensor]]  # (h, shared, skips) of one layer
T = TypeVar("T")


@dataclass(frozen=True)
class LayerTiming:
    forward: float  # seconds, median
    backward: float
    saved_bytes: int  # tensors autograd kept for backward, parameters excluded


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for queued kernels, so wall-clock time covers the work (a no-op on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    if device.type == "npu":
        return torch.npu.synchronize  # type: ignore[attr-defined]
    return lambda: None


class DeviceEvents:
    """The ``DeviceClock`` of a CUDA or Ascend device: ``torch.cuda.Event`` / ``torch.npu.Event``
    with timing, recorded on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.event = getattr(torch, device.type).Event

    def mark(self) -> Any:
        event = self.event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def device_timed(backend: Any, device: torch.device, timing: str) -> Any:
    """``backend`` as the profile times it on ``device``. ``events``: each action between two device
    events while the host queues ahead, as in training. ``synchronize``: a device synchronize after
    every compute call (``synchronized``), so each action starts on an idle device and its span
    also holds the host's time to queue its kernels, which training hides behind the device's work."""
    if device.type == "cpu":
        return backend
    if timing == "events":
        backend.device_clock = DeviceEvents(device)
        return backend
    return synchronized(backend, synchronizer(device))


def device_timed_loss(loss: Callable[..., Any], device: torch.device, timing: str) -> Callable[..., Any]:
    """The profile's loss under ``timing`` (see ``device_timed``): under events it runs inside its F
    action's marks as it is; under synchronize it waits for the device (``synchronized_loss``)."""
    if device.type == "cpu" or timing == "events":
        return loss
    return synchronized_loss(loss, synchronizer(device))


# The backend calls an action's device work is queued by (the executor times the whole action)
SYNCED_CALLS = ("forward", "backward", "backward_input", "backward_weight", "optimizer_step")


def synchronized(backend: Any, sync: Callable[[], None]) -> Any:
    """``backend`` whose compute calls return only once the device has run what they queued.

    ``pulse profile`` reads a layer's time off the executor's timeline (host clock around each
    action): on an accelerator a call returns when its kernels are queued, so without this an
    action's span is the host's enqueue time and the device's work lands in whichever later span
    first waits for it. A synchronize after each call closes the span on the device's finish, and
    the next action starts on an idle device. The loss, computed in the last chunk's F, is
    ``synchronized_loss``'s."""
    for name in SYNCED_CALLS:
        call = getattr(backend, name)

        def synced(*args: Any, _call: Callable[..., Any] = call, **kwargs: Any) -> Any:
            out = _call(*args, **kwargs)
            sync()
            return out
        setattr(backend, name, synced)
    return backend


def synchronized_loss(loss: Callable[..., Any], sync: Callable[[], None]) -> Callable[..., Any]:
    """``loss`` returning once the device has computed it (see ``synchronized``)."""
    def synced(*args: Any, **kwargs: Any) -> Any:
        out = loss(*args, **kwargs)
        sync()
        return out
    return synced


def walk_layers(spec: ModelSpec, build: Callable[[Any], nn.Module], h: Tensor, shared: dict[str, Tensor],
                measure: Callable[[nn.Module, LayerInputs], T]) -> list[T]:
    """``measure(module, what it reads)`` of each layer in turn, built by ``build`` from its spec layer;
    then the layer runs (no grad) for the next layer's input and is dropped before the next is built.
    Only skips still to be read are kept: one layer's parameters alive at a time."""
    outputs: dict[str, Tensor] = {}
    shared = dict(shared)
    readers = {e.src for e in spec.skips}
    out = []
    for layer in spec.layers:
        module = build(layer)
        skips = [outputs.pop(e.src) if last_reader(spec, e) else outputs[e.src]
                 for e in spec.skips if e.dst == layer.name]
        out.append(measure(module, (h, dict(shared), skips)))
        with torch.no_grad():
            h, made = module(h, shared, skips)
        shared.update(made)
        if layer.name in readers:
            outputs[layer.name] = h
        module = None
    return out


def last_reader(spec: ModelSpec, edge: Any) -> bool:
    """``edge`` is the last skip out of its source."""
    return all(spec.index(e.dst) <= spec.index(edge.dst) for e in spec.skips if e.src == edge.src)


def _leaf(t: Tensor) -> Tensor:
    t = t.detach()
    return t.requires_grad_() if t.is_floating_point() else t


def time_layer(module: nn.Module, inputs: LayerInputs, warmup: int, repeats: int,
               sync: Callable[[], None], context: Callable[[], ContextManager] = contextlib.nullcontext
               ) -> LayerTiming:
    """Median forward and backward seconds over ``repeats`` after ``warmup`` untimed runs."""
    fwd, bwd, saved = [], [], 0
    for rep in range(warmup + repeats):
        h, shared, skips = inputs
        h, shared, skips = _leaf(h), {k: _leaf(v) for k, v in shared.items()}, [_leaf(s) for s in skips]
        sync()
        start = time.perf_counter()
        with context(), torch.enable_grad(), counting(module.parameters()) as kept:
            out, made = module(h, shared, skips)
        sync()
        mid = time.perf_counter()
        ends = [t for t in (out, *made.values()) if t.requires_grad]
        if ends:
            torch.autograd.backward(ends, [torch.ones_like(t) for t in ends])
        sync()
        end = time.perf_counter()
        if rep >= warmup:
            fwd.append(mid - start)
            bwd.append(end - mid)
            saved = max(saved, kept.bytes)
    module.zero_grad(set_to_none=True)
    floor = 1e-9  # a layer is never free: keeps every time positive for the partitioners
    return LayerTiming(max(statistics.median(fwd), floor), max(statistics.median(bwd), floor), saved)


@dataclass(frozen=True)
class TorchProfiler:
    """``pulse.costs.Profiler`` that measures layers with PyTorch on ``device``."""

    device: str = "cpu"
    warmup: int = 2
    repeats: int = 5
    seed: int = 0
    autocast: torch.dtype | None = None  # mixed precision as training runs it (pulse_torch.job.with_autocast)

    def profile(self, spec: ModelSpec, microbatch_size: int) -> CostTable:
        if microbatch_size < 1:
            raise PulseError(f"microbatch size must be >= 1, got {microbatch_size}")
        if self.repeats < 1 or self.warmup < 0:
            raise PulseError(f"need repeats >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")
        device = torch.device(self.device)
        h, shared = make_inputs(spec, microbatch_size, torch.Generator().manual_seed(self.seed), device)
        sync = synchronizer(device)
        context = contextlib.nullcontext if self.autocast is None else \
            (lambda: torch.autocast(device.type, dtype=self.autocast))

        def build(layer: Any) -> nn.Module:
            return build_layer(layer, device=device, generator=layer_generator(self.seed, layer.name))
        timings = walk_layers(spec, build, h, shared, lambda module, inputs: time_layer(
            module, inputs, self.warmup, self.repeats, sync, context))
        return CostTable(model=spec.name, microbatch_size=microbatch_size,
                         layer_names=tuple(layer.name for layer in spec.layers),
                         fwd=tuple(t.forward for t in timings), bwd=tuple(t.backward for t in timings),
                         act_mem=tuple(t.saved_bytes for t in timings), source=f"measured:torch-{device.type}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pulse_torch.profile", allow_abbrev=False,
                                     description="Measure every layer's forward/backward time with PyTorch.")
    parser.add_argument("--model", default="tiny-unet", help="zoo name or spec YAML path")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu, ...")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--out", default=None, help="write the cost table (YAML, or JSON by suffix)")
    return parser


def format_table(costs: CostTable) -> str:
    lines = [f"{costs.model}: microbatch {costs.microbatch_size}, {costs.source}",
             f"{'layer':<16} {'fwd ms':>9} {'bwd ms':>9} {'saved KB':>10}"]
    for name, f, b, m in zip(costs.layer_names, costs.fwd, costs.bwd, costs.act_mem):
        lines.append(f"{name:<16} {f * 1e3:>9.3f} {b * 1e3:>9.3f} {m / 1e3:>10.1f}")
    f, b = costs.span(0, len(costs.layer_names))
    lines.append(f"{'total':<16} {f * 1e3:>9.3f} {b * 1e3:>9.3f} {sum(costs.act_mem) / 1e3:>10.1f}")
    return "\n".join(lines)


def profile_own_modules(args: argparse.Namespace, spec: ModelSpec) -> CostTable:
    """One process, the diffusers model's own modules through the runtime (``pulse profile``'s path:
    one window of layers materialized at a time, the bytes each layer's forward saves counted)."""
    from pulse.profiling.layers import layer_costs, windowed
    from pulse_torch.diffusion import eps_loss
    from pulse_torch.profile_layers import profile_layers
    from pulse_torch.saved_bytes import counting_chunks

    job = argparse.Namespace(model=args.model, model_option=args.model_option, repeats=args.repeats,
                             warmup=args.warmup, microbatch_size=args.microbatch_size, pp=1, images=None)
    layers = profile_layers(job, args.device)
    model = windowed(spec, layers.backend_of, layers.real_layers, args.microbatch_size)
    loss = device_timed_loss(eps_loss, torch.device(args.device), TORCH_DEVICE_TIMING)
    columns = layer_costs(job, model, loss, count_saved=counting_chunks)
    return CostTable(spec.name, args.microbatch_size, tuple(l.name for l in spec.layers), columns["fwd"],
                     columns["bwd"], columns["act_mem"], f"measured:torch-{args.device}", tuple(columns["bwd_input"]),
                     tuple(columns["bwd_weight"]), tuple(columns["optimizer"]),
                     per_action=tuple(columns["per_action"].items()), act_mem_measured=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        spec = load_model(args.model, parse_options(args.model_option))
        if args.model.startswith("diffusers:"):  # the user's own modules, not zoo layers
            costs = profile_own_modules(args, spec)
        else:
            costs = TorchProfiler(args.device, args.warmup, args.repeats).profile(spec, args.microbatch_size)
        print(format_table(costs))
        if args.out:
            costs.save(args.out)
            print(f"cost table written to {args.out}")
    except PulseError as exc:
        print(f"pulse_torch.profile: error: {exc}", file=sys.stderr)
        return 2
    return 0
