"""The plan: everything a rank needs to run, round-tripping through YAML.

A plan names its model (a zoo name or a spec YAML path), its cluster, the
parallel degrees, microbatching, the placement (with the first and last layer
name of every chunk, so a plan cannot silently run on a different model) and
the compute schedule; sends and receives are derived again on load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pulse.errors import PlanError, PulseError
from pulse.placement import Chunk, Placement
from pulse.schedule.ir import Schedule
from pulse.spec import ModelSpec
from pulse.yamlio import check_keys, dump_json, dump_yaml, load_mapping, require_number, write_atomic

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
        if self.schedule is not None:
            data["schedule"] = self.schedule.compute_only().to_dict()
        if self.predicted:
            data["predicted"] = dict(self.predicted)
        return data

    def save(self, path: str | Path, spec: ModelSpec | None = None) -> None:
        path = Path(path)
        data = self.to_dict(spec)
        write_atomic(path, dump_json(data) if path.suffix == ".json" else dump_yaml(data))


_REQUIRED = {"pulse_plan", "model", "cluster", "pp", "dp", "microbatch_size", "num_microbatches",
             "partitioner", "placement"}
_OPTIONAL = {"model_options", "schedule", "predicted"}


def plan_from_dict(data: dict, where: str = "plan") -> Plan:
    check_keys(data, _REQUIRED, _OPTIONAL, where)
    if data["pulse_plan"] != PLAN_VERSION:
        raise PulseError(f"{where}: plan version {data['pulse_plan']!r} is not supported (expected {PLAN_VERSION})")
    ints = {k: require_number(data, k, where, positive=True, integer=True)
            for k in ("pp", "dp", "microbatch_size", "num_microbatches")}
    placement = _placement_from_dict(data["placement"], ints["pp"], data["partitioner"], f"{where}: placement")
    schedule = None
    if data.get("schedule") is not None:
        schedule = Schedule.from_dict(data["schedule"], where=f"{where}: schedule")
    return Plan(model=str(data["model"]), cluster=str(data["cluster"]), partitioner=str(data["partitioner"]),
                placement=placement, schedule=schedule, model_options=dict(data.get("model_options") or {}),
                predicted=dict(data.get("predicted") or {}), **ints)


def _placement_from_dict(data: dict, pp: int, partitioner: str, where: str) -> Placement:
    if not isinstance(data, dict):
        raise PulseError(f"{where}: expected a mapping")
    check_keys(data, {"kind", "chunks"}, {"skip_transport"}, where)
    if data["kind"] not in ("sequential", "interleaved", "v", "wave"):
        raise PulseError(f"{where}: unknown kind {data['kind']!r} (sequential, interleaved, v, wave)")
    chunks = []
    for i, row in enumerate(data["chunks"] or []):
        at = f"{where}: chunks[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping")
        check_keys(row, {"device", "start", "end"}, {"first", "last"}, at)
        chunks.append(Chunk(*(require_number(row, k, at, integer=True) for k in ("start", "end", "device"))))
    transport = data.get("skip_transport", "relay")
    if transport not in ("relay", "direct"):
        raise PulseError(f"{where}: skip_transport must be relay or direct, got {transport!r}")
    return Placement(data["kind"], pp, tuple(chunks), transport, str(partitioner))


def check_layer_names(data: dict, spec: ModelSpec, where: str) -> None:
    """A plan's recorded chunk boundaries must name this spec's layers."""
    for i, row in enumerate(data["placement"]["chunks"]):
        for key, index in (("first", row["start"]), ("last", row["end"] - 1)):
            if key in row and (index >= spec.num_layers or spec.layers[index].name != row[key]):
                raise PlanError(f"{where}: chunk {i} expects layer '{row[key]}' at index {index}, "
                                f"but model '{spec.name}' differs: re-plan for this model")


def load_plan(path: str | Path, spec_loader=None) -> tuple[Plan, ModelSpec | None]:
    """Load and validate a plan; with ``spec_loader(name, options)`` also check it against the model."""
    data = load_mapping(path)
    plan = plan_from_dict(data, str(path))
    spec = None
    if spec_loader is not None:
        spec = spec_loader(plan.model, plan.model_options)
        check_layer_names(data, spec, str(path))
        try:
            plan.check_against(spec)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None
    return plan, spec
