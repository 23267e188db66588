"""Partitioners: pure functions from (ModelSpec, CostTable[, Cluster]) to a Placement.

=============  ===========================================  ===============
name           what it minimises                             skips
=============  ===========================================  ===============
sequential     max stage fwd+bwd time (torchgpipe-style)     relayed
diffusionpipe  max stage time incl. its boundary sends       relayed
pulse          max device time, then bytes (V / wave folds)  kept local
=============  ===========================================  ===============
"""
from __future__ import annotations

from typing import Callable

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.diffusionpipe import diffusionpipe_placement
from pulse.partition.sequential import sequential_placement
from pulse.partition.symmetric import SymmetricPlan, plan_symmetric, pulse_placement
from pulse.placement import Placement
from pulse.spec import ModelSpec

Partitioner = Callable[..., Placement]  # (spec, costs, num_devices, *, folds, cluster)

PARTITIONERS: dict[str, Partitioner] = {
    "sequential": sequential_placement,
    "diffusionpipe": diffusionpipe_placement,
    "pulse": pulse_placement,
}


def partition(name: str, spec: ModelSpec, costs: CostTable, num_devices: int, *,
              folds: int = 1, cluster: Cluster | None = None) -> Placement:
    """Run the partitioner called ``name``; the placement is validated before it is returned."""
    try:
        partitioner = PARTITIONERS[name]
    except KeyError:
        raise PlanError(f"unknown partitioner '{name}' (known: {', '.join(PARTITIONERS)})") from None
    placement = partitioner(spec, costs, num_devices, folds=folds, cluster=cluster)
    placement.validate(spec.num_layers)
    return placement


__all__ = ["PARTITIONERS", "Partitioner", "SymmetricPlan", "partition", "plan_symmetric",
           "sequential_placement", "diffusionpipe_placement", "pulse_placement"]
