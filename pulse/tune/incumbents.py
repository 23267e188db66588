"""The step times a candidate must beat to change the tuner's answer.

The answer is the top ``top`` of the ranking (the winner first), the best of each
strategy and of each encoders mode (and of each group ``keep_best_of`` names). A
candidate whose lower bound (``pulse.tune.bounds``) is above all the times that
matter to it cannot change any of them::

    threshold(c) = max(the top-th fastest fitting step so far,
                       the depth-th fastest of c's strategy, of c's encoders mode, of c's extra group)
    skip c  <=>  bound(c) > threshold(c)         (inf while fewer are known)

Every time only falls as candidates are priced, so a candidate skipped against
today's threshold stays out of the final answer: the top of the ranking, the
winner and each group's best are those of the exhaustive search. A tie is never
skipped (its bound is at most its step).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable

from pulse.tune.evaluate import Evaluation
from pulse.tune.space import Candidate

GroupOf = Callable[[Candidate], "str | None"]  # an extra group whose best is kept exact, or None
SLACK = 1e-9  # relative: a bound equal to a threshold up to float rounding is never skipped


@dataclass
class Incumbents:
    top: int  # the ranking's head kept exact
    depth: int = 1  # per group, the fastest kept exact (the refiner's finalists)
    keep_best_of: GroupOf | None = None
    ranked: list[float] = field(default_factory=list)  # the fastest fitting steps, ascending, at most top
    groups: dict[str, list[float]] = field(default_factory=dict)  # group -> its fastest, at most depth

    def group_names(self, cand: Candidate) -> list[str]:
        names = [f"strategy:{cand.strategy}", f"encoders:{cand.encoders}"]
        extra = self.keep_best_of(cand) if self.keep_best_of is not None else None
        return names + ([f"extra:{extra}"] if extra is not None else [])

    def threshold(self, cand: Candidate) -> float:
        times = [_kth(self.ranked, self.top)] + [_kth(self.groups.get(g, []), self.depth)
                                                 for g in self.group_names(cand)]
        return max(times)

    def matters(self, bound: float, cand: Candidate) -> bool:
        """Can a candidate whose step is at least ``bound`` change the answer?"""
        return bound * (1 - SLACK) <= self.threshold(cand)

    def add(self, e: Evaluation) -> None:
        if not e.fits:
            return
        _insert(self.ranked, e.iteration_time, self.top)
        for g in self.group_names(e.candidate):
            _insert(self.groups.setdefault(g, []), e.iteration_time, self.depth)


def _kth(times: list[float], k: int) -> float:
    return times[k - 1] if len(times) >= k else math.inf


def _insert(times: list[float], value: float, keep: int) -> None:
    bisect.insort(times, value)
    del times[keep:]
