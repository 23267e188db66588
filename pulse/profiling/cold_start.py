"""What a compute action takes more right after a message: the cold start ``pulse profile`` measures.

::

    back to back (the layer columns):   [F l0][F l1][F l2] ... [B l2][B l1][B l0]
    cold:                       <msg>[F l0]<msg>[F l1]<msg>[F l2] ... <msg>[B l0]
                                 ^ a real exchange with a partner rank through the
                                   communicator, right before every action

In a pipeline most compute actions start right after their rank sent or received
a message, or slept in a receive: the communicator's code and the kernel ran in
between and the layer's code and data left the caches. On a CPU host a forward
right after a receive takes a fraction of a millisecond more processor time than
its back-to-back figure (after a send or another action, less; one figure
serves both). Summed over a step's many sub-millisecond actions that is a lag a
simulator priced from back-to-back figures alone would miss.

Each kind's figure is the median over the model's layers of (cold - back to
back), each side the median of its steps; both are timed in the same steps,
alternating, so a drift of the host's speed falls on both. The profile takes
the layers a window at a time (``cold_start_over``: ``pulse.profiling.windows``),
so no run holds the whole model.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Collection

import numpy as np

from pulse.costs import COLD_START_KINDS
from pulse.profiling.gather import Ranks
from pulse.profiling.timing import Samples, record_step

ColdSeconds = dict[str, float]
# (a run, the chunks whose figures count (None: all)) -> per kind, (cold - back to back) of each chunk
RunGaps = Callable[[Any, Collection[int] | None], dict[str, list[float]]]
# (split, gaps) -> what ``gaps`` gave on each run made for that split
EachRun = Callable[[bool, RunGaps], list[dict[str, list[float]]]]
EXCHANGE_TAG = 90  # the probe's own tag: no training message uses it during a profile


def exchange_with(ranks: Ranks, partner: int, sends_first: bool) -> Callable[[], None]:
    """One small message each way with ``partner`` through the real communicator (the two ranks
    call it in turn: the one that ``sends_first`` sends, then receives; the other the reverse)."""
    comm, small = ranks.comm, ranks.tensors.from_numpy(np.zeros(16, dtype=np.float32))

    def exchange() -> None:
        if sends_first:
            comm.send(small, partner, EXCHANGE_TAG)
            comm.recv(partner, EXCHANGE_TAG)
        else:
            comm.recv(partner, EXCHANGE_TAG)
            comm.send(small, partner, EXCHANGE_TAG)
        comm.wait_sends()
    return exchange


def _before_compute(run: Any, exchange: Callable[[], None] | None) -> None:
    """Make every executor of ``run`` call ``exchange`` before each compute action (None: undo)."""
    for ex in run.executors:
        if exchange is None:
            ex.__dict__.pop("run_next", None)
            continue
        plain = type(ex).run_next.__get__(ex)

        def run_next(ex=ex, plain=plain) -> None:
            if ex.position < len(ex.actions) and ex.actions[ex.position].is_compute:
                exchange()
            plain()
        ex.run_next = run_next


def cold_start_seconds(make_run: Callable[[bool], Any], exchange: Callable[[], None],
                       steps: int, warmup: int) -> ColdSeconds:
    """Per compute kind (``pulse.costs.COLD_START_KINDS``): what an action takes more right after
    ``exchange`` than back to back. ``make_run(split)``: a model on this rank, one chunk per layer,
    run by the executor in process (split: its backward as B and W); every chunk's figures count."""
    return cold_start_over(lambda split, gaps: [gaps(make_run(split), None)], exchange, steps, warmup)


def cold_start_over(each_run: EachRun, exchange: Callable[[], None], steps: int, warmup: int) -> ColdSeconds:
    """``cold_start_seconds`` over several runs (the profile's windows: a few layers real in each, the
    rest stand-ins whose actions do not count): ``each_run(split, gaps)`` calls ``gaps(run, chunks)``
    on each run it makes, one run alive at a time, and returns what they gave; the median is over
    every counted chunk of every run."""
    out: ColdSeconds = {}
    for split, names in ((False, {"F": "F", "B": "B"}), (True, {"B": "Bi", "W": "W"})):
        def gaps(run: Any, counted: Collection[int] | None, names: dict[str, str] = names) -> dict[str, list[float]]:
            warm: Samples = {}
            cold: Samples = {}
            for step in range(warmup + steps):
                for samples, before in ((warm, None), (cold, exchange)):
                    _before_compute(run, before)
                    record_step(run, samples if step >= warmup else {})
            _before_compute(run, None)
            return {name: [statistics.median(cold[(kind, c)]) - statistics.median(warm[(kind, c)])
                           for k, c in sorted(warm) if k == kind and (counted is None or c in counted)]
                    for kind, name in names.items()}
        found = each_run(split, gaps)
        for name in names.values():
            every = [g for f in found for g in f[name]]
            if every:
                out[name] = max(statistics.median(every), 0.0)  # a cold start never saves time
    assert set(out) <= set(COLD_START_KINDS)
    return out


def measure_in_pairs(each_run: EachRun, ranks: Ranks, cores: int | None, steps: int,
                     warmup: int = 1) -> list[Any]:
    """Every rank's cold-start figures (None where it had no partner; every rank calls it): ranks
    2k and 2k + 1 exchange messages, in the turns the layers are measured in (at most ``cores``
    ranks at once: ``pulse.profiling.layers.measure_layers_in_turns``), over the runs ``each_run``
    makes (``cold_start_over``; both partners' runs the same, so their exchanges pair up)."""
    world, rank = ranks.world, ranks.rank
    turns = -(-world // cores) if cores else 1
    partner = rank ^ 1
    paired = partner < world and (not cores or partner // cores == rank // cores)
    mine = None
    for turn in range(turns):
        if paired and (not cores or rank // cores == turn):
            mine = cold_start_over(each_run, exchange_with(ranks, partner, rank < partner), steps, warmup)
        ranks.barrier()
    return ranks.gather(mine)
