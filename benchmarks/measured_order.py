"""Whether real runs order two configurations, and which way: a Welch interval on their step times.

A measured ranking is a measurement, so it has an error bar. On this 2-core host two runs
of one plan differ by 2-7% (bursts of delay, a speed that drifts over minutes), and a pair
of configurations 0.5% apart is ordered one way by one set of runs and the other way by the
next. Such a pair has no measured order for a prediction to match; ``validate.py`` keeps
measuring it until its 95% interval excludes zero (an order) or is narrower than
``TIE_WIDTH`` of its step time (a tie), or its extra rounds run out (a tie, with the
interval printed).

``rankings`` applies that to every pair of a group's rows (``validate_report.Row``: predicted_s,
measured_s, samples).

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


def rankings(rows: list, apart: tuple[str, ...] = ()) -> list[dict]:
    """Per (model, P, link): the configurations ordered by predicted and by measured time."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r.config in apart:
            continue
        groups.setdefault((r.model, r.pp, r.link), []).append(r)
    out = []
    for (model, pp, link), group in groups.items():
        by_pred = [r.config for r in sorted(group, key=lambda r: r.predicted_s)]
        by_meas = [r.config for r in sorted(group, key=lambda r: r.measured_s)]
        against = inversions(group)
        out.append({"model": model, "pp": pp, "link": link, "predicted_order": by_pred,
                    "measured_order": by_meas, "same": all(i["verdict"] == "tie" for i in against),
                    "same_order_of_means": by_pred == by_meas, "inversions": against,
                    "pairs_ordered": sum(_ordered(a, b) for k, a in enumerate(group) for b in group[k + 1:]),
                    "pairs": len(group) * (len(group) - 1) // 2})
    return out


def inversions(group: list) -> list[dict]:
    """Pairs the prediction orders one way and the measured means the other: the means' gap
    (the predicted slower one's over the predicted faster one's, less one), its 95% interval
    (``measured_order``) and the verdict, 'inverted' when the interval excludes zero (or the
    rows have no samples to test), else 'tie': the runs do not order the pair."""
    out = []
    for i, a in enumerate(group):
        for b in group[i + 1:]:
            fast, slow = (a, b) if a.predicted_s < b.predicted_s else (b, a)
            call = verdict(fast.samples, slow.samples, fast.measured_s, slow.measured_s)
            if call == "as predicted":
                continue
            gap = measured_gap(fast.samples, slow.samples)
            out.append({"pair": [fast.config, slow.config], "measured_gap": slow.measured_s / fast.measured_s - 1,
                        "interval": gap.half_width / fast.measured_s if gap else None, "verdict": call,
                        "predicted_gap": slow.predicted_s / fast.predicted_s - 1})
    return out


def _ordered(a, b) -> bool:
    """The runs order the pair (its interval excludes zero; rows without samples: always)."""
    gap = measured_gap(a.samples, b.samples)
    return gap is None or gap.resolved


def inversion_text(inversion: dict) -> str:
    interval = "" if inversion["interval"] is None else f" ± {inversion['interval']:.1%}"
    return (f"{' / '.join(inversion['pair'])} ({inversion['predicted_gap']:+.1%}; "
            f"{inversion['measured_gap']:+.1%}{interval}: {inversion['verdict']})")
