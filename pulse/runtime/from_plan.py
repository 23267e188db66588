"""One rank's executor from a ``Plan``: what a launcher (torchrun, msrun) calls on each process.

::

    plan, spec = load_plan(path, spec_loader)
    ex = executor_for_rank(plan, spec, rank, backend, comm, batches, loss_fn)
    for step in range(steps):
        ex.run_step(); ex.optimizer_step()

Ranks are laid out replica-major (rank = replica * pp + device), as in
``pulse_torch.dist.Layout`` and ``pulse.runtime.local``.
"""
from __future__ import annotations

from pulse.errors import PlanError
from pulse.plan import Plan
from pulse.runtime.executor import StageExecutor
from pulse.runtime.protocols import Backend, Batches, Communicator, LossFn
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec


def executor_for_rank(plan: Plan, spec: ModelSpec, rank: int, backend: Backend, comm: Communicator,
                      batches: Batches, loss_fn: LossFn | None, timeout: float | None = None) -> StageExecutor:
    if plan.schedule is None:
        raise PlanError("the plan has no schedule; run `pulse plan` with a schedule to make one")
    if not 0 <= rank < plan.world_size:
        raise PlanError(f"rank {rank} is outside the plan's {plan.pp} x {plan.dp} = {plan.world_size} ranks")
    plan.check_against(spec)
    replica, device = divmod(rank, plan.pp)
    schedule = lower(plan.schedule, spec, plan.placement)
    return StageExecutor(
        device=device, spec=spec, placement=plan.placement, schedule=schedule, backend=backend, comm=comm,
        batches=batches, loss_fn=loss_fn, timeout=timeout,
        pipeline_ranks=[replica * plan.pp + d for d in range(plan.pp)],
        dp_group=[r * plan.pp + device for r in range(plan.dp)] if plan.dp > 1 else [],
    )
