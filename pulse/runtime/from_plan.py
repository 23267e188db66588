"""One rank's executor from a ``Plan``: what a launcher (torchrun, msrun) calls on each process.

::

    plan, spec = load_plan(path, spec_loader)
    ex = executor_for_rank(plan, spec, rank, backend, comm, batches, loss_fn)
    for step in range(steps):
        ex.run_step(); ex.optimizer_step()

Ranks are laid out as ``pulse.layout.Layout`` says.
"""
from __future__ import annotations

from pulse.errors import PlanError
from pulse.grad_buckets import BUCKET_CAP_BYTES
from pulse.plan import Plan
from pulse.runtime.executor import StageExecutor
from pulse.layout import Layout
from pulse.runtime.protocols import Backend, Batches, Communicator, LossFn
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec


def executor_for_rank(plan: Plan, spec: ModelSpec, rank: int, backend: Backend, comm: Communicator,
                      batches: Batches, loss_fn: LossFn | None, timeout: float | None = None,
                      overlap_dp: bool = False, bucket_cap: int = BUCKET_CAP_BYTES) -> StageExecutor:
    """``overlap_dp``: data-parallel gradients in buckets of whole layers, launched during the backward
    (``pulse.runtime.grad_sync``: what the launchers run and the simulator prices), ``bucket_cap`` bytes each."""
    if plan.schedule is None:
        raise PlanError("the plan has no schedule; write one with `pulse simulate --plan FILE --out FILE` or `pulse train --plan-only`")
    if not 0 <= rank < plan.world_size:
        raise PlanError(f"rank {rank} is outside the plan's {plan.pp} x {plan.dp} = {plan.world_size} ranks")
    plan.check_against(spec)
    layout = Layout(plan.pp, plan.dp, rank)
    encoders = plan.encoders if plan.encoders is not None and plan.encoders.active else None
    schedule = lower(plan.schedule, spec, plan.placement, encoders)
    return StageExecutor(
        device=layout.stage, spec=spec, placement=plan.placement, schedule=schedule, backend=backend, comm=comm,
        batches=batches, loss_fn=loss_fn, timeout=timeout,
        pipeline_ranks=layout.pp_ranks(), dp_group=layout.dp_ranks() if plan.dp > 1 else [], overlap_dp=overlap_dp,
        encoders=encoders, bucket_cap=bucket_cap,
    )
