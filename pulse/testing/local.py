"""A whole plan in one process: executors for every rank on one ``FakeNetwork``.

Global ranks are laid out replica-major (PyTorch's usual PP x DP layout)::

    rank = replica * pp + device        dp_group(device) = [device, pp + device, ...]

Used by the tests of every backend: build once, ``step()``, compare gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pulse.encoders import EncoderSet
from pulse.placement import Placement
from pulse.layout import Layout
from pulse.runtime.executor import StageExecutor, StepStats
from pulse.testing.fake_comm import FakeNetwork, run_all_ranks
from pulse.testing.fake_rendezvous import RendezvousRules
from pulse.runtime.protocols import Backend, Batches, LossFn, Tensor
from pulse.runtime.wiring import Wiring
from pulse.schedule.ir import Schedule
from pulse.spec import ModelSpec


@dataclass
class LocalRun:
    network: FakeNetwork
    executors: list[StageExecutor]
    pp: int
    dp: int

    def step(self, zero_grad: bool = True, optimize: bool = False) -> dict[int, StepStats]:
        stats = run_all_ranks(self.executors, zero_grad)
        if optimize:
            for ex in self.executors:
                ex.optimizer_step()
        return stats

    def replica(self, r: int) -> list[StageExecutor]:
        return self.executors[r * self.pp:(r + 1) * self.pp]

    def gradients(self, replica: int = 0) -> dict[str, Tensor]:
        """Every parameter gradient of one pipeline replica, by parameter name."""
        return {n: g for ex in self.replica(replica) for n, g in ex.gradients().items()}

    def loss(self, replica: int = 0) -> float | None:
        losses = [ex.stats.loss for ex in self.replica(replica) if ex.stats.loss is not None]
        return losses[0] if losses else None


def local_run(spec: ModelSpec, placement: Placement, schedule: Schedule, backend: Backend,
              batches: Batches | Sequence[Batches], loss_fn: LossFn, dp: int = 1,
              overlap_dp: bool = False, encoders: EncoderSet | None = None,
              rendezvous: RendezvousRules | None = None) -> LocalRun:
    """Executors for ``dp`` replicas of the pipeline; ``batches`` may give one provider per replica.

    ``overlap_dp``: data-parallel gradients in buckets of whole layers launched during the
    backward (what real launchers run) instead of one parameter at a time after it.
    ``rendezvous``: messages move as on NCCL / HCCL (``pulse.testing.fake_rendezvous``)."""
    pp = placement.num_devices
    providers = list(batches) if isinstance(batches, (list, tuple)) else [batches] * dp
    network = FakeNetwork(pp * dp, backend, rendezvous)
    wiring = Wiring(spec, placement)
    executors = []
    for r in range(dp):
        ranks = Layout(pp, dp).replica_ranks(r)
        for d in range(pp):
            executors.append(StageExecutor(
                device=d, spec=spec, placement=placement, schedule=schedule, backend=backend,
                comm=network.communicator(ranks[d]), batches=providers[r], loss_fn=loss_fn,
                pipeline_ranks=ranks, dp_group=Layout(pp, dp).stage_ranks(d) if dp > 1 else [],
                wiring=wiring, overlap_dp=overlap_dp, encoders=encoders))
    return LocalRun(network, executors, pp, dp)
