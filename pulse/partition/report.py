"""What a placement costs: bytes per microbatch across devices and load per device.

Bytes come from ``pulse.traffic.summarize`` (the single source of truth) times
the microbatch size; backward moves the gradients of the same tensors back, so
its split equals the forward one. Loads come from the cost table.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition import partition
from pulse.placement import Placement
from pulse.spec import ModelSpec
from pulse.traffic import skips_leaving_device, summarize


@dataclass(frozen=True)
class ByteSplit:
    main: int  # main-path activations (or their gradients)
    skip: int  # relayed skips (relay transport) or directly sent skips (direct)
    shared: int  # shared inputs produced by a layer, riding the main path (direct: once per device)

    @property
    def total(self) -> int:
        return self.main + self.skip + self.shared


@dataclass(frozen=True)
class PartitionReport:
    model: str
    partitioner: str
    kind: str
    num_devices: int
    folds: int
    microbatch_size: int
    skip_transport: str
    forward: ByteSplit  # bytes per microbatch crossing devices, forward
    backward: ByteSplit  # the same tensors' gradients, backward
    messages: int  # forward messages per microbatch
    skips_leaving: tuple[str, ...]  # skip keys whose tensor leaves its device
    device_load: tuple[float, ...]  # seconds fwd+bwd per microbatch, per device

    @property
    def bytes_per_microbatch(self) -> int:
        return self.forward.total + self.backward.total

    @property
    def bottleneck(self) -> float:
        return max(self.device_load)

    @property
    def imbalance(self) -> float:
        """max / mean device load (1.0 = perfect balance)."""
        mean = sum(self.device_load) / len(self.device_load)
        return self.bottleneck / mean if mean > 0 else 1.0


def report(spec: ModelSpec, costs: CostTable, placement: Placement) -> PartitionReport:
    costs.check_matches(spec)
    placement.validate(spec.num_layers)
    mb = costs.microbatch_size
    traffic = summarize(spec, placement)
    split = ByteSplit(traffic.main_bytes * mb, traffic.skip_bytes * mb, traffic.shared_bytes * mb)
    load = [0.0] * placement.num_devices
    for chunk in placement.chunks:
        load[chunk.device] += costs.total(chunk.start, chunk.end)
    return PartitionReport(
        model=spec.name, partitioner=placement.partitioner, kind=placement.kind,
        num_devices=placement.num_devices, folds=placement.folds, microbatch_size=mb,
        skip_transport=placement.skip_transport, forward=split, backward=split,
        messages=traffic.messages, skips_leaving=tuple(skips_leaving_device(spec, placement)),
        device_load=tuple(load),
    )


@dataclass(frozen=True)
class ComparisonRow:
    name: str  # partitioner
    kind: str  # sequential / v / wave
    bytes_per_microbatch: int  # forward + backward
    reduction_vs_sequential: float  # 1 - bytes / sequential bytes
    bottleneck: float  # seconds per microbatch on the busiest device
    imbalance: float


def compare_placements(spec: ModelSpec, costs: CostTable,
                       placements: dict[str, Placement]) -> list[ComparisonRow]:
    """One row per placement; reductions are against the one named 'sequential'."""
    if "sequential" not in placements:
        raise PlanError("comparison needs a 'sequential' placement as the reference")
    reports = {name: report(spec, costs, p) for name, p in placements.items()}
    reference = reports["sequential"].bytes_per_microbatch
    return [
        ComparisonRow(name, r.kind, r.bytes_per_microbatch,
                      1 - r.bytes_per_microbatch / reference if reference else 0.0,
                      r.bottleneck, r.imbalance)
        for name, r in reports.items()
    ]


def compare(spec: ModelSpec, costs: CostTable, num_devices: int, *, folds: int = 1,
            cluster: Cluster | None = None) -> list[ComparisonRow]:
    """sequential, diffusionpipe (only with a cluster: it prices links) and pulse
    (with ``folds``) on one model and cost table."""
    names = ["sequential", "diffusionpipe", "pulse"] if cluster else ["sequential", "pulse"]
    placements = {name: partition(name, spec, costs, num_devices,
                                  folds=folds if name == "pulse" else 1, cluster=cluster)
                  for name in names}
    return compare_placements(spec, costs, placements)


def format_rows(rows: list[ComparisonRow]) -> str:
    lines = [f"{'partitioner':<14}{'kind':<11}{'MB/microbatch':>14}{'vs seq':>9}{'bottleneck ms':>15}{'imbal':>7}"]
    for r in rows:
        lines.append(f"{r.name:<14}{r.kind:<11}{r.bytes_per_microbatch / 1e6:>14.2f}"
                     f"{-r.reduction_vs_sequential:>+9.1%}{r.bottleneck * 1e3:>15.2f}{r.imbalance:>7.3f}")
    return "\n".join(lines)
