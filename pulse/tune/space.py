"""The search space: every (strategy, PP, DP, microbatch size, placement shape, schedule) worth pricing.

Strategies, each under the same devices, batch and memory budget, each with
every schedule the runtime executes on its placement (the generators in
``pulse.schedule.generators``; ``applicable_baselines`` says which fit)::

    data-parallel  PP = 1, the whole model per device, gradient accumulation
    sequential     balanced sequential stages, skips relayed (+ DP); one chunk per
                   device (1F1B, GPipe, list schedules incl. zero-bubble) or two,
                   interleaved (interleaved 1F1B, GPipe, list schedules)
    diffusionpipe  DiffusionPipe-style partition (counts relay time), same shapes
                   and schedules as sequential (+ DP)
    pulse          skip-local V / wave, the V list schedules (+ DP); and every sequential
                   and interleaved shape above with PULSE's skip transport: a skip sent
                   once, producer to consumer, and kept on its device where the two share
                   one (``Placement.skip_transport == "direct"``). Skip locality is then an
                   objective the simulator prices on the links, not a wall: wherever a
                   baseline's cuts win, PULSE's search holds them too, with fewer bytes;
                   and data parallelism alone (PP = 1), where no pipeline beats it

Each strategy's best is picked by simulated throughput, so PULSE is compared
with the strongest schedule a baseline could run, not with its 1F1B alone.

Activation recomputation is the last dimension, searched where it can matter
(``pulse.tune.tuner``): a shape over the memory budget is priced again with the
chunks of its over-budget devices recomputing, then with every chunk. A shape
that fits is not: recomputation only adds a forward to each backward, so it
never makes the same placement and schedule faster.

With frozen encoders in the request (``pulse.encoders``) every shape is priced
once per encoders mode asked for (cached offline, before the pipeline, in its
bubbles): the same pipeline, its encodes placed by ``pulse.schedule.encode``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pulse.schedule.generators import LIST_SCHEDULES  # they take an in-flight cap

STRATEGIES = ("pulse", "data-parallel", "sequential", "diffusionpipe")
PULSE_SCHEDULES = ("greedy_v_1f1b", "zero_bubble_v")
SEQUENTIAL_SCHEDULES = ("1f1b", "gpipe", *LIST_SCHEDULES)  # one chunk per device
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "gpipe", *LIST_SCHEDULES)  # chunk c on device c % P
VIRTUAL_STAGES = 2  # chunks per device of the interleaved baselines (Megatron's usual choice)


@dataclass(frozen=True)
class Candidate:
    strategy: str
    pp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    folds: int  # 0 for sequential placements
    partitioner: str
    schedule: str
    inflight_cap: int | None = None  # microbatches a device may hold (None: the generator's default)
    virtual: int = 1  # chunks per device of a sequential placement: 1, or >= 2 for interleaved
    recompute: tuple[int, ...] = ()  # chunks (placement indices) that recompute their activations
    encoders: str = "cached"  # where the frozen encoders run (pulse.encoders.MODES)
    skip_transport: str = "relay"  # "direct" on PULSE's shapes: its V / wave and its sequential / interleaved ones
    device_caps: tuple[int, ...] = ()  # a list schedule's in-flight cap per device (pulse.tune.caps_fit)

    @property
    def shape(self) -> str:
        if self.folds:
            return "V" if self.folds == 1 else f"wave{self.folds}"
        shape = "seq" if self.virtual == 1 else f"int{self.virtual}"
        return shape + "+direct" if self.skip_transport == "direct" else shape

    @property
    def label(self) -> str:
        cap = "" if self.inflight_cap is None else f" cap={self.inflight_cap}"
        cap += f" caps={','.join(map(str, self.device_caps))}" if self.device_caps else ""
        rc = f" recompute={chunk_ranges(self.recompute)}" if self.recompute else ""
        enc = "" if self.encoders == "cached" else f" enc={self.encoders}"
        return (f"{self.strategy} pp={self.pp} dp={self.dp} mbs={self.microbatch_size} "
                f"M={self.num_microbatches} {self.shape} {self.schedule}{cap}{rc}{enc}")


def chunk_ranges(chunks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``0-2,5``: short enough for a table cell."""
    parts: list[tuple[int, int]] = []
    for c in sorted(chunks):
        if parts and parts[-1][1] == c - 1:
            parts[-1] = (parts[-1][0], c)
        else:
            parts.append((c, c))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(num_devices: int, global_batch: int, microbatch_sizes: tuple[int, ...],
                         folds: tuple[int, ...], max_pp: int) -> list[Candidate]:
    """All shapes whose batch splits evenly: global = DP x microbatch size x M."""
    out: list[Candidate] = []
    for pp in divisors(num_devices):
        if pp > max_pp:
            continue
        dp = num_devices // pp
        for mbs in microbatch_sizes:
            if global_batch % (dp * mbs):
                continue
            m = global_batch // (dp * mbs)
            out.extend(shapes_at(pp, dp, mbs, m, folds))
    return out


def shapes_at(pp: int, dp: int, mbs: int, m: int, folds: tuple[int, ...]) -> list[Candidate]:
    """Every strategy's candidates at one shape (PP, DP, microbatch size and count; the V's ``folds``)."""
    if pp == 1:  # PULSE's search holds plain data parallelism too: where it is fastest, PULSE runs it
        whole = [Candidate("data-parallel", 1, dp, mbs, m, 0, "sequential", s) for s in SEQUENTIAL_SCHEDULES]
        return whole + [replace(c, strategy="pulse", skip_transport="direct") for c in whole]
    shapes = []
    for strategy in ("sequential", "diffusionpipe"):
        shapes += [Candidate(strategy, pp, dp, mbs, m, 0, strategy, s) for s in SEQUENTIAL_SCHEDULES]
        for s in INTERLEAVED_SCHEDULES:
            if s == "interleaved_1f1b" and m % pp:
                continue  # Megatron's schedule runs microbatches in groups of P
            # the list schedules' default cap on 2P chunks is 2P; P is 1F1B's memory promise
            caps = (None, pp) if s in LIST_SCHEDULES else (None,)
            shapes += [Candidate(strategy, pp, dp, mbs, m, 0, strategy, s, cap, VIRTUAL_STAGES) for cap in caps]
    # The default cap lets the first microbatch return before device 0 stalls;
    # a cap of P is the 1F1B memory promise, for when memory is tight.
    direct = [replace(c, strategy="pulse", skip_transport="direct") for c in shapes]
    for k in folds:  # a V or wave keeps its skips local, and sends the few it gives up (dropped_skips) direct
        for schedule in PULSE_SCHEDULES:
            shapes.extend(Candidate("pulse", pp, dp, mbs, m, k, "pulse", schedule, cap, skip_transport="direct")
                          for cap in (None, pp))
    return shapes + direct


def with_encoder_modes(candidates: list[Candidate], modes: tuple[str, ...]) -> list[Candidate]:
    """Every candidate once per encoders mode (the same pipeline, its encodes placed differently)."""
    return [replace(c, encoders=mode) for c in candidates for mode in modes]
