"""A forward-only pass of a lowered program: the loss of fixed batches through the pipeline, no training.

::

    training program (one rank):  0F0  0SF0:1  0F1  0SF1:1  0RB0:1  0B0  0AR0  0FREE0  ...
    forward_only(program):        0F0  0SF0:1  0F1  0SF1:1                              ...
                                  (F and its messages, in the program's own order: no B, W, SB/RB,
                                   AR or FREE; no gradient, no optimizer step)

Each rank keeps its F/SF/RF in the training program's order, so the forward-only
lists cannot deadlock where the program does not: every wait that is left (an RF)
waited on the same send before. ``ForwardOnlyExecutor`` runs such a list with the
training executor's chunks, wiring and communicator: a chunk's forward context is
dropped as soon as it is made (its autograd graph with it; a backend that offers
``no_grad()`` runs the pass under it), a skip value when its consumer has read it,
the loss is recorded and no gradient made. The chunks' weights and gradients are
left as they were. A communicator that matches messages by order (NCCL, HCCL) is
told the forward-only order for the pass and the training order again after it
(``run_pass``). Plans whose frozen encoders run in the pipeline (E/SE/RE) are
refused: their encodes prefetch the next training step.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.runtime.executor import Slot, StageExecutor, StepStats
from pulse.runtime.message_order import inbound_order
from pulse.runtime.protocols import Batches, Tensor
from pulse.runtime.skip_cache import SkipCache
from pulse.runtime.wiring import MAIN
from pulse.schedule.ir import Action, Schedule

FORWARD_KINDS = frozenset({"F", "SF", "RF"})


def forward_only(program: Schedule) -> Schedule:
    """``program``'s forwards and their sends and receives, each rank's in its own order."""
    if program.has_encodes:
        raise PlanError(f"schedule '{program.name}' runs frozen encoders in the pipeline (E/SE/RE): a forward-only "
                        "pass of it is not supported; plan with --encoders cached (or before) to validate")
    rows = {d: tuple(a for a in row if a.kind in FORWARD_KINDS) for d, row in program.actions.items()}
    return Schedule(f"{program.name} forward only", program.num_microbatches, rows)


class ForwardOnlyExecutor(StageExecutor):
    """``trained``'s rank running the forward-only list of its program over ``batches``."""

    def __init__(self, trained: StageExecutor, batches: Batches) -> None:
        self.trained = trained
        super().__init__(device=trained.device, spec=trained.wiring.spec, placement=trained.wiring.placement,
                         schedule=forward_only(trained.schedule), backend=trained.backend, comm=trained.comm,
                         batches=batches, loss_fn=trained.loss_fn, pipeline_ranks=trained.ranks, dp_group=(),
                         timeout=trained.timeout, loss_scale=1.0, wiring=trained.wiring, chunks=trained.chunks)
        self._own_order = self._inbound(self)
        self.end_pass()  # building it told the communicator the forward-only order: training comes first

    @staticmethod
    def _inbound(ex: StageExecutor) -> dict[int, list[tuple[int, ...]]]:
        return {ex.ranks[d]: m for d, m in inbound_order(ex.wiring, ex.schedule, ex.device, []).items()}

    def _check_setup(self, placement: Placement) -> None:
        if self.comm.rank != self.rank:
            raise PlanError(f"device {self.device} is global rank {self.rank} but its communicator "
                            f"is rank {self.comm.rank}")
        for mb in range(self.schedule.num_microbatches):
            for c in placement.chunks_of(self.device):
                runs = sum(1 for a in self.actions if a.kind == "F" and a.chunk == c and a.microbatch == mb)
                if runs != 1:
                    raise PlanError(f"forward-only schedule '{self.schedule.name}': {c}F{mb} appears {runs} times")

    def run_pass(self) -> StepStats:
        """One pass over the plan's microbatches with a blocking communicator (the launchers' path)."""
        self.begin_pass()
        try:
            with self.no_grad():
                return self.run_step(zero_grad=False)
        finally:
            self.end_pass()

    def begin_pass(self) -> None:
        """Before a pass: an order-matching communicator expects the forward-only messages."""
        self.comm.expect_inbound(self._own_order)

    def end_pass(self) -> None:
        """After a pass: the training program's messages again (what was learnt of them is learnt anew)."""
        self.comm.expect_inbound(self._inbound(self.trained))

    def no_grad(self) -> ContextManager[Any]:
        """The backend's ``no_grad()`` where it has one (PyTorch: no graph is built), else nothing."""
        no_grad = getattr(self.backend, "no_grad", None)
        return no_grad() if no_grad is not None else contextlib.nullcontext()

    def _forward(self, a: Action, pos: int) -> None:
        super()._forward(a, pos)
        slot = (a.chunk, a.microbatch)
        self._ctx.pop(slot, None)  # no backward: what the forward kept for it goes now
        for k in self.wiring.ios[a.chunk].consumes:  # read by its only consumer
            self.cache.drop_value(a.microbatch, k)

    def _loss(self, slot: Slot, output: Tensor, batch: dict[str, Tensor]) -> None:
        assert self.loss_fn is not None
        self.stats.losses[slot[1]] = self.loss_fn({MAIN: output}, batch)[0]  # the gradient is dropped

    def _finish(self) -> None:
        # the shared inputs' copies (temb, a text context) are released by the backward in training
        self.shared = SkipCache(self.backend.nbytes, self.backend.add, label="shared input")
        super()._finish()
