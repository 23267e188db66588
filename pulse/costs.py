"""Cost tables and the profiler interface.

A ``CostTable`` holds, for one microbatch size, every layer's forward and
backward seconds and activation memory. The analytic profiler below derives it
from FLOPs and bytes with a roofline; the backends' measuring profilers time
real layers and write the same table.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from pulse.encoders import Encoder, EncoderSet
from pulse.errors import PulseError
from pulse.hardware import Hardware
from pulse.spec import ModelSpec
from pulse.atomic_io import write_atomic
from pulse.yamlio import check_keys, dump_yaml, load_mapping, require_list, require_number, require_text

BACKWARD_FLOP_RATIO = 2.0  # grads w.r.t. inputs and weights: two GEMMs per forward GEMM
# Share of a layer's backward spent on input gradients when B and W are split and
# nothing measured it: two GEMMs per forward GEMM, one each, is the textbook split.
BACKWARD_INPUT_FRACTION = 0.5
_OPTIONAL_COLUMNS = ("bwd_input", "bwd_weight", "optimizer")
# O: a chunk's optimizer step; D: a device's own copy of a microbatch's batch (``batch_seconds``)
PER_ACTION_KINDS = ("F", "B", "Bi", "W", "O", "D")
COLD_START_KINDS = ("F", "B", "Bi", "W")  # compute actions; Bi: the input half of a split backward
SPAN_KINDS = ("F", "B", "Bi", "W", "O")  # what a measured chunk holds: its actions and its optimizer step


@dataclass(frozen=True)
class CostTable:
    model: str
    microbatch_size: int
    layer_names: tuple[str, ...]
    fwd: tuple[float, ...]  # seconds per microbatch
    bwd: tuple[float, ...]
    act_mem: tuple[int, ...]  # bytes kept for backward per microbatch (see ``act_mem_measured``)
    source: str = "analytic"
    bwd_input: tuple[float, ...] = ()  # measured input-gradient half of bwd (the B of a B/W split); () unknown
    # measured weight half (W) of a one-layer chunk (from the gradients B kept: pulse_torch.weight_grads;
    # a table measured before that walked the layer's inner activations again); () unknown
    bwd_weight: tuple[float, ...] = ()
    optimizer: tuple[float, ...] = ()  # seconds of one optimizer step over the layer's parameters; () unknown
    # frozen encoders (pulse.encoders): (name, forward seconds per microbatch), measured or analytic; () none
    encoder_fwd: tuple[tuple[str, float], ...] = ()
    # Per action kind (F, B, Bi, W: forward, whole backward, split input and weight halves; O: a chunk's
    # optimizer step): the seconds an action costs once however many layers it runs (dispatch, autograd's
    # call, the executor's bookkeeping), fitted by ``pulse profile`` on chunks of a few layers against
    # their one-layer figures. The layer columns hold one-layer chunks, so n layers cost their sum minus
    # (n - 1) times this. May be negative for W: a longer chunk's W walks its activations again.
    # D is not per layer: see ``batch_seconds``.
    per_action: tuple[tuple[str, float], ...] = ()
    # Per compute kind: the seconds more an action takes when it follows a send or a receive on its
    # rank instead of another compute action. Why: the layer columns are timed back to back, but in
    # a pipeline most actions start right after the communicator ran (or the rank slept in a receive),
    # with the layer's code and data out of the caches: ~0.1 ms an action on this host's CPU, the
    # lag that grew through every traced many-action step. ``pulse profile`` times each layer right
    # after a real exchange with a partner rank and back to back; the simulator adds it to every
    # compute action a message action precedes (``pulse.sim.program``).
    cold_start: tuple[tuple[str, float], ...] = ()
    # The backend's split backward computes the input and the weight gradients in B, whether or not
    # the chunk's inputs need any (MindSpore's vjp), and W only adds the weight gradients up: B costs
    # ``bwd_input`` (measured as that B) on every chunk, the first too, W ``bwd_weight`` (that sum).
    # Its whole backward is the same B then the same W, and is priced as their sum: timed on its
    # own, it read no more than B alone on every layer (``bwd_input`` clamped to ``bwd``), while
    # traced training ran it at B + W (tiny-uvit: 0.4-1 ms above ``bwd`` per action).
    whole_backward_in_b: bool = False
    # ``act_mem`` as ``pulse profile`` counted it: the bytes autograd saved for the backward while each
    # layer ran its forward (unique storages, the parameters and autocast's copies of them not counted:
    # the memory model counts those), under the run's precision. False: the spec's analytic
    # ``saved_bytes`` (the roofline's tables, older profiles, a backend that cannot count them).
    act_mem_measured: bool = False
    # (start, end, kind, seconds): an action of ``kind`` (SPAN_KINDS) over layers [start, end) as one
    # chunk, timed where a plan runs it (``pulse profile --plan P --time-chunks``: P's chunks; the first
    # chunk makes the batch, the others' inputs arrive as messages, as ``per_action`` is fitted). It
    # stands for the layers' sum less the per-action fit wherever a chunk has exactly those layers.
    # Why: a chunk's saving per joined layer grows with its length (a one-chunk SD v2 step on an H200
    # took 30% less than its layers alone, where the fit on 3-layer chunks found no saving). Not by
    # default: on this CPU a whole tiny-unet timed so predicted its step 2-20% fast, where its layers
    # were within 4% (RESULTS, "On a GPU").
    spans: tuple[tuple[int, int, str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        n = len(self.layer_names)
        for attr in ("fwd", "bwd", "act_mem", *_OPTIONAL_COLUMNS):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
            if attr in _OPTIONAL_COLUMNS and not getattr(self, attr):
                continue
            if len(getattr(self, attr)) != n:
                raise PulseError(f"cost table for '{self.model}': '{attr}' has "
                                 f"{len(getattr(self, attr))} entries for {n} layers")
        object.__setattr__(self, "encoder_fwd", tuple((str(n), float(t)) for n, t in self.encoder_fwd))
        object.__setattr__(self, "per_action", tuple((str(k), float(t)) for k, t in self.per_action))
        object.__setattr__(self, "cold_start", tuple((str(k), float(t)) for k, t in self.cold_start))
        object.__setattr__(self, "spans", tuple((int(a), int(b), str(k), float(t)) for a, b, k, t in self.spans))
        self._check_spans()
        for key, known in (("per_action", PER_ACTION_KINDS), ("cold_start", COLD_START_KINDS)):
            unknown = sorted({k for k, _ in getattr(self, key)} - set(known))
            if unknown:
                raise PulseError(f"cost table for '{self.model}': '{key}' has unknown kinds {unknown} "
                                 f"(known: {', '.join(known)})")
        if any(v < 0 for v in self.fwd + self.bwd + self.bwd_input + self.bwd_weight + self.optimizer
               + tuple(t for _, t in self.encoder_fwd)):
            raise PulseError(f"cost table for '{self.model}': negative time")
        if any(i > b * (1 + 1e-9) for i, b in zip(self.bwd_input, self.bwd)):
            raise PulseError(f"cost table for '{self.model}': 'bwd_input' exceeds 'bwd' (the input half of a "
                             "backward cannot take longer than the whole)")

    def _check_spans(self) -> None:
        n, seen = len(self.layer_names), set()
        for a, b, kind, seconds in self.spans:
            where = f"cost table for '{self.model}': span of layers {a}..{b - 1} ({kind})"
            if not 0 <= a < b <= n:
                raise PulseError(f"{where} is outside its {n} layers: re-profile the plan")
            if kind not in SPAN_KINDS:
                raise PulseError(f"{where}: unknown kind (known: {', '.join(SPAN_KINDS)})")
            if not seconds >= 0:
                raise PulseError(f"{where}: seconds must be a time >= 0, got {seconds!r}")
            if (a, b, kind) in seen:
                raise PulseError(f"{where} is given twice; keep one")
            seen.add((a, b, kind))

    def measured_span(self, kind: str, start: int, end: int) -> float | None:
        """The measured seconds of ``kind`` over exactly layers [start, end) as one chunk (``spans``), if any."""
        for a, b, k, seconds in self.spans:
            if (a, b, k) == (start, end, kind):
                return seconds
        return None

    def _chunk(self, column: tuple[float, ...], kind: str, start: int, end: int) -> float:
        """Seconds of one action over layers [start, end): measured as that chunk (``spans``), else
        their one-layer figures, less the per-action cost counted once per layer in them (``per_action``)."""
        measured = self.measured_span(kind, start, end)
        if measured is not None:
            return measured
        once = dict(self.per_action).get(kind, 0.0)
        return max(sum(column[start:end]) - max(end - start - 1, 0) * once, 0.0)

    def span(self, start: int, end: int) -> tuple[float, float]:
        """(forward, backward) seconds of layers [start, end) as one chunk. With
        ``whole_backward_in_b`` the whole backward is that B then that W, as the backend runs it."""
        if self.whole_backward_in_b and self.bwd_input:
            return (self._chunk(self.fwd, "F", start, end),
                    self.input_backward(start, end) + self.weight_backward(start, end))
        return self._chunk(self.fwd, "F", start, end), self._chunk(self.bwd, "B", start, end)

    def total(self, start: int, end: int) -> float:
        f, b = self.span(start, end)
        return f + b

    def input_backward(self, start: int, end: int) -> float:
        """Seconds of the input-gradient half (B) of layers [start, end) when the backward is split."""
        if self.bwd_input:
            return self._chunk(self.bwd_input, "Bi", start, end)
        return BACKWARD_INPUT_FRACTION * sum(self.bwd[start:end])

    def weight_backward(self, start: int, end: int) -> float:
        """Seconds of the weight-gradient half (W) of each layer on its own, summed."""
        if self.bwd_weight:
            return self._chunk(self.bwd_weight, "W", start, end)
        return sum(self.bwd[start:end]) - self.input_backward(start, end)

    def split_backward(self, start: int, end: int, input_grads: bool = True) -> tuple[float, float]:
        """(B, W) seconds of a chunk's backward split as the runtime splits it.

        B asks autograd for the chunk's input gradients: the input halves of all its
        layers, keeping the gradients where the parameters' paths join them; W runs
        from those, the weight halves alone (``pulse_torch.weight_grads``). A chunk
        whose inputs need no gradient (the first) has nothing for B to do: W then asks
        for the parameters' gradients from the chunk's outputs, which walks the
        activation gradients down to the second layer too (the input halves of layers
        start+1 .. end-1). See also ``whole_backward_in_b``.
        """
        measured = self.measured_span("Bi", start, end), self.measured_span("W", start, end)
        if None not in measured:  # timed where the plan runs it: the first chunk's B has no input to walk
            return measured
        if self.whole_backward_in_b or input_grads:
            return self.input_backward(start, end), self.weight_backward(start, end)
        return 0.0, self.weight_backward(start, end) + self.input_backward(start + 1, end)

    def batch_seconds(self) -> float:
        """Seconds a device spends making its own copy of a microbatch's batch (seeded noise,
        timesteps, conditions), in the first of its chunks' forwards that reads it: every device
        whose chunks read the data makes it (``pulse.data.feed``). Layer 0's figure holds it already
        (the profile's first chunk makes the batch), so it is added only on the other devices."""
        return dict(self.per_action).get("D", 0.0)

    def optimizer_seconds(self, start: int, end: int) -> float:
        """Seconds of the optimizer step over layers [start, end) as one chunk (0 when not measured):
        the runtime steps (and clips) a chunk's parameters in one call, whose fixed cost ``per_action``
        O counts once."""
        return self._chunk(self.optimizer, "O", start, end) if self.optimizer else 0.0

    def cold_start_seconds(self, kind: str) -> float:
        """Seconds more a compute action of ``kind`` (F, B, Bi, W) takes right after a message action
        (0 when not measured)."""
        return dict(self.cold_start).get(kind, 0.0)

    def encoder_seconds(self, name: str) -> float:
        """Forward seconds of frozen encoder ``name`` on one microbatch (PulseError if not in the table)."""
        for n, t in self.encoder_fwd:
            if n == name:
                return t
        raise PulseError(f"cost table for '{self.model}' has no time for encoder '{name}' (has: "
                         f"{', '.join(n for n, _ in self.encoder_fwd) or 'none'}): profile it, or add the "
                         "analytic estimate (pulse.costs.with_encoder_costs)")

    def check_matches(self, spec: ModelSpec) -> None:
        names = tuple(l.name for l in spec.layers)
        if names != self.layer_names:
            raise PulseError(f"cost table is for model '{self.model}' with {len(self.layer_names)} "
                             f"layers; it does not match '{spec.name}' ({len(names)} layers): re-profile")

    def to_dict(self) -> dict:
        data = asdict(self)
        for key in ("layer_names", "fwd", "bwd", "act_mem", *_OPTIONAL_COLUMNS):
            data[key] = list(data[key])
        for key in _OPTIONAL_COLUMNS:
            if not data[key]:
                del data[key]
        for key in ("encoder_fwd", "per_action", "cold_start"):  # (name, seconds) pairs: a mapping, when any
            if getattr(self, key):
                data[key] = dict(getattr(self, key))
            else:
                del data[key]
        for flag in ("whole_backward_in_b", "act_mem_measured"):  # written when set: older readers never see them
            if not getattr(self, flag):
                del data[flag]
        if self.spans:  # a chunk a mapping: its layers, then seconds by kind
            chunks: dict[tuple[int, int], dict] = {}
            for a, b, kind, seconds in self.spans:
                chunks.setdefault((a, b), {"layers": [a, b]})[kind] = seconds
            data["spans"] = list(chunks.values())
        else:
            del data["spans"]
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "cost table") -> "CostTable":
        """A table from plain data, checked key by key (``where`` names the source in errors)."""
        if not isinstance(data, dict):
            raise PulseError(f"{where}: expected a mapping, got {type(data).__name__}")
        check_keys(data, {"model", "microbatch_size", "layer_names", "fwd", "bwd", "act_mem"},
                   {"source", "encoder_fwd", "per_action", "cold_start", "whole_backward_in_b", "act_mem_measured",
                    "spans", *_OPTIONAL_COLUMNS},
                   where)
        model = require_text(data, "model", where)
        microbatch_size = require_number(data, "microbatch_size", where, positive=True, integer=True)
        names = require_list(data, "layer_names", where, non_empty=True)
        for i, name in enumerate(names):
            require_text({f"layer_names[{i}]": name}, f"layer_names[{i}]", where)
        if len(set(names)) != len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            raise PulseError(f"{where}: 'layer_names' lists layer '{twice}' twice")
        columns = {}
        for key in ("fwd", "bwd", "act_mem", *(k for k in _OPTIONAL_COLUMNS if k in data)):
            values = require_list(data, key, where)
            if len(values) != len(names):
                raise PulseError(f"{where}: '{key}' has {len(values)} entries for {len(names)} layer_names; "
                                 "one per layer")
            columns[key] = tuple(require_number({f"{key}[{i}]": v}, f"{key}[{i}]", where, integer=key == "act_mem")
                                 for i, v in enumerate(values))
        if not any(columns["fwd"]) and not any(columns["bwd"]):  # every plan would cost 0 s: nothing to choose
            raise PulseError(f"{where}: every layer's 'fwd' and 'bwd' is 0 s; a table that prices every plan "
                             "alike cannot choose one: measure it with `pulse profile`")
        source = data.get("source", "analytic")
        if not isinstance(source, str):
            raise PulseError(f"{where}: 'source' must be text, got {type(source).__name__}")
        encoder_fwd = _named_seconds(data, "encoder_fwd", "encoder names", where)
        per_action = _named_seconds(data, "per_action", f"action kinds ({', '.join(PER_ACTION_KINDS)})", where,
                                    allow_negative=True)
        cold_start = _named_seconds(data, "cold_start", f"compute kinds ({', '.join(COLD_START_KINDS)})", where)
        flags = {}
        for flag in ("whole_backward_in_b", "act_mem_measured"):
            flags[flag] = data.get(flag, False)
            if not isinstance(flags[flag], bool):
                raise PulseError(f"{where}: '{flag}' must be true or false, got {flags[flag]!r}")
        return cls(model=model, microbatch_size=microbatch_size, layer_names=tuple(names), source=source,
                   encoder_fwd=encoder_fwd, per_action=per_action, cold_start=cold_start,
                   spans=_spans(data, where, len(names)), **flags, **columns)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=1) if path.suffix == ".json" else dump_yaml(self.to_dict())
        write_atomic(path, text)

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls.from_dict(load_mapping(path), where=str(path))


def _spans(data: dict, where: str, layers_in_table: int) -> tuple[tuple[int, int, str, float], ...]:
    """``spans``: a list of {layers: [start, end], kind: seconds, ...} (absent: none), checked entry by entry."""
    out = []
    for i, entry in enumerate(require_list(data, "spans", where)):
        at = f"{where}: spans[{i}]"
        if not isinstance(entry, dict):
            raise PulseError(f"{at} must be a mapping of 'layers' and seconds by kind")
        check_keys(entry, {"layers"}, set(SPAN_KINDS), at)
        layers = entry["layers"]
        if not (isinstance(layers, list) and len(layers) == 2):
            raise PulseError(f"{at}: 'layers' must be [first, one past the last], got {layers!r}")
        a, b = (require_number({"layers": v}, "layers", at, integer=True) for v in layers)
        if not a < b <= layers_in_table:
            raise PulseError(f"{at}: layers [{a}, {b}] are not a chunk of the table's {layers_in_table} layers "
                             "(first, one past the last): re-profile the plan")
        out += [(a, b, kind, require_number(entry, kind, at)) for kind in SPAN_KINDS if kind in entry]
    return tuple(out)


def _named_seconds(data: dict, key: str, names: str, where: str,
                   allow_negative: bool = False) -> tuple[tuple[str, float], ...]:
    """A mapping of names to seconds under ``key`` (absent: empty), checked value by value."""
    if data.get(key) is None:
        return ()
    times = data[key]
    if not isinstance(times, dict):
        raise PulseError(f"{where}: '{key}' must map {names} to seconds")
    return tuple((str(n), float(require_number(times, n, f"{where}: {key}", allow_negative=allow_negative)))
                 for n in times)


def encoder_roofline(encoder: Encoder, hw: Hardware, microbatch_size: int) -> float:
    """Forward seconds of a frozen encoder, the layers' roofline: max(FLOPs / achievable FLOP/s,
    (weights read once + output written) / HBM bandwidth) + one kernel overhead per block."""
    flops = encoder.flops * microbatch_size
    moved = encoder.weight_bytes + encoder.out_bytes * microbatch_size
    return max(flops / hw.achievable_flops, moved / hw.hbm_bandwidth) + encoder.layers * hw.kernel_overhead


def with_encoder_costs(table: CostTable, encoders: EncoderSet, hw: Hardware) -> CostTable:
    """``table`` with an analytic forward time for every encoder it does not already hold (a measured
    time, from ``pulse profile``, is kept)."""
    have = {n for n, _ in table.encoder_fwd}
    extra = tuple((e.name, encoder_roofline(e, hw, table.microbatch_size)) for e in encoders.encoders
                  if e.name not in have)
    return table if not extra else replace(table, encoder_fwd=table.encoder_fwd + extra)


class Profiler(Protocol):
    def profile(self, spec: ModelSpec, microbatch_size: int) -> CostTable: ...


@dataclass(frozen=True)
class AnalyticProfiler:
    """Roofline estimate: max(FLOPs / achievable FLOP/s, bytes / HBM bandwidth) + overhead."""

    hardware: Hardware

    def profile(self, spec: ModelSpec, microbatch_size: int) -> CostTable:
        if microbatch_size < 1:
            raise PulseError(f"microbatch size must be >= 1, got {microbatch_size}")
        hw = self.hardware
        fwd, bwd, mem = [], [], []
        for layer in spec.layers:
            flops = layer.flops * microbatch_size
            moved = (layer.out_bytes + layer.saved_bytes) * microbatch_size + layer.params * spec.act_bytes
            f = max(flops / hw.achievable_flops, moved / hw.hbm_bandwidth) + hw.kernel_overhead
            b = max(BACKWARD_FLOP_RATIO * flops / hw.achievable_flops, 2 * moved / hw.hbm_bandwidth)
            fwd.append(f)
            bwd.append(b + hw.kernel_overhead)
            mem.append(layer.saved_bytes * microbatch_size)
        return CostTable(
            model=spec.name,
            microbatch_size=microbatch_size,
            layer_names=tuple(l.name for l in spec.layers),
            fwd=tuple(fwd),
            bwd=tuple(bwd),
            act_mem=tuple(mem),
            source=f"analytic:{hw.name}",
        )
