"""The encodes a plan prefetches for a run's first step, run before it on the ranks the plan gives them.

A bubbles plan may encode microbatch m of step s + 1 during step s (an E of M + m,
``pulse.runtime.encode_actions``). The first step a process runs (step 0, or the step
``--resume`` starts at) has no step before it: without one, every rank whose chunks read
m's text or latents would encode them itself, loading encoders the plan never gives it.
So before that step each rank runs its list's prefetch actions alone (E, SE, RE of a
microbatch >= M), in the list's order, as the step before would have run them::

    the program (every step):  dev 0  ... 0F1 ... 0E4 0SE4:3 ...      dev 1  ... 3F0 ... 3RE4:0
    before the first step s0:  dev 0  0E4 0SE4:3  (for step s0 - 1)   dev 1  3RE4:0
        ─▶ step s0's microbatch 0 is encoded on device 0 and received by device 1, as at every later step

Each rank's prefetch actions keep their order in its list and their messages keep their pairs, so
they cannot deadlock where the whole program does not. A communicator that matches messages by
order (NCCL, HCCL) is told this exchange's order first, then the program's again; every rank does
both, whether or not it takes part, so the two ends of every pair count their headers alike.
"""
from __future__ import annotations

from pulse.runtime.executor import StageExecutor
from pulse.runtime.message_order import inbound_order
from pulse.schedule.ir import Action, Schedule


def prefetches_of(program: Schedule) -> Schedule:
    """The program's prefetch encodes and their messages alone (microbatch >= M), each device's in list order."""
    return Schedule(f"{program.name} prefetches", program.num_microbatches,
                    {d: tuple(a for a in row if (a.is_encode or a.is_encode_comm)
                              and a.microbatch >= program.num_microbatches)
                     for d, row in program.actions.items()})


class FirstStepEncodes:
    """One rank's share: ``start`` tells its communicator the exchange's order, ``run_next`` runs one action
    (a fake communicator's would-block comes before anything changes, as in ``StageExecutor.run_next``, so
    ``pulse.testing.fake_comm.run_all_ranks`` can run every rank's in one process), ``finish`` restores
    the program's order. ``run`` does all three on a rank of its own."""

    def __init__(self, executor: StageExecutor, first_step: int) -> None:
        self.executor, self.first_step = executor, first_step
        self.rank, self.device = executor.rank, executor.device
        self.prefetches = prefetches_of(executor.schedule)
        self.actions: tuple[Action, ...] = self.prefetches.actions.get(executor.device, ())
        self.needed = any(self.prefetches.actions.values())  # the plan prefetches on some rank
        self.position = 0
        self.stats = None  # run_all_ranks' result per rank: nothing is measured here

    @property
    def done(self) -> bool:
        return self.position >= len(self.actions)

    def start(self) -> None:
        if not self.needed:
            return
        self.executor.batches.step = self.first_step - 1  # a prefetch (ahead 1) provides to the first step
        self._expect(self.prefetches)

    def begin_step(self, zero_grad: bool = False) -> None:
        """``run_all_ranks``' name for ``start``."""
        self.start()

    def run_next(self) -> None:
        ex, a = self.executor, self.actions[self.position]
        comm, ranks, chunks = ex.comm, ex.ranks, ex.wiring.placement.chunks
        if a.kind == "E":
            ex.encodes.encode(a)
        elif a.kind == "SE":
            ex.encodes.send(a, lambda tags, values, peer: comm.send_group(values, peer, tags, ex.timeout),
                            lambda c: ranks[chunks[c].device])
        else:  # RE
            ex.encodes.receive(a, lambda tags, d: list(comm.recv_group(ranks[d], tags, ex.timeout)))
        self.position += 1

    def finish(self) -> None:
        if self.needed:
            self._expect(self.executor.schedule)

    def next_label(self) -> str:
        return f"first-step prefetch #{self.position} {self.actions[self.position]}" if not self.done else "done"

    def run(self) -> int:
        """On a rank with a blocking communicator: every prefetch of this rank; how many actions ran."""
        self.start()
        while not self.done:
            self.run_next()
        self.finish()
        return len(self.actions)

    def _expect(self, schedule: Schedule) -> None:
        ex = self.executor
        feeds = [e.feeds for e in ex.encodes.encoders] if ex.encodes is not None else []
        order = inbound_order(ex.wiring, schedule, ex.device, feeds)
        ex.comm.expect_inbound({ex.ranks[d]: messages for d, messages in order.items()})
