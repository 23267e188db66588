"""The plan: everything a rank needs to run, round-tripping through YAML.

A plan names its model (a zoo name or a spec YAML path), its cluster, the
parallel degrees, microbatching, the placement (with the first and last layer
name of every chunk, so a plan cannot silently run on a different model) and
the compute schedule; messages, frees and all-reduces are added again by
``pulse.schedule.lower`` wherever the plan is run or simulated. A plan that runs
its frozen encoders in the pipeline (E actions) also lists them (``encoders``:
mode and figures, ``pulse.encoders``); plans without the key load as before.

``recompute`` lists the chunks (placement indices) whose forward keeps only its
inputs and whose backward re-runs it first: activation recomputation, priced by
the simulator (``MemoryModel.recompute``) and run by the backends. Per chunk,
so a plan can recompute only where memory is short (the tuner's choice); a
plan file without the key recomputes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pulse.encoders import EncoderSet
from pulse.errors import PlanError, PulseError
from pulse.placement import Chunk, Placement, interleaved_devices, wave_devices
from pulse.schedule.ir import Schedule
from pulse.spec import ModelSpec
from pulse.atomic_io import write_atomic
from pulse.yamlio import (check_keys, dump_json, dump_yaml, load_mapping, require_list, require_mapping,
                          require_number, require_text)

PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    pp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    partitioner: str
    placement: Placement
    schedule: Schedule | None = None
    model_options: dict = field(default_factory=dict, hash=False)
    predicted: dict = field(default_factory=dict, hash=False, compare=False)
    recompute: tuple[int, ...] = ()  # chunks that recompute their activations in the backward
    encoders: EncoderSet | None = None  # the frozen encoders and where they run; None: cached offline

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", tuple(sorted(set(self.recompute))))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatch_size * self.num_microbatches

    def check_against(self, spec: ModelSpec) -> None:
        """The placement must tile this model's layers and name the same layers."""
        self.placement.validate(spec.num_layers)
        if self.placement.num_devices != self.pp:
            raise PlanError(f"plan: placement uses {self.placement.num_devices} devices but pp is {self.pp}")
        _check_recompute(self.recompute, len(self.placement.chunks), "plan")

    def to_dict(self, spec: ModelSpec | None = None) -> dict:
        def chunk_row(c: Chunk) -> dict:
            row = {"device": c.device, "start": c.start, "end": c.end}
            if spec is not None:
                row["first"] = spec.layers[c.start].name
                row["last"] = spec.layers[c.end - 1].name
            return row

        data = {
            "pulse_plan": PLAN_VERSION,
            "model": self.model,
            "model_options": dict(self.model_options),
            "cluster": self.cluster,
            "pp": self.pp,
            "dp": self.dp,
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "partitioner": self.partitioner,
            "placement": {
                "kind": self.placement.kind,
                "skip_transport": self.placement.skip_transport,
                "chunks": [chunk_row(c) for c in self.placement.chunks],
            },
        }
        if self.recompute:  # omitted when off: such a file is what older versions wrote
            data["recompute"] = list(self.recompute)
        if self.schedule is not None:
            data["schedule"] = self.schedule.compute_only().to_dict()
        if self.predicted:
            data["predicted"] = dict(self.predicted)
        if self.encoders is not None:
            data["encoders"] = self.encoders.to_dict()
        return data

    def save(self, path: str | Path, spec: ModelSpec | None = None) -> None:
        path = Path(path)
        data = self.to_dict(spec)
        write_atomic(path, dump_json(data) if path.suffix == ".json" else dump_yaml(data))


_REQUIRED = {"pulse_plan", "model", "cluster", "pp", "dp", "microbatch_size", "num_microbatches",
             "partitioner", "placement"}
_OPTIONAL = {"model_options", "schedule", "predicted", "recompute", "encoders"}


def plan_from_dict(data: dict, where: str = "plan") -> Plan:
    """A plan from plain data, checked on its own: keys and types, a placement that tiles
    layers 0..L-1 with devices matching its kind, and a schedule that runs on it."""
    if not isinstance(data, dict):
        raise PulseError(f"{where}: expected a mapping, got {type(data).__name__}")
    check_keys(data, _REQUIRED, _OPTIONAL, where)
    version = data["pulse_plan"]
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise PulseError(f"{where}: plan version {version!r} is not supported (expected {PLAN_VERSION})")
    texts = {k: require_text(data, k, where) for k in ("model", "cluster", "partitioner")}
    ints = {k: require_number(data, k, where, positive=True, integer=True)
            for k in ("pp", "dp", "microbatch_size", "num_microbatches")}
    options = require_mapping(data, "model_options", where)
    for key, value in options.items():
        if not key.isprintable() or not key:
            raise PulseError(f"{where}: model_options has a key that is not a printable name: {key!r}")
        if not _plain(value) and not (isinstance(value, list) and all(_plain(v) for v in value)):
            raise PulseError(f"{where}: model_options[{key!r}] must be a number, text, boolean or a list "
                             f"of them, got {type(value).__name__}")
    predicted = require_mapping(data, "predicted", where)
    placement = _placement_from_dict(data["placement"], ints["pp"], texts["partitioner"], f"{where}: placement")
    recompute = _recompute_from_dict(data, len(placement.chunks), where)
    encoders = None
    if data.get("encoders") is not None:
        encoders = EncoderSet.from_dict(data["encoders"], f"{where}: encoders")
    schedule = None
    if data.get("schedule") is not None:
        schedule = Schedule.from_dict(data["schedule"], where=f"{where}: schedule")
        _check_schedule(schedule, placement, ints["num_microbatches"], f"{where}: schedule")
        _check_encodes(schedule, encoders, f"{where}: schedule")
    return Plan(model=texts["model"], cluster=texts["cluster"], partitioner=texts["partitioner"],
                placement=placement, schedule=schedule, model_options=dict(options),
                predicted=dict(predicted), recompute=recompute, encoders=encoders, **ints)


def _recompute_from_dict(data: dict, num_chunks: int, where: str) -> tuple[int, ...]:
    if data.get("recompute") is None:
        return ()
    values = require_list(data, "recompute", where)
    chunks = tuple(require_number({f"recompute[{i}]": v}, f"recompute[{i}]", where, integer=True)
                   for i, v in enumerate(values))
    if len(set(chunks)) != len(chunks):
        raise PulseError(f"{where}: 'recompute' lists a chunk twice: {_brief(list(chunks))}")
    _check_recompute(chunks, num_chunks, where)
    return chunks


def _check_recompute(chunks: tuple[int, ...], num_chunks: int, where: str) -> None:
    wrong = [c for c in chunks if not 0 <= c < num_chunks]
    if wrong:
        raise PlanError(f"{where}: 'recompute' names chunk {wrong[0]}, but the placement has chunks "
                        f"0..{num_chunks - 1}")


def _check_encodes(schedule: Schedule, encoders: EncoderSet | None, where: str) -> None:
    """E actions name encoders the plan lists, and only a plan whose encoders run in the pipeline has them."""
    encodes = [a for a in schedule.all_actions() if a.is_encode]
    if not encodes:
        return
    if encoders is None or not encoders.active:
        raise PlanError(f"{where}: has encode actions ({encodes[0]}) but the plan's encoders are "
                        f"{'missing' if encoders is None else 'cached'}")
    bad = [a for a in encodes if a.encoder >= len(encoders.encoders)]
    if bad:
        raise PlanError(f"{where}: action {bad[0]} names encoder {bad[0].encoder}; the plan lists "
                        f"{len(encoders.encoders)}")


def _plain(value) -> bool:
    return isinstance(value, (bool, int, float, str)) and not (isinstance(value, float) and value != value)


def _placement_from_dict(data: dict, pp: int, partitioner: str, where: str) -> Placement:
    if not isinstance(data, dict):
        raise PulseError(f"{where}: expected a mapping with kind, chunks[, skip_transport], got {type(data).__name__}")
    check_keys(data, {"kind", "chunks"}, {"skip_transport"}, where)
    if data["kind"] not in ("sequential", "interleaved", "v", "wave"):
        raise PulseError(f"{where}: unknown kind {data['kind']!r} (sequential, interleaved, v, wave)")
    chunks = []
    for i, row in enumerate(require_list(data, "chunks", where, non_empty=True)):
        at = f"{where}: chunks[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping with device, start, end, got {type(row).__name__}")
        check_keys(row, {"device", "start", "end"}, {"first", "last"}, at)
        for key in ("first", "last"):
            if key in row:
                require_text(row, key, at)
        chunk = Chunk(*(require_number(row, k, at, integer=True) for k in ("start", "end", "device")))
        if chunk.device >= pp:
            raise PulseError(f"{at}: 'device' is {chunk.device}, but pp = {pp} gives devices 0..{pp - 1}")
        chunks.append(chunk)
    transport = data.get("skip_transport", "relay")
    if transport not in ("relay", "direct"):
        raise PulseError(f"{where}: skip_transport must be relay or direct, got {transport!r}")
    if len(chunks) < pp:
        raise PlanError(f"{where}: pp is {pp} but there are only {len(chunks)} chunks; every device needs one")
    placement = Placement(data["kind"], pp, tuple(chunks), transport, partitioner)
    try:
        placement.validate(placement.num_layers)  # tiles 0..end with no gap or overlap, every device used
    except PlanError as exc:
        raise PlanError(f"{where}: {str(exc).removeprefix('placement: ')}") from None
    _check_kind(placement, where)
    return placement


def _check_kind(placement: Placement, where: str) -> None:
    """The chunk devices must follow the placement kind's pattern (placement.py's picture)."""
    pp, n = placement.num_devices, len(placement.chunks)
    devices = [c.device for c in placement.chunks]
    kind = placement.kind
    if kind == "sequential":
        ok, want = n == pp, "one chunk per device"
    elif kind == "interleaved":
        ok, want = n % pp == 0 and devices == interleaved_devices(pp, n // pp), "chunk c on device c % pp"
    else:
        folds = n // (2 * pp)
        ok = n % (2 * pp) == 0 and (folds == 1 or kind == "wave") and devices == wave_devices(pp, folds)
        want = ("devices 0..pp-1 then pp-1..0" if kind == "v"
                else "the zigzag 0..pp-1, pp-1..0, repeated per fold")
    if not ok:
        raise PlanError(f"{where}: a {kind} placement needs {want}; chunk devices are {_brief(devices)}")


def _brief(values: list) -> str:
    text = " ".join(str(values).split())
    return text if len(text) <= 60 else text[:57] + "...]"


def _check_schedule(schedule: Schedule, placement: Placement, num_microbatches: int, where: str) -> None:
    """The schedule must be for this placement and microbatch count, and must not deadlock."""
    from pulse.schedule.validate import validate

    if schedule.num_microbatches != num_microbatches:
        raise PlanError(f"{where}: 'num_microbatches' is {schedule.num_microbatches}, but the plan's "
                        f"num_microbatches is {num_microbatches}")
    with_comm = any(a.is_comm for a in schedule.all_actions())
    try:
        validate(schedule, placement, num_microbatches, with_comm=with_comm)
    except PlanError as exc:  # the first line says what is wrong; the grid is for `pulse simulate`
        raise PlanError(f"{where}: {str(exc).splitlines()[0]}") from None


def check_layer_names(data: dict, spec: ModelSpec, where: str) -> None:
    """A plan's recorded chunk boundaries must name this spec's layers."""
    for i, row in enumerate(data["placement"]["chunks"]):
        at = f"{where}: placement: chunks[{i}]"
        start = require_number(row, "start", at, integer=True)
        end = require_number(row, "end", at, integer=True)
        for key, index in (("first", start), ("last", end - 1)):
            if key in row and (index >= spec.num_layers or spec.layers[index].name != row[key]):
                found = f"'{spec.layers[index].name}'" if index < spec.num_layers else "no layer"
                raise PlanError(f"{at}: '{key}' expects layer '{row[key]}' at index {index}, but model "
                                f"'{spec.name}' has {found} there: re-plan for this model")


def load_plan(path: str | Path, spec_loader=None) -> tuple[Plan, ModelSpec | None]:
    """Load and validate a plan; with ``spec_loader(name, options)`` also check it against the model."""
    data = load_mapping(path)
    plan = plan_from_dict(data, str(path))
    spec = None
    if spec_loader is not None:
        try:
            spec = spec_loader(plan.model, plan.model_options)
        except PulseError as exc:
            raise type(exc)(f"{path}: 'model': {exc}") from None
        check_layer_names(data, spec, str(path))
        try:
            plan.check_against(spec)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None
    return plan, spec
