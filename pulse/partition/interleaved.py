"""Interleaved placements for the sequential baselines (Megatron's virtual stages).

::

    P = 4, v = 2     chunk: 0 1 2 3 4 5 6 7     device: 0 1 2 3 0 1 2 3

The layers are cut into v * P contiguous chunks, chunk c on device c % P, skips
relayed as in ``sequential``. Cuts minimise the largest chunk (fwd + bwd) with
the same exact DP; with ``cluster`` they also pay each chunk's boundary sends
to its neighbours' devices, as ``diffusionpipe`` does for one chunk per device.
Interleaved 1F1B needs this shape; the list schedules run on it too, so the
tuner can offer each baseline strategy every schedule the runtime executes.
"""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.common import check_chunks, check_request, prefix_times
from pulse.partition.diffusionpipe import send_times
from pulse.partition.sequential import balanced_cuts
from pulse.placement import Placement, from_cuts, interleaved_devices
from pulse.spec import ModelSpec

BASES = ("sequential", "diffusionpipe")


def interleaved_placement(spec: ModelSpec, costs: CostTable, num_devices: int, *, virtual: int = 2,
                          base: str = "sequential", cluster: Cluster | None = None) -> Placement:
    """``virtual`` chunks per device, round robin; ``base`` says how chunks are balanced."""
    if base not in BASES:
        raise PlanError(f"interleaved placements build on {' or '.join(BASES)}, not '{base}'")
    if virtual < 2:
        raise PlanError(f"an interleaved placement needs at least 2 chunks per device, got {virtual}")
    if base == "diffusionpipe" and cluster is None:
        raise PlanError("the diffusionpipe partitioner prices communication: pass a cluster")
    check_request(spec, costs, num_devices, 1)
    check_chunks(spec, num_devices, virtual, f"interleaved stages ({virtual} per device)")
    devices = interleaved_devices(num_devices, virtual)
    prefix = prefix_times(costs)
    if base == "sequential":
        def cost(c: int, s: int, e: int) -> float:
            return prefix[e] - prefix[s]
    else:
        fwd, bwd = send_times(spec, costs, cluster, num_devices, devices)

        def cost(c: int, s: int, e: int) -> float:
            return prefix[e] - prefix[s] + fwd[c][e] + bwd[c][s]
    _, cuts = balanced_cuts(spec.num_layers, len(devices), cost)
    return from_cuts("interleaved", cuts, devices, num_devices, "relay", base)
