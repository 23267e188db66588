"""Data-parallel gradient all-reduce, priced on the links it really uses.

Ring all-reduce of ``n`` bytes over ``D`` replicas moves 2(D-1)/D * n bytes
through every member's slowest link, in 2(D-1) latency-bound steps. Replicas of
one pipeline stage sit ``pp`` ranks apart (rank = replica * pp + stage): inside
a node when pp * D fits in it, across nodes otherwise, where a hierarchical
ring (reduce-scatter inside the node, all-reduce across, all-gather inside)
is what NCCL and HCCL do.
"""
from __future__ import annotations

from pulse.hardware import Cluster


def replica_devices(stage: int, pp: int, dp: int) -> list[int]:
    return [replica * pp + stage for replica in range(dp)]


def ring_allreduce_time(nbytes: float, devices: list[int], cluster: Cluster) -> float:
    """Seconds to all-reduce ``nbytes`` across ``devices`` (global device ids)."""
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
    # hierarchical: intra-node reduce-scatter + all-gather on 1/local of the data,
    # inter-node ring on the shard each device owns
    inside = _ring(nbytes, local, hw.intra_node_bandwidth, hw.intra_node_latency)
    across = _ring(nbytes / local, nodes, hw.inter_node_bandwidth, hw.inter_node_latency)
    return inside + across


def _ring(nbytes: float, members: int, bandwidth: float, latency: float) -> float:
    if members <= 1:
        return 0.0
    steps = 2 * (members - 1)
    return steps * latency + steps / members * nbytes / bandwidth
