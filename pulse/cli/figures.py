"""A tuner candidate's figures under the names of ``pulse.sim.figures`` (what `pulse tune` reports)."""
from __future__ import annotations

from pulse.tune.evaluate import Evaluation


def evaluation_figures(e: Evaluation, budget: int) -> dict:
    """A tuner candidate: what it is, then the same figures as ``pulse.sim.figures.sim_figures``."""
    c = e.candidate
    return {
        "label": c.label, "strategy": c.strategy, "partitioner": c.partitioner, "pp": c.pp, "dp": c.dp,
        "microbatch_size": c.microbatch_size, "num_microbatches": c.num_microbatches, "folds": c.folds,
        "schedule": c.schedule, "inflight_cap": c.inflight_cap, "recompute": list(c.recompute),
        "step_seconds": e.iteration_time,
        "pipeline_seconds": e.pipeline_time,
        "bubble_ratio": e.bubble_ratio,
        "peak_memory_bytes": e.peak_memory,
        "memory_budget_bytes": budget,
        "fits_memory": e.fits,
        "pipeline_bytes_per_step": e.p2p_bytes_per_iteration,
        "allreduce_bytes_per_step": e.bytes_per_iteration - e.p2p_bytes_per_iteration,
        "samples_per_second": e.samples_per_s,
        **({"encoders": c.encoders} if c.encoders != "cached" else {}),
        **({"step_breakdown_seconds": e.breakdown.parts()} if e.breakdown is not None else {}),
        **({"fitted_layers": {"num_layers": e.fitted.spec.num_layers, **e.fitted.plan_options}}
           if e.fitted is not None else {}),
    }
