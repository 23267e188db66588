"""One name per predicted quantity, for every command's JSON, ``Plan.predicted`` and the planner
(``pulse.planner.predict``).

    step_seconds              the whole training step (pulse.sim.step: pipeline, exposed
                              all-reduce, clipping and report syncs, optimizer)
    pipeline_seconds          the schedule's makespan alone
    bubble_ratio              idle share of the pipeline devices during the makespan
    peak_memory_bytes         the worst device's simulated peak
    peak_memory_bytes_per_device  every pipeline device's (log.json sets the measured ones beside them)
    memory_budget_bytes       the budget it was held against (None: none)
    fits_memory               peak_memory_bytes <= memory_budget_bytes
    pipeline_bytes_per_step   point-to-point bytes of one step, every replica
    allreduce_bytes_per_step  data-parallel all-reduce bytes of one step, every replica
    samples_per_second        global batch / step_seconds
    step_breakdown_seconds    where the step goes (pulse.sim.breakdown): compute, bubble,
                              imbalance, exposed_p2p, exposed_allreduce; they sum to
                              step_seconds (`pulse simulate`: the chosen schedule; `pulse tune`:
                              each strategy's best, the winner among them)

`pulse plan` (no simulation) reports the partition's own figures under their own
names (``bytes_per_microbatch``, ``bottleneck_seconds_per_microbatch``, ``imbalance``).
"""
from __future__ import annotations

from pulse.sim.result import SimResult
from pulse.sim.step import StepTime


def sim_figures(result: SimResult, step: StepTime, dp: int, batch: int | None = None) -> dict:
    """The figures of one simulated schedule; ``batch``: samples per step, all replicas."""
    out = {
        "step_seconds": step.total,
        "pipeline_seconds": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "peak_memory_bytes": max(result.peak_memory),
        "peak_memory_bytes_per_device": list(result.peak_memory),
        "memory_budget_bytes": result.memory_budget,
        "fits_memory": result.fits_memory,
        "pipeline_bytes_per_step": result.total_link_bytes * dp,
        "allreduce_bytes_per_step": step.allreduce_bytes(dp),
    }
    if batch is not None:
        out["samples_per_second"] = batch / step.total
    return out
