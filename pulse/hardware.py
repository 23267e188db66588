"""Accelerator and cluster descriptions (data under configs/hardware and configs/clusters)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pulse.errors import PulseError
from pulse.yamlio import check_keys, load_mapping, require_mapping, require_number, require_text

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

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    hardware: Hardware
    nodes: int = 1

    @property
    def num_devices(self) -> int:
        return self.nodes * self.hardware.devices_per_node

    def same_node(self, a: int, b: int) -> bool:
        per = self.hardware.devices_per_node
        return a // per == b // per

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between global devices a and b."""
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
    check_keys(data, {"name", *_HW_NUMBERS}, {"sources", "notes"}, where)
    name = require_text(data, "name", where)
    values = {}
    for key, positive in _HW_NUMBERS.items():
        integer = key in ("memory_bytes", "devices_per_node")
        values[key] = require_number(data, key, where, positive=positive, integer=integer)
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
    check_keys(data, {"name", "hardware", "nodes"}, {"notes"}, where)
    name = require_text(data, "name", where)
    nodes = require_number(data, "nodes", where, positive=True, integer=True)
    if data.get("notes") is not None and not isinstance(data["notes"], str):
        raise PulseError(f"{where}: 'notes' must be text, got {type(data['notes']).__name__}")
    hardware_name = require_text(data, "hardware", where)
    try:
        hardware = load_hardware(hardware_name)
    except PulseError as exc:
        raise PulseError(f"{where}: 'hardware': {exc}") from None
    return Cluster(name=name, hardware=hardware, nodes=nodes)


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
