"""DiffusionPipe-style sequential partition: balance compute *and* communication.

Same contiguous stages and relayed skips as ``sequential``, but a stage's cost
is what its device spends per microbatch without overlap::

    cost(stage p = layers [s, e)) = fwd+bwd(s..e)
                                  + send(p -> p+1, payload(e))   activations forward
                                  + send(p -> p-1, payload(s))   gradients backward

where payload(x) is the main-path tensor, every skip spanning boundary x
(relayed) and the shared inputs produced before x, times the microbatch size,
priced on the cluster link between the two devices (intra- or inter-node).
The DP is exact over (stage, end layer), ties broken towards the most even
split as in ``sequential``. Because skips that span a boundary are paid there,
the DP shifts cuts towards boundaries that fewer or smaller skips span, which
is the skip-aware baseline PULSE is measured against.
"""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.common import boundary_loads, check_chunks, check_request, prefix_times
from pulse.partition.sequential import balanced_cuts
from pulse.placement import Placement, from_cuts
from pulse.spec import ModelSpec


def send_times(spec: ModelSpec, costs: CostTable, cluster: Cluster, num_devices: int,
               devices: list[int] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """(forward[p][x], backward[p][x]): seconds for stage p to send boundary x's payload
    to stage p+1 (activations) or p-1 (gradients); 0 where there is no such neighbour.
    ``devices[p]`` is stage p's device (default: stage p on device p)."""
    mb = costs.microbatch_size
    loads = boundary_loads(spec, relay=True)
    n = spec.num_layers
    dev = list(range(num_devices)) if devices is None else devices
    stages = len(dev)
    fwd = [[0.0] * (n + 1) for _ in range(stages)]
    bwd = [[0.0] * (n + 1) for _ in range(stages)]
    for p in range(stages):
        for x in range(1, n):
            nbytes = loads[x].total * mb
            if p + 1 < stages:
                fwd[p][x] = cluster.transfer_time(dev[p], dev[p + 1], nbytes)
            if p > 0:
                bwd[p][x] = cluster.transfer_time(dev[p], dev[p - 1], nbytes)
    return fwd, bwd


def diffusionpipe_placement(spec: ModelSpec, costs: CostTable, num_devices: int, *, folds: int = 1,
                  cluster: Cluster | None = None) -> Placement:
    """Contiguous stages minimising the bottleneck of compute plus boundary sends."""
    if folds != 1:
        raise PlanError("the diffusionpipe partitioner has no folds: use folds=1 (or the pulse partitioner)")
    if cluster is None:
        raise PlanError("the diffusionpipe partitioner prices communication: pass a cluster "
                        "(e.g. --cluster ascend-910a)")
    check_request(spec, costs, num_devices, folds)
    check_chunks(spec, num_devices, 1, "sequential stages")
    prefix = prefix_times(costs)
    fwd, bwd = send_times(spec, costs, cluster, num_devices)

    def stage_cost(p: int, s: int, e: int) -> float:
        return prefix[e] - prefix[s] + fwd[p][e] + bwd[p][s]

    _, cuts = balanced_cuts(spec.num_layers, num_devices, stage_cost)
    return from_cuts("sequential", cuts, list(range(num_devices)), num_devices, "relay", "diffusionpipe")
