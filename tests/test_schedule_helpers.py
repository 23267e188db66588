"""Small hand-made models, uniform costs and an ideal cluster for the schedule and sim tests."""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.hardware import Cluster, Hardware
from pulse.placement import Placement, from_cuts, interleaved_devices, wave_devices
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge


def unet(num_layers: int, *, out_bytes: int = 100, skip_bytes: int = 30, params: int = 10,
         shared: bool = False) -> ModelSpec:
    """A U with properly nested skips l_i -> l_{n-1-i} for every mirrored pair but the middle."""
    layers = [Layer(f"l{i}", "x", params, 1.0, out_bytes, 50) for i in range(num_layers)]
    skips = [SkipEdge(f"l{i}", f"l{num_layers - 1 - i}", skip_bytes + i) for i in range(num_layers // 2 - 1)]
    inputs = [SharedInput("temb", 4, "l0"), SharedInput("ctx", 8)] if shared else []
    return ModelSpec("u", layers, skips, inputs)


def uniform_costs(spec: ModelSpec, f: float = 1.0, b: float = 2.0, act: int = 7, mbs: int = 1) -> CostTable:
    n = spec.num_layers
    return CostTable(spec.name, mbs, tuple(l.name for l in spec.layers), (f,) * n, (b,) * n, (act,) * n, "test")


def cluster(devices: int = 8, bandwidth: float = 1e30, latency: float = 0.0) -> Cluster:
    """One node; the default is the ideal network (zero latency, unbounded bandwidth)."""
    hw = Hardware("ideal", 1e12, 1.0, 10**12, 1e12, bandwidth, latency, bandwidth, latency, devices)
    return Cluster("ideal", hw, 1)


def one_layer_chunks(kind: str, devices: list[int], num_devices: int, transport: str = "relay") -> Placement:
    """One layer per chunk: chunk i holds layer i (so costs per chunk equal costs per layer)."""
    return from_cuts(kind, list(range(len(devices) + 1)), devices, num_devices, transport, "test")


def sequential(p: int, transport: str = "relay") -> Placement:
    return one_layer_chunks("sequential", list(range(p)), p, transport)


def interleaved(p: int, v: int) -> Placement:
    return one_layer_chunks("interleaved", interleaved_devices(p, v), p)


def wave(p: int, folds: int = 1, transport: str = "direct") -> Placement:
    return one_layer_chunks("v" if folds == 1 else "wave", wave_devices(p, folds), p, transport)


def test_helpers_build_consistent_objects():
    spec = unet(8)
    for placement in (sequential(8), interleaved(4, 2), wave(4)):
        placement.validate(spec.num_layers)
    uniform_costs(spec).check_matches(spec)
