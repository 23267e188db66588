"""The compute floor: the step if every device computed its equal share, with no bubble and no
exposed communication, and how far a simulated step is above it.

::

    floor = (M x sum over layers of (forward + backward) + optimizer over every layer) / pp

per replica (data-parallel replicas split the global batch, so each device's share is its
replica's divided by pp). The backward counts its weight gradients (split or not: the
cheaper of the whole backward and B + W). Each column is taken at its least over every way
of cutting the layers into chunks: a table's per-action cost (``CostTable.per_action``) is
paid once per chunk, so one chunk per column (or one per layer, where that figure is
negative) is the least any placement can pay. Cold starts, the batch's per-device copy,
recomputation and the encoders are left out: they are costs of a placement and a schedule,
not of the work. So the floor is at most every placement's busiest device's compute plus its
optimizer step, and at most the simulated step (``pulse.sim.step``: the slowest list, then
the slowest optimizer step).
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.costs import CostTable


@dataclass(frozen=True)
class FloorDistance:
    """A step beside its compute floor (seconds)."""

    floor: float
    step: float

    @property
    def ratio(self) -> float:
        return self.step / self.floor if self.floor > 0 else float("inf")

    @property
    def above(self) -> float:
        return self.step - self.floor

    def text(self) -> str:
        """``compute floor 8.10 ms: step 1.23x of it (+1.86 ms)`` for the CLIs."""
        return (f"compute floor {self.floor * 1e3:.2f} ms: step {self.ratio:.3f}x of it "
                f"(+{self.above * 1e3:.2f} ms: bubble, imbalance, exposed communication)")


def _least(costs: CostTable, chunk_seconds, first: int = 0) -> float:
    """The least of ``chunk_seconds`` over layers ``first``.. as one chunk and as one chunk per layer: a
    per-action cost makes the total linear in the number of chunks, so one of the two ends is least."""
    n = len(costs.layer_names)
    if first >= n:
        return 0.0
    return min(chunk_seconds(first, n), sum(chunk_seconds(i, i + 1) for i in range(first, n)))


def microbatch_compute(costs: CostTable) -> float:
    """Seconds of one microbatch's forward and backward (weight gradients included) over every layer.
    A split backward's input half skips the first layer (``CostTable.split_backward``: the model's
    inputs need no gradient)."""
    forward = _least(costs, lambda a, b: costs.span(a, b)[0])
    whole = _least(costs, lambda a, b: costs.span(a, b)[1])
    split = _least(costs, costs.input_backward, first=1) + _least(costs, costs.weight_backward)
    return forward + min(whole, split)


def compute_floor(costs: CostTable, pp: int, num_microbatches: int) -> float:
    """Seconds of the step each of ``pp`` pipeline devices would take with an equal share of the
    replica's work (module docstring)."""
    optimizer = _least(costs, costs.optimizer_seconds) if costs.optimizer else 0.0
    return (num_microbatches * microbatch_compute(costs) + optimizer) / pp


def floor_distance(costs: CostTable, pp: int, num_microbatches: int, step: float) -> FloorDistance:
    return FloorDistance(compute_floor(costs, pp, num_microbatches), step)
