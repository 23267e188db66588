"""All-reduce time on the links it really uses: measured when the cluster was profiled, else a ring.

Ring all-reduce of ``n`` bytes over ``D`` members moves 2(D-1)/D * n bytes
through every member's slowest link, in 2(D-1) latency-bound steps. Across
nodes, NCCL and HCCL run a hierarchical ring (reduce-scatter inside the node,
all-reduce across, all-gather inside). A measured cluster (``pulse profile``)
carries all-reduce time per size for its group sizes; that curve wins.
"""
from __future__ import annotations

from pulse.hardware import Cluster
from pulse.layout import Layout


def replica_devices(stage: int, pp: int, dp: int) -> list[int]:
    """Global ranks holding pipeline device ``stage`` in every replica (rank = replica * pp + stage)."""
    return Layout(pp, dp).stage_ranks(stage)


def allreduce_seconds(nbytes: float, devices: list[int], cluster: Cluster) -> float:
    """Seconds to all-reduce ``nbytes`` across ``devices`` (global ranks)."""
    if len(devices) <= 1:
        return 0.0
    measured = cluster.allreduce_seconds(nbytes, len(devices))
    return float(measured) if measured is not None else ring_allreduce_time(nbytes, devices, cluster)


def ring_allreduce_time(nbytes: float, devices: list[int], cluster: Cluster) -> float:
    """Seconds of a (hierarchical) ring all-reduce of ``nbytes`` across ``devices``."""
    count = len(devices)
    if count <= 1 or nbytes <= 0:
        return 0.0
    hw = cluster.hardware
    per_node: dict[int, int] = {}
    for device in devices:
        per_node[device // hw.devices_per_node] = per_node.get(device // hw.devices_per_node, 0) + 1
    nodes = len(per_node)
    local = max(per_node.values())
    if nodes == 1:
        return _ring(nbytes, count, hw.intra_node_bandwidth, hw.intra_node_latency)
    inside = _ring(nbytes, local, hw.intra_node_bandwidth, hw.intra_node_latency)
    across = _ring(nbytes / local, nodes, hw.inter_node_bandwidth, hw.inter_node_latency)
    return inside + across


def _ring(nbytes: float, members: int, bandwidth: float, latency: float) -> float:
    if members <= 1:
        return 0.0
    steps = 2 * (members - 1)
    return steps * latency + steps / members * nbytes / bandwidth
