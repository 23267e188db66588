"""The search space: every (strategy, PP, DP, microbatch size, folds, schedule) worth pricing.

Strategies, each under the same devices, batch and memory budget::

    data-parallel        PP = 1, the whole model per device, gradient accumulation
    sequential-1f1b      balanced sequential stages, skips relayed, 1F1B (+ DP)
    diffusionpipe-1f1b   DiffusionPipe-style partition (counts relay time), 1F1B (+ DP)
    pulse                skip-local V / wave, best of the V schedules (+ DP)
"""
from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("pulse", "data-parallel", "sequential-1f1b", "diffusionpipe-1f1b")
PULSE_SCHEDULES = ("greedy_v_1f1b", "zero_bubble_v")


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

    @property
    def label(self) -> str:
        shape = "V" if self.folds == 1 else (f"wave{self.folds}" if self.folds else "seq")
        cap = "" if self.inflight_cap is None else f" cap={self.inflight_cap}"
        return (f"{self.strategy} pp={self.pp} dp={self.dp} mbs={self.microbatch_size} "
                f"M={self.num_microbatches} {shape} {self.schedule}{cap}")


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
            out.extend(_shapes(pp, dp, mbs, m, folds))
    return out


def _shapes(pp: int, dp: int, mbs: int, m: int, folds: tuple[int, ...]) -> list[Candidate]:
    if pp == 1:
        return [Candidate("data-parallel", 1, dp, mbs, m, 0, "sequential", "1f1b")]
    shapes = [Candidate("sequential-1f1b", pp, dp, mbs, m, 0, "sequential", "1f1b"),
              Candidate("diffusionpipe-1f1b", pp, dp, mbs, m, 0, "diffusionpipe", "1f1b")]
    # The default cap lets the first microbatch return before device 0 stalls;
    # a cap of P is the 1F1B memory promise, for when memory is tight.
    for k in folds:
        for schedule in PULSE_SCHEDULES:
            shapes.extend(Candidate("pulse", pp, dp, mbs, m, k, "pulse", schedule, cap) for cap in (None, pp))
    return shapes
