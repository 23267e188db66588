"""Accelerator and cluster descriptions (data under configs/hardware and configs/clusters)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pulse.errors import PulseError
from pulse.yamlio import check_keys, load_mapping, require_number

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
    check_keys(data, {"name", *_HW_NUMBERS}, {"sources", "notes"}, where)
    values = {}
    for key, positive in _HW_NUMBERS.items():
        integer = key in ("memory_bytes", "devices_per_node")
        values[key] = require_number(data, key, where, positive=positive, integer=integer)
    if values["efficiency"] > 1:
        raise PulseError(f"{where}: 'efficiency' is a fraction of peak and must be <= 1")
    return Hardware(name=str(data["name"]), sources=dict(data.get("sources") or {}), **values)


def load_hardware(name_or_path: str) -> Hardware:
    path = _resolve(name_or_path, "hardware")
    return hardware_from_dict(load_mapping(path), str(path))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster YAML (hardware + nodes), or a bare hardware name meaning one node."""
    try:
        path = _resolve(name_or_path, "clusters")
    except PulseError:
        return Cluster(name=name_or_path, hardware=load_hardware(name_or_path), nodes=1)
    data = load_mapping(path)
    check_keys(data, {"name", "hardware", "nodes"}, {"notes"}, str(path))
    nodes = require_number(data, "nodes", str(path), positive=True, integer=True)
    return Cluster(name=str(data["name"]), hardware=load_hardware(str(data["hardware"])), nodes=nodes)


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
