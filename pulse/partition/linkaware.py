"""The link-aware objective: a pair's cost is what its device spends per microbatch, links included.

The balance objective prices a V pair by its compute alone. On a slow link the
cuts themselves cost time: device j sends the activations and gradients of its
outer cut (to j-1) and of its inner cut (to j+1)::

    device j:   compute(pair)  +  message calls          on its thread
                bytes(outer cut) + bytes(inner cut)       on its link, meanwhile
    pair cost = max(compute + calls, link time)           the slower of the two bounds it

with bytes per sample x microbatch size / bandwidth, and per wire message the
link's send and receive overheads (``pulse.links.LinkCost``: what ``pulse
profile`` measured, or the hardware's figures). The chain DPs minimise the
largest pair cost exactly as they minimise the largest compute, so the V stays
exact under this objective; ``plan_symmetric`` then times both chains in the
simulator and keeps the faster, so a cheaper cut never loses to its estimate.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from pulse.hardware import Cluster
from pulse.links import LinkCost
from pulse.partition.chain import INF, ChainProblem

MESSAGES_PER_CUT = 2  # an activation one way, its gradient back, per microbatch


def slowest_neighbour_link(cluster: Cluster, num_devices: int) -> LinkCost:
    """The link a V relies on most pessimistically: the slowest between consecutive devices."""
    links = [cluster.link_cost(a, b) for a in range(num_devices) for b in (a - 1, a + 1) if 0 <= b < num_devices]
    if not links:
        return cluster.link_cost(0, 0) if num_devices == 1 else LinkCost(float("inf"), 0.0)
    return min(links, key=lambda l: (l.bandwidth, -l.message_overhead - l.send_overhead))


def link_aware_problem(problem: ChainProblem, cluster: Cluster, microbatch_size: int,
                       num_devices: int) -> ChainProblem:
    """``problem`` with each pair's time replaced by its device's per-microbatch cost."""
    link = slowest_neighbour_link(cluster, num_devices)
    outer = np.where(np.arange(problem.size) == 0, 0.0, problem.cut_bytes)  # cut 0 is the model's edge
    inner = np.where(problem.terminal, 0.0, problem.cut_bytes)
    # a cut moves its bytes per sample each way: activations one way, gradients back
    nbytes = (outer[:, None] + inner[None, :]) * microbatch_size
    cuts = (outer[:, None] > 0).astype(float) + (inner[None, :] > 0).astype(float)
    calls = cuts * MESSAGES_PER_CUT * (link.send_overhead + link.message_overhead)
    wire = nbytes / link.bandwidth if np.isfinite(link.bandwidth) else np.zeros_like(nbytes)
    cost = np.maximum(problem.pair_time + calls, wire)
    return replace(problem, pair_time=np.where(np.isfinite(problem.pair_time), cost, INF))
