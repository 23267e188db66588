"""`--partitioner auto`: the fastest placement at the job's shape, PULSE's V or a sequential one.

``--schedule auto`` chooses a schedule for one placement; this chooses the placement first, at the
pp, dp, microbatch size and count the job asked for (the tuner searches those too; this does not)::

    V            the planner's own V / wave (its priced cuts), with each V schedule (and in-flight cap)
    sequential   the tuner's sequential and interleaved shapes at this pp (one chunk per device: 1F1B,
                 GPipe, the list schedules incl. zero-bubble; two: interleaved 1F1B, GPipe, the list
                 schedules), the balanced and DiffusionPipe cuts, skips relayed or sent direct
    winner       the fastest simulated step (``pulse.tune.evaluate``: the whole step) that fits memory

On a fast link the V's collocated skips save little and a sequential shape's balance can win; on a
slow one the V's fewer bytes do. Which won, and by how much, is said in one line (``PlacementChoice.line``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.generators import OnLinks
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec
from pulse.tune.evaluate import Evaluation, place, safe_evaluate
from pulse.tune.space import Candidate, shapes_at


@dataclass(frozen=True)
class Shape:
    """The job's shape: pipeline devices, replicas, microbatch size and count, the V's folds."""

    pp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    folds: int = 1


@dataclass(frozen=True)
class PlacementChoice:
    winner: Evaluation
    best_v: Evaluation | None  # the fastest fitting V / wave
    best_sequential: Evaluation | None  # the fastest fitting sequential or interleaved shape

    @property
    def is_v(self) -> bool:
        return self.winner.candidate.folds > 0

    def line(self) -> str:
        """``placement auto: sequential int2 interleaved_1f1b, 41.20 ms a step in simulation; the best V placement
        (pulse V zero_bubble_v) 43.00 ms, 1.04x the sequential's step``."""
        other = self.best_sequential if self.is_v else self.best_v
        kind = "V" if self.is_v else "sequential"
        step = self.winner.iteration_time * 1e3
        head = f"placement auto: {describe(self.winner)}, {step:.2f} ms a step in simulation"
        if other is None:
            return f"{head}; no {'sequential' if self.is_v else 'V'} placement fits or can be built at this shape"
        ratio = other.iteration_time / self.winner.iteration_time
        return (f"{head}; the best {'sequential' if self.is_v else 'V'} placement ({describe(other)}) "
                f"{other.iteration_time * 1e3:.2f} ms, {ratio:.2f}x the {kind}'s step")


def describe(e: Evaluation) -> str:
    c = e.candidate
    cap = f" cap {c.inflight_cap}" if c.inflight_cap is not None else ""
    return f"{c.partitioner} {c.shape} {c.schedule}{cap}"


def contenders(shape: Shape) -> tuple[list[Candidate], list[Candidate]]:
    """(V candidates, sequential candidates) at ``shape``, as the tuner enumerates them."""
    everything = shapes_at(shape.pp, shape.dp, shape.microbatch_size, shape.num_microbatches, (shape.folds,))
    return [c for c in everything if c.folds], [c for c in everything if not c.folds]


def choose_placement_auto(spec: ModelSpec, costs: CostTable, cluster: Cluster, shape: Shape,
                          v_placement: Placement | None, memory: MemoryModel, budget: int,
                          schedule: str | None = None) -> PlacementChoice:
    """The fastest fitting placement at ``shape``: ``v_placement`` (the planner's V; None: none can be
    built) with each V schedule, or one of the tuner's sequential shapes (module docstring); ``schedule``:
    only candidates with that schedule. PlanError when nothing fits."""
    links = OnLinks(spec, cluster)
    v_shapes, sequential = contenders(shape)
    if schedule is not None:
        v_shapes = [c for c in v_shapes if c.schedule == schedule]
        sequential = [c for c in sequential if c.schedule == schedule]
    priced = [safe_evaluate(spec, costs, cluster, c, budget, memory, placement=v_placement, links=links)
              for c in (v_shapes if v_placement is not None else [])]
    placements: dict[tuple, Placement | str] = {}
    for c in sequential:
        key = (c.partitioner, c.virtual)
        if key not in placements:
            try:
                placements[key] = place(spec, costs, cluster, replace(c, skip_transport="relay"))
            except PlanError as exc:
                placements[key] = str(exc)
        base = placements[key]
        if isinstance(base, str):
            continue
        priced.append(safe_evaluate(spec, costs, cluster, c, budget, memory,
                                    placement=replace(base, skip_transport=c.skip_transport), links=links))
    fitting = [e for e in priced if not isinstance(e, str) and e.fits]
    if not fitting:
        which = f" runs {schedule} and" if schedule else ""
        raise PlanError(f"--partitioner auto: no placement at pp {shape.pp}, microbatch size {shape.microbatch_size}"
                        f"{which} fits {budget / 2**30:.2f} GiB per device; raise --pp, lower --microbatch-size, or "
                        "name the partitioner")
    return PlacementChoice(_fastest(fitting), _fastest(e for e in fitting if e.candidate.folds),
                           _fastest(e for e in fitting if not e.candidate.folds))


def _fastest(evaluations) -> Evaluation | None:
    return min(evaluations, key=lambda e: e.iteration_time, default=None)


__all__ = ["PlacementChoice", "Shape", "choose_placement_auto", "contenders"]
