"""Whether real runs order two configurations, and which way: a Welch interval on their step times.

A measured ranking is a measurement, so it has an error bar. On this 2-core host two runs
of one plan differ by 2-7% (bursts of delay, a speed that drifts over minutes), and a pair
of configurations 0.5% apart is ordered one way by one set of runs and the other way by the
next. Such a pair has no measured order for a prediction to match; ``validate.py`` keeps
measuring it until its 95% interval excludes zero (an order) or is narrower than
``TIE_WIDTH`` of its step time (a tie), or its extra rounds run out (a tie, with the
interval printed).

Each measured step counts as one sample. Steps of one run are correlated (a burst slows
several), so this interval is narrower than the truth: it calls a pair ordered sooner than
it should, never later. An inversion it reports is one the runs really show.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

# two-sided 95%; z, not Student's t: up to 10% narrower at 8 steps a side, so it too errs toward an order
Z95 = NormalDist().inv_cdf(0.975)
TIE_WIDTH = 0.01  # an interval narrower than this share of the step time settles a pair as a tie


@dataclass(frozen=True)
class Gap:
    """``later`` minus ``earlier``'s mean step time, and the 95% half-width of that difference (s)."""

    difference: float
    half_width: float
    mean: float  # the two means' average: what the relative figures are of

    @property
    def resolved(self) -> bool:
        """The interval excludes zero: the runs order the pair."""
        return abs(self.difference) > self.half_width

    @property
    def settled(self) -> bool:
        """More runs would not change the verdict much: ordered, or tied within ``TIE_WIDTH``."""
        return self.resolved or self.half_width <= TIE_WIDTH * self.mean


def measured_gap(earlier: Sequence[float], later: Sequence[float]) -> Gap | None:
    """The gap between two configurations' step times; None without two samples of each
    (rows of files written before samples were kept: their order of means is all there is)."""
    if len(earlier) < 2 or len(later) < 2:
        return None
    se = math.sqrt(statistics.variance(earlier) / len(earlier) + statistics.variance(later) / len(later))
    a, b = statistics.fmean(earlier), statistics.fmean(later)
    return Gap(b - a, Z95 * se, (a + b) / 2)


def verdict(predicted_faster: Sequence[float], predicted_slower: Sequence[float],
            faster_mean: float, slower_mean: float) -> str:
    """'as predicted' when the measured means order the pair as predicted; otherwise 'inverted'
    when the interval orders it against the prediction (or there are no samples to test),
    'tie' when it does not."""
    if faster_mean < slower_mean:
        return "as predicted"
    gap = measured_gap(predicted_faster, predicted_slower)
    return "inverted" if gap is None or gap.resolved else "tie"
