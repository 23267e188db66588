"""Accelerator and cluster descriptions (data under configs/hardware and configs/clusters)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from pulse.errors import PulseError
from pulse.links import AllReduceCurve, LinkCost, curves_from_list, curves_to_list, links_from_list, links_to_list
from pulse.yamlio import check_keys, dump_yaml, load_mapping, require_mapping, require_number, require_text
from pulse.atomic_io import write_atomic

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

_HW_NUMBERS = {
    "peak_flops": True,  # positive
    "efficiency": True,
    "memory_bytes": True,
    "hbm_bandwidth": True,
    "intra_node_bandwidth": True,
    "intra_node_latency": False,
    "inter_node_bandwidth": True,
    "inter_node_latency": False,
    "devices_per_node": True,
    "kernel_overhead": False,
}
CORE_KEYS = ("shared_cores", "pinned_cores", "core_sharing")  # a CPU host's cores, in hardware or cluster YAML
COMMUNICATOR_KEYS = ("deferred_buckets", "tensor_messages", "buckets_at_chunk_end")  # what the job's communicator does, in cluster YAML


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind and the links around it. Bandwidths in bytes/s per direction."""

    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s
    efficiency: float  # fraction of peak a well-shaped layer reaches
    memory_bytes: int
    hbm_bandwidth: float  # device memory bytes/s, for memory-bound layers
    intra_node_bandwidth: float  # point-to-point, one direction
    intra_node_latency: float  # seconds
    inter_node_bandwidth: float  # per device, one direction
    inter_node_latency: float
    devices_per_node: int
    kernel_overhead: float = 0.0  # seconds of fixed cost per layer per pass
    sources: dict = field(default_factory=dict, compare=False, hash=False)
    message_overhead: float = 0.0  # seconds a rank spends per wire message (headers, calls, wake-ups)
    shared_cores: int | None = None  # a CPU host: its ranks share this many cores (None: a device per rank)
    pinned_cores: bool = True  # its ranks pinned as pulse.cores.cores_of pins them (False: one pool, PULSE_PIN_CORES=0)
    core_sharing: float = 1.0  # the share of a core ranks sharing it keep together (switching costs the rest)

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency


@dataclass(frozen=True)
class Cluster:
    """Nodes of one hardware kind; ``links`` and ``allreduce`` hold what ``pulse profile`` measured."""

    name: str
    hardware: Hardware
    nodes: int = 1
    links: Mapping[tuple[int, int], LinkCost] = field(default_factory=dict, compare=False, hash=False)
    allreduce: tuple[AllReduceCurve, ...] = ()
    source: str = ""
    # The communicator sums data-parallel buckets only after the rank's actions (it has no
    # asynchronous all-reduce: MindSpore's, pulse_mindspore.comm), not beside the backward.
    deferred_buckets: bool = False
    # The communicator sends each tensor of a transfer as a wire message of its own (MindSpore's),
    # not the transfer's tensors together in one (PyTorch's send_group).
    tensor_messages: bool = False
    # The backend's backward yields a chunk's gradients only once it ends (MindSpore's vjp), so its
    # buckets all launch at the chunk's AR, not layer group by layer group inside it (pulse.grad_buckets).
    buckets_at_chunk_end: bool = False

    @property
    def shared_cores(self) -> int | None:
        return self.hardware.shared_cores

    @property
    def pinned_cores(self) -> bool:
        return self.hardware.pinned_cores

    def link_cost(self, a: int, b: int) -> LinkCost:
        """The measured link from rank ``a`` to ``b``, else the hardware's figures."""
        if (a, b) in self.links:
            return self.links[(a, b)]
        bandwidth, latency = self._hardware_link(a, b)
        overhead = self.hardware.message_overhead
        return LinkCost(bandwidth, latency, overhead, overhead)

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float | None:
        """Measured all-reduce time over ``ranks`` ranks, or None when not measured for that size."""
        for curve in self.allreduce:
            if curve.ranks == ranks:
                return curve.time(nbytes)
        return None

    def with_link_bandwidth(self, bandwidth: float) -> "Cluster":
        """Every link at ``bandwidth`` (an emulated or throttled network), other terms kept."""
        pairs = set(self.links) | {(a, b) for a in range(self.num_devices) for b in range(self.num_devices) if a != b}
        links = {p: self.link_cost(*p).with_bandwidth(bandwidth) for p in pairs}
        return replace(self, name=f"{self.name}@{bandwidth:g}B/s", links=links)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.hardware.devices_per_node

    def same_node(self, a: int, b: int) -> bool:
        per = self.hardware.devices_per_node
        return a // per == b // per

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between global devices a and b."""
        cost = self.link_cost(a, b)
        return cost.bandwidth, cost.latency

    def _hardware_link(self, a: int, b: int) -> tuple[float, float]:
        hw = self.hardware
        if self.same_node(a, b):
            return hw.intra_node_bandwidth, hw.intra_node_latency
        return hw.inter_node_bandwidth, hw.inter_node_latency

    def transfer_time(self, a: int, b: int, nbytes: float) -> float:
        if a == b or nbytes <= 0:
            return 0.0
        bandwidth, latency = self.link(a, b)
        return latency + nbytes / bandwidth


def hardware_from_dict(data: dict, where: str) -> Hardware:
    if not isinstance(data, dict):
        raise PulseError(f"{where}: expected a mapping, got {type(data).__name__}")
    check_keys(data, {"name", *_HW_NUMBERS}, {"sources", "notes", "message_overhead", *CORE_KEYS}, where)
    name = require_text(data, "name", where)
    values = {}
    for key, positive in _HW_NUMBERS.items():
        integer = key in ("memory_bytes", "devices_per_node")
        values[key] = require_number(data, key, where, positive=positive, integer=integer)
    if "message_overhead" in data:
        values["message_overhead"] = require_number(data, "message_overhead", where)
    values.update(host_cores(data, where))
    if values["efficiency"] > 1:
        raise PulseError(f"{where}: 'efficiency' is a fraction of peak and must be <= 1")
    sources = require_mapping(data, "sources", where)
    if data.get("notes") is not None and not isinstance(data["notes"], str):
        raise PulseError(f"{where}: 'notes' must be text, got {type(data['notes']).__name__}")
    return Hardware(name=name, sources=dict(sources), **values)


def load_hardware(name_or_path: str) -> Hardware:
    path = _resolve(name_or_path, "hardware")
    return hardware_from_dict(load_mapping(path), str(path))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster YAML (hardware + nodes), or a hardware name or YAML meaning one node of it."""
    try:
        path = _resolve(name_or_path, "clusters")
    except PulseError:
        if not (CONFIG_DIR / "hardware" / f"{name_or_path}.yaml").exists():
            raise PulseError(f"unknown cluster or hardware '{name_or_path}' (clusters: "
                             f"{', '.join(available('clusters')) or 'none'}; hardware: "
                             f"{', '.join(available('hardware')) or 'none'}); or pass a YAML path") from None
        return Cluster(name=name_or_path, hardware=load_hardware(name_or_path), nodes=1)
    data = load_mapping(path)
    where = str(path)
    if "hardware" not in data and "peak_flops" in data:  # a hardware file: one node of it
        hardware = hardware_from_dict(data, where)
        return Cluster(name=hardware.name, hardware=hardware, nodes=1)
    check_keys(data, {"name", "hardware", "nodes"},
               {"notes", "source", *CORE_KEYS, "links", "allreduce", *COMMUNICATOR_KEYS}, where)
    name = require_text(data, "name", where)
    nodes = require_number(data, "nodes", where, positive=True, integer=True)
    for key in ("notes", "source"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise PulseError(f"{where}: '{key}' must be text, got {type(data[key]).__name__}")
    hardware_name = require_text(data, "hardware", where)
    try:
        hardware = load_hardware(hardware_name)
    except PulseError as exc:
        raise PulseError(f"{where}: 'hardware': {exc}") from None
    hardware = replace(hardware, **host_cores(data, where))
    links = links_from_list(require_list_or_empty(data, "links", where), where)
    cluster = Cluster(name=name, hardware=hardware, nodes=nodes, links=links,
                      allreduce=curves_from_list(require_list_or_empty(data, "allreduce", where), where),
                      source=data.get("source") or "", **communicator_flags(data, where))
    outside = sorted({r for pair in links for r in pair if r >= cluster.num_devices})
    if outside:
        raise PulseError(f"{where}: 'links' name ranks {outside} but the cluster has {cluster.num_devices} devices")
    return cluster


def host_cores(data: dict, where: str) -> dict:
    """The ``CORE_KEYS`` a hardware or cluster YAML gives, checked: how its ranks share the cores."""
    out: dict = {}
    if data.get("shared_cores") is not None:
        out["shared_cores"] = require_number(data, "shared_cores", where, positive=True, integer=True)
    if "pinned_cores" in data:
        if not isinstance(data["pinned_cores"], bool):
            raise PulseError(f"{where}: 'pinned_cores' must be true or false, got {data['pinned_cores']!r}")
        out["pinned_cores"] = data["pinned_cores"]
    if "core_sharing" in data:
        value = require_number(data, "core_sharing", where, positive=True)
        if value > 1:
            raise PulseError(f"{where}: 'core_sharing' is the share of a core ranks sharing it keep, at most 1; "
                             f"got {value}")
        out["core_sharing"] = float(value)
    return out


def communicator_flags(data: dict, where: str) -> dict[str, bool]:
    """The ``COMMUNICATOR_KEYS`` a cluster YAML gives: what its communicator does (``pulse profile`` writes them)."""
    out = {}
    for key in COMMUNICATOR_KEYS:
        value = data.get(key, False)
        if not isinstance(value, bool):
            raise PulseError(f"{where}: '{key}' must be true or false, got {value!r}")
        out[key] = value
    return out


def require_list_or_empty(data: dict, key: str, where: str) -> list:
    if data.get(key) is None:
        return []
    if not isinstance(data[key], list):
        raise PulseError(f"{where}: '{key}' must be a list, got {type(data[key]).__name__}")
    return data[key]


def save_measured_cluster(cluster: Cluster, hardware_ref: str, path: str | Path) -> None:
    """A cluster YAML ``load_cluster`` reads back: the hardware by name or path, what was measured inline."""
    data = {"name": cluster.name, "hardware": hardware_ref, "nodes": cluster.nodes, "source": cluster.source,
            "shared_cores": cluster.hardware.shared_cores,
            "pinned_cores": None if cluster.hardware.shared_cores is None else cluster.hardware.pinned_cores,
            "core_sharing": None if cluster.hardware.core_sharing == 1.0 else cluster.hardware.core_sharing,
            "links": links_to_list(dict(cluster.links)),
            "allreduce": curves_to_list(cluster.allreduce),
            **{key: getattr(cluster, key) or None for key in COMMUNICATOR_KEYS}}
    write_atomic(Path(path), dump_yaml({k: v for k, v in data.items() if v not in (None, "", [])}))


def available(kind: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))


def _resolve(name_or_path: str, kind: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml", ".json"):
        return candidate
    path = CONFIG_DIR / kind / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(available(kind)) or "none"
        raise PulseError(f"unknown {kind} '{name_or_path}' (known: {known}); or pass a YAML path")
    return path
