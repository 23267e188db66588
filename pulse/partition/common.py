"""Checks and numbers every partitioner shares: request validation, prefix
sums of layer time, and the bytes crossing each layer boundary.

Boundary ``x`` is the gap before layer ``x`` (1 <= x < L). What crosses it when
a device boundary falls there is decided by ``pulse.traffic``; the per-boundary
loads here are the same rule written as a table, so the DPs can price a cut
without building a placement (a test checks they agree with traffic.summarize).
Under relay transport every crossed boundary pays ``shared``; under direct
transport a produced shared input reaches each device once, which
``chain.build_problem`` prices per chain rather than per boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.spec import ModelSpec


@dataclass(frozen=True)
class BoundaryLoad:
    """Forward bytes per sample crossing one layer boundary."""

    main: int
    skip: int  # relayed skips spanning the boundary (0 under direct transport)
    shared: int  # shared inputs already produced (relay: riding every crossing; direct: see above)

    @property
    def total(self) -> int:
        return self.main + self.skip + self.shared


def check_request(spec: ModelSpec, costs: CostTable, num_devices: int, folds: int) -> None:
    """Raise PlanError (one line) on a cost table of another model or a bad count."""
    costs.check_matches(spec)
    if num_devices < 1:
        raise PlanError(f"the number of pipeline devices must be >= 1, got {num_devices}")
    if folds < 1:
        raise PlanError(f"folds must be >= 1, got {folds}")


def check_chunks(spec: ModelSpec, num_devices: int, chunks_per_device: int, placement: str,
                 most: int | None = None) -> None:
    """Raise PlanError unless the model has a layer for every chunk; ``most`` is the
    largest device count the caller knows to work (default: layers // chunks per device)."""
    chunks = num_devices * chunks_per_device
    if chunks > spec.num_layers:
        most = spec.num_layers // chunks_per_device if most is None else most
        advice = f"use --pp <= {most}" if most else "use fewer folds or the sequential partitioner"
        raise PlanError(
            f"{spec.name} has {spec.num_layers} layers, too few for {chunks} chunks "
            f"({placement} over {num_devices} devices): {advice}")


def prefix_times(costs: CostTable) -> list[float]:
    """prefix[i] = forward + backward seconds of layers [0, i)."""
    return [0.0, *accumulate(f + b for f, b in zip(costs.fwd, costs.bwd))]


def boundary_loads(spec: ModelSpec, relay: bool) -> tuple[BoundaryLoad, ...]:
    """Load of boundary x for x in 0..L (entries 0 and L are empty: no layer gap)."""
    n = spec.num_layers
    spans = spec.skip_spans()
    made = [spec.index(s.producer) for s in spec.shared_inputs if s.producer is not None]
    made_bytes = [s.bytes for s in spec.shared_inputs if s.producer is not None]
    loads = [BoundaryLoad(0, 0, 0)]
    for x in range(1, n):
        skip = sum(e.bytes for s, t, e in spans if s < x <= t) if relay else 0
        shared = sum(b for p, b in zip(made, made_bytes) if p < x)
        loads.append(BoundaryLoad(spec.layers[x - 1].out_bytes, skip, shared))
    loads.append(BoundaryLoad(0, 0, 0))
    return tuple(loads)
