"""Per-device memory over a simulated iteration, from the compute and message times.

Each byte is an interval on one device; a sweep over the interval ends finds
the peak (ends before starts at equal times, so a buffer freed at t and one
taken at t never add up)::

    static      |==================================================|  params+grads+optimizer
    activations     |--- F(c,m) start ........ FREE(c,m) ---|
    skip cache          |-- F(src) end ....... FREE(dst,m) --|        local, uncarried skips
    buffers           |arrival..consumer end|                         received messages
    encodes        |E end .. last reader's F end / send|              an encoder's output
    encoder weights |==================================================|  frozen, where encodes run

A FREE is the lowered program's (``pulse.schedule.lower``): right after the
(chunk, microbatch)'s B, or its W when the backward is split.

A chunk that recomputes (``MemoryModel.recompute``) holds only its inputs
from F to FREE, and its whole activations again from its B, which re-runs the
forward, to its FREE (after W when split: W walks the graph B rebuilt)::

    activations     |-- inputs only: F(c,m) start .......... FREE(c,m) --|
    (recompute)                                   |B start .. FREE|  full act_mem
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.optimizers import optimizer_kind
from pulse.ownership import trained_params
from pulse.placement import Placement
from pulse.schedule.deps import ComputeKey
from pulse.sim.result import MemoryBreakdown, MessageEvent
from pulse.spec import ModelSpec
from pulse.traffic import transfers

CATEGORIES = ("activations", "skip_cache", "buffers", "gradients")
FP32_MASTER = 4  # a mixed-precision run's fp32 copy of each trained weight, counted with its optimizer state
Interval = tuple[int, float, float, int, str]  # device, start, end, bytes, category
Frees = dict[tuple[int, int], float]  # (chunk, microbatch) -> when its FREE ran


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per parameter a device holds, and what its chunks keep per microbatch beyond activations.
    The one description of static memory: the simulator, the synthesizer's caps and the tuner are all
    handed one of these.

    The defaults are mixed-precision Adam as accelerator frameworks count it (the planners' and the
    headline's): fp16 weights (2) + fp16 gradients (2) + fp32 master weights, m and v (12). A run is
    priced as its backend really holds it (``run_memory``): PyTorch keeps fp32 weights (4) and
    gradients (4) beside AdamW's m and v (8), an EMA copy (4) with ``--ema``, a data-parallel bucket
    and its average (4 + 4) with dp > 1, and under autocast a low-precision copy of every fp32 weight
    a chunk's forward used, kept by autograd for the backward (2 per microbatch in flight).

    ``adapters`` (LoRA, ``pulse.zoo.lora.adapter_params``): per spec layer, the parameters
    that train beside its frozen own; the layer's own then hold their weights only
    (``frozen_bytes``), the adapters weights, gradients and optimizer state. None: every
    parameter of the spec trains (a full fine-tune)."""

    param_bytes: int = 2
    grad_bytes: int = 2
    # state per trained parameter: the fp32 master weight (4) and the optimizer's own state
    # (``pulse.optimizers``: AdamW 8, Adafactor ~1.9, 8-bit AdamW ~2.03, Lion 4, Prodigy 16); a fraction
    # where an optimizer keeps less than a byte's multiple per parameter (rounded per layer)
    optimizer_bytes: float = FP32_MASTER + 8
    # Chunks (placement indices) whose forward keeps only its inputs and whose backward re-runs it:
    # activation recomputation, traded for a forward's time per microbatch (``plan.recompute``).
    recompute: frozenset[int] = frozenset()
    adapters: tuple[int, ...] | None = None
    frozen_bytes: int = 2  # a LoRA base's weights as held (fp32 4; bf16/fp16 2)
    ema_bytes: int = 0  # an EMA copy of every trained parameter (--ema)
    bucket_bytes: int = 0  # data-parallel buckets of the trained parameters, from their AR to the step's end
    # low-precision copies of the weights a chunk's forward casts (autocast) and its backward reads, per
    # parameter and microbatch in flight, for weights held wider than the compute dtype
    compute_copy_bytes: int = 0
    # a split backward (zero-bubble schedules' B then W) keeps, from B to W, the gradients where the
    # parameters' paths join the inputs' (pulse_torch/weight_grads.py): this share of the chunk's
    # activations (measured 0.65-0.75 on tiny-unet, tiny-uvit and tiny-dit; none on a chunk fed by the
    # data, whose W walks from its outputs)
    split_kept_share: float = 0.0
    # every receive of a step is posted, its buffer allocated, at the step's start (PyTorch on gloo posts
    # 64 ahead: pulse.runtime.executor.RECV_LOOKAHEAD), not when its message lands
    receives_posted_ahead: bool = False
    # a chunk's gradients exist from the end of its first weight-gradient action of the step (W, or B where
    # the backward is whole) to the step's end, not all step: PULSE's runtimes drop them as a step begins
    # (``zero_grad``: set to None) and autograd makes them in that action. The planners' default keeps
    # them all step, as frameworks with persistent gradient buffers (DDP's buckets, Megatron's) do.
    lazy_gradients: bool = False
    # a backward hands back the chunk's parameter gradients as a set of its own (MindSpore's vjp: no
    # tensor's .grad to add into), held from its B's start until it is added to the accumulated set at
    # that B's end, or at its W's end where the backward is split (``returned_gradient_intervals``)
    returned_gradients: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", frozenset(self.recompute))
        if self.adapters is not None:
            object.__setattr__(self, "adapters", tuple(self.adapters))

    @property
    def per_param(self) -> float:
        """Bytes of one trained parameter: weight, gradient, optimizer state, EMA, bucket."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.ema_bytes + self.bucket_bytes

    def layer_bytes(self, spec: ModelSpec) -> list[int]:
        """Static bytes of each spec layer: a full fine-tune's ``params x per_param``; with adapters,
        the frozen weights plus the adapters' weights, gradients and optimizer state."""
        if self.adapters is None:
            return [round(l.params * self.per_param) for l in spec.layers]
        if len(self.adapters) != spec.num_layers:
            raise PlanError(f"{len(self.adapters)} adapter counts for the {spec.num_layers} layers of '{spec.name}'")
        return [l.params * self.frozen_bytes + round(a * self.per_param) for l, a in zip(spec.layers, self.adapters)]

    def gradient_bytes(self, spec: ModelSpec, start: int, end: int) -> int:
        """Bytes of one set of gradients of layers ``start..end-1``: of what they train (``trained_params``)."""
        return round(trained_params(spec, self.adapters, start, end) * self.grad_bytes)

    def copy_bytes(self, spec: ModelSpec, start: int, end: int) -> int:
        """Bytes of the compute copies one microbatch of layers ``start..end-1`` keeps from F to its FREE:
        every trained weight, and a frozen base held wider than the compute dtype."""
        if not self.compute_copy_bytes:
            return 0
        layers = spec.layers[start:end]
        if self.adapters is None:
            return sum(l.params for l in layers) * self.compute_copy_bytes
        base = sum(l.params for l in layers) if self.frozen_bytes > self.compute_copy_bytes else 0
        return (base + sum(self.adapters[start:end])) * self.compute_copy_bytes


PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SPLIT_KEPT_SHARE = 0.7  # MemoryModel.split_kept_share as PyTorch's split backward keeps it


def run_memory(precision: str = "fp32", ema: bool = False, dp: int = 1, lora: bool = False,
               compute_copies: bool = True, receives_posted_ahead: bool = False,
               optimizer: str = "adamw", returned_gradients: bool = False) -> MemoryModel:
    """What a PULSE run's ranks hold, as its backend trains (``BackendTraits.compute_copies``: autograd
    keeps autocast's weight copies for the backward; MindSpore's recomputing backward does not).

    Trained parameters in fp32 with fp32 gradients and ``optimizer``'s state (``pulse.optimizers``: AdamW's
    two moments by default); with LoRA the frozen base in the training precision (diffusers' ``weight_dtype``).
    Gradients from the end of each chunk's first weight-gradient action to the step's end (``lazy_gradients``):
    SD v2's pp 2 rank 0 peaks after its last B, before any W, 0.35 GiB under a prediction that held them all
    step (``benchmarks/memory_scale.py``)."""
    low = PRECISION_BYTES[precision]
    state = optimizer_kind(optimizer).bytes_per_param
    return MemoryModel(param_bytes=4, grad_bytes=4, optimizer_bytes=state, ema_bytes=4 if ema else 0,
                       bucket_bytes=8 if dp > 1 else 0, frozen_bytes=low if lora else 4,
                       compute_copy_bytes=low if compute_copies and low < 4 else 0,
                       split_kept_share=SPLIT_KEPT_SHARE if compute_copies else 0.0,
                       receives_posted_ahead=receives_posted_ahead, lazy_gradients=True,
                       returned_gradients=returned_gradients)


def mixed_precision_memory(optimizer: str = "adamw") -> MemoryModel:
    """The planners' default accounting (fp16 weights and gradients, fp32 master weights) with ``optimizer``'s
    state in place of Adam's two moments: what `pulse tune --optimizer NAME` prices without --backend."""
    return MemoryModel(optimizer_bytes=FP32_MASTER + optimizer_kind(optimizer).bytes_per_param)


def recompute_of(memory: MemoryModel, placement: Placement) -> frozenset[int]:
    """The model's recomputing chunks, checked against ``placement`` (a plan's chunk ids)."""
    wrong = sorted(c for c in memory.recompute if not 0 <= c < len(placement.chunks))
    if wrong:
        raise PlanError(f"recompute names chunk {wrong[0]}, but the placement has chunks "
                        f"0..{len(placement.chunks) - 1}")
    return memory.recompute


@dataclass(frozen=True)
class MemoryProfile:
    peak: tuple[int, ...]
    breakdown: tuple[MemoryBreakdown, ...]
    peak_inflight: tuple[int, ...]
    peak_skip_cache: tuple[int, ...]
    skip_cache_curve: tuple[tuple[tuple[float, int], ...], ...]


def static_bytes(spec: ModelSpec, placement: Placement, per_param: float) -> list[int]:
    """Bytes per device of its layers' parameters at ``per_param`` bytes each (every parameter trains)."""
    out = [0] * placement.num_devices
    for chunk in placement.chunks:
        out[chunk.device] += round(sum(l.params for l in spec.layers[chunk.start:chunk.end]) * per_param)
    return out


def model_static_bytes(spec: ModelSpec, placement: Placement, memory: MemoryModel) -> list[int]:
    """Bytes per device of its layers' weights, gradients and optimizer state as ``memory`` prices them
    (``static_bytes`` at ``memory.per_param`` for a full fine-tune; LoRA: ``MemoryModel.layer_bytes``)."""
    if memory.adapters is None:
        return static_bytes(spec, placement, memory.per_param)
    per_layer = memory.layer_bytes(spec)
    out = [0] * placement.num_devices
    for chunk in placement.chunks:
        out[chunk.device] += sum(per_layer[chunk.start:chunk.end])
    return out


def local_skips(spec: ModelSpec, placement: Placement) -> list[tuple[int, int, int]]:
    """(src chunk, dst chunk, bytes per sample) of skips kept on their device across chunks."""
    carried = {k for tr in transfers(spec, placement) for k in tr.skips}
    out = []
    for s, t, edge in spec.skip_spans():
        a, b = placement.chunk_of_layer(s), placement.chunk_of_layer(t)
        if a != b and edge.key not in carried and placement.chunks[a].device == placement.chunks[b].device:
            out.append((a, b, edge.bytes))
    return out


def chunk_input_bytes(spec: ModelSpec, placement: Placement, chunk: int) -> int:
    """Bytes per sample a recomputing chunk keeps from F to B beyond what is priced elsewhere:
    its main-path input, the skips it consumes that are not cached on its device (those are
    ``skip_cache`` already) and the layer-made shared inputs it may read. The first chunk's
    input is the data batch, which the feed holds either way."""
    ch = placement.chunks[chunk]
    main = spec.layers[ch.start - 1].out_bytes if ch.start > 0 else 0
    cached = {(a, b) for a, b, _ in local_skips(spec, placement)}
    skips = sum(edge.bytes for s, t, edge in spec.skip_spans()
                if ch.start <= t < ch.end and not ch.start <= s < ch.end
                and (placement.chunk_of_layer(s), chunk) not in cached)
    made_before = {l.name for l in spec.layers[:ch.start]}
    shared = sum(si.bytes for si in spec.shared_inputs if si.producer in made_before)
    return main + skips + shared


def held_bytes(spec: ModelSpec, placement: Placement, costs: CostTable, chunk: int, recompute: bool) -> int:
    """Activation bytes one microbatch of ``chunk`` holds between its F and its B."""
    if recompute:
        return chunk_input_bytes(spec, placement, chunk) * costs.microbatch_size
    ch = placement.chunks[chunk]
    return sum(costs.act_mem[ch.start:ch.end])


def memory_intervals(spec: ModelSpec, placement: Placement, costs: CostTable,
                     times: dict[ComputeKey, tuple[float, float]], frees: Frees, messages: list[MessageEvent],
                     num_microbatches: int, memory: "MemoryModel | None" = None) -> list[Interval]:
    memory = memory or MemoryModel()
    recompute = memory.recompute
    mbs = costs.microbatch_size
    out: list[Interval] = []
    for c, chunk in enumerate(placement.chunks):
        held = held_bytes(spec, placement, costs, c, c in recompute)
        act = sum(costs.act_mem[chunk.start:chunk.end])
        copies = memory.copy_bytes(spec, chunk.start, chunk.end)  # weights: once per microbatch, not per sample
        for m in range(num_microbatches):
            kept = held + (0 if c in recompute else copies)
            out.append((chunk.device, times[("F", c, m)][0], frees[(c, m)], kept, "activations"))
            if c in recompute:  # B rebuilds the whole graph; it lives until the FREE after B (or W)
                out.append((chunk.device, times[("B", c, m)][0], frees[(c, m)], act + copies, "activations"))
            if memory.split_kept_share and chunk.start > 0 and ("W", c, m) in times:
                out.append((chunk.device, times[("B", c, m)][1], times[("W", c, m)][1],
                            int(act * memory.split_kept_share), "activations"))
    for a, b, nbytes in local_skips(spec, placement):  # the consumer's FREE releases the skip
        for m in range(num_microbatches):
            out.append((placement.chunks[a].device, times[("F", a, m)][1], frees[(b, m)],
                        nbytes * mbs, "skip_cache"))
    step_end = max((end for _, end in times.values()), default=0.0)
    if memory.lazy_gradients:
        out += gradient_intervals(spec, placement, times, memory, step_end)
    if memory.returned_gradients:
        out += returned_gradient_intervals(spec, placement, times, memory)
    for msg in messages:
        # the receiving chunk's F or B; an encoder's output is read by the reader chunk's F (a
        # prefetch's by the next step's: held past this step's end)
        consumer = ("F" if msg.direction == "E" else msg.direction, msg.dst_chunk, msg.microbatch)
        read = times.get(consumer, (step_end, step_end))[1]
        held_from = 0.0 if memory.receives_posted_ahead else msg.end
        out.append((msg.dst_device, held_from, max(msg.end, read), msg.nbytes, "buffers"))
    return out


def gradient_intervals(spec: ModelSpec, placement: Placement, times: dict[ComputeKey, tuple[float, float]],
                       memory: MemoryModel, step_end: float) -> list[Interval]:
    """Each chunk's gradients, from the end of its first weight-gradient action (W, else B) to the step's
    end, where the optimizer reads them (``MemoryModel.lazy_gradients``). The action's end, not its start:
    autograd frees each node's saved tensors as it walks past it while the gradients fill in, so the level
    inside the action stays near its start's (SD v2 pp 2, rank 0: 2.04 GiB resident with freed blocks
    handed back against 2.00 GiB sampled between actions) and the activations and kept gradients it
    releases are priced as gone at its end."""
    first: dict[int, float] = {}
    for (kind, chunk, m), (_, end) in times.items():
        if kind == "W" or (kind == "B" and ("W", chunk, m) not in times):
            first[chunk] = min(first.get(chunk, end), end)
    out: list[Interval] = []
    for c, chunk in enumerate(placement.chunks):
        nbytes = memory.gradient_bytes(spec, chunk.start, chunk.end)
        if nbytes and c in first:
            out.append((chunk.device, first[c], step_end, nbytes, "gradients"))
    return out


def returned_gradient_intervals(spec: ModelSpec, placement: Placement,
                                times: dict[ComputeKey, tuple[float, float]], memory: MemoryModel) -> list[Interval]:
    """Each backward's own set of its chunk's parameter gradients (``MemoryModel.returned_gradients``), from
    its B's start to where it is added: B's end, or its W's end when split. SD v2 at pp 2 on MindSpore,
    worker 1: the second microbatch's B of chunk 2 (754 M parameters, a 2.8 GiB set) took the worker from 6.8
    to 9.6 GiB, beside the first's set. Counted for every microbatch: the first's set is also whole before it becomes the
    accumulated one (``gradient_intervals``, from that end), and the activations B frees meanwhile are
    priced until its FREE, so inside B this is an upper bound."""
    out: list[Interval] = []
    for (kind, c, m), (start, end) in times.items():
        if kind != "B":
            continue
        chunk = placement.chunks[c]
        nbytes = memory.gradient_bytes(spec, chunk.start, chunk.end)
        if nbytes:
            added = times[("W", c, m)][1] if ("W", c, m) in times else end
            out.append((chunk.device, start, added, nbytes, "gradients"))
    return out


@dataclass(frozen=True)
class EncodeHold:
    """One encode's output held on its device: ``nbytes`` until its local readers' forwards
    (``readers``) and its messages' departures are done."""

    encoder: int
    microbatch: int
    device: int
    nbytes: int
    readers: tuple[int, ...]  # reader chunks on the same device


def encode_intervals(times: dict[ComputeKey, tuple[float, float]], messages: list[MessageEvent],
                     holds: list[EncodeHold]) -> list[Interval]:
    departures: dict[tuple[int, int], float] = {}
    for msg in messages:
        if msg.direction == "E":
            key = (msg.src_chunk, msg.microbatch)
            departures[key] = max(departures.get(key, 0.0), msg.end)
    out: list[Interval] = []
    step_end = max((end for _, end in times.values()), default=0.0)
    for h in holds:
        end = times[("E", h.encoder, h.microbatch)][1]
        until = max([end, departures.get((h.encoder, h.microbatch), end)]
                    + [times.get(("F", c, h.microbatch), (step_end, step_end))[1] for c in h.readers])
        out.append((h.device, end, until, h.nbytes, "buffers"))
    return out


def _sweep(points: list[tuple[float, int, str]]) -> tuple[int, dict[str, int], list[tuple[float, int]]]:
    """Peak total, the per-category split at the peak, and the total's step curve."""
    points.sort(key=lambda p: (p[0], p[1] > 0))
    level = {c: 0 for c in CATEGORIES}
    peak, at_peak, curve = 0, dict(level), []
    for time, delta, cat in points:
        level[cat] += delta
        total = sum(level.values())
        curve.append((time, total))
        if total > peak:
            peak, at_peak = total, dict(level)
    return peak, at_peak, curve


def inflight_peaks(placement: Placement, times: dict[ComputeKey, tuple[float, float]],
                   num_devices: int) -> list[int]:
    """Peak count of microbatches with a forward started and a backward unfinished, per device."""
    first: dict[tuple[int, int], float] = {}
    last: dict[tuple[int, int], float] = {}
    for (kind, c, m), (start, end) in times.items():
        if kind == "E":  # an encode holds nothing for a backward (and its c is an encoder, not a chunk)
            continue
        key = (placement.chunks[c].device, m)
        if kind == "F":
            first[key] = min(first.get(key, start), start)
        else:
            last[key] = max(last.get(key, end), end)
    points: dict[int, list[tuple[float, int, str]]] = {d: [] for d in range(num_devices)}
    for (d, m), start in first.items():
        points[d] += [(start, 1, "activations"), (last[(d, m)], -1, "activations")]
    return [_sweep(points[d])[0] for d in range(num_devices)]


def profile_memory(spec: ModelSpec, placement: Placement, costs: CostTable,
                   times: dict[ComputeKey, tuple[float, float]], frees: Frees, messages: list[MessageEvent],
                   num_microbatches: int, memory: MemoryModel, encoder_weights: list[int] | None = None,
                   holds: list[EncodeHold] = ()) -> MemoryProfile:
    """Peaks per device; ``encoder_weights`` (bytes per device) and ``holds`` when the plan encodes."""
    # lazy gradients are intervals (gradient_intervals), not static
    static = model_static_bytes(spec, placement, replace(memory, grad_bytes=0) if memory.lazy_gradients else memory)
    weights = encoder_weights or [0] * placement.num_devices
    per_device: dict[int, list[tuple[float, int, str]]] = {d: [] for d in range(placement.num_devices)}
    intervals = memory_intervals(spec, placement, costs, times, frees, messages, num_microbatches, memory)
    intervals += encode_intervals(times, messages, list(holds))
    for device, start, end, nbytes, cat in intervals:
        per_device[device] += [(start, nbytes, cat), (end, -nbytes, cat)]
    peaks, splits, skip_peaks, skip_curves = [], [], [], []
    for d, points in per_device.items():
        peak, split, _ = _sweep(list(points))
        peaks.append(static[d] + weights[d] + peak)
        splits.append(MemoryBreakdown(static[d], split["activations"], split["skip_cache"], split["buffers"],
                                      weights[d], split["gradients"]))
        skip_peak, _, curve = _sweep([p for p in points if p[2] == "skip_cache"])
        skip_peaks.append(skip_peak)
        skip_curves.append(tuple(curve))
    inflight = inflight_peaks(placement, times, placement.num_devices)
    return MemoryProfile(tuple(peaks), tuple(splits), tuple(inflight), tuple(skip_peaks), tuple(skip_curves))
