"""Valid symmetric cuts: where a V may split a model without breaking a skip.

A cut (a, b), a <= b, splits the layers into an outer region [0, a) + [b, L)
and an inner region [a, b)::

    [0 ...... a)[a ...... b)[b ...... L)
       outer        inner       outer

It is valid iff no skip has one end in each region, i.e. for every skip
(s, t): (s < a) == (t >= b). For a fixed a that pins b to an interval:

    b <= min{t : s < a}     (skips starting outside must end outside)
    b >  max{t : s >= a}    (skips starting inside must end inside)

so valid cuts are enumerated in O(L * S). A cut with a == b is *terminal*:
every skip spans a, the fold point of the V.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

Span = tuple[int, int]  # (src layer index, dst layer index), src < dst


@dataclass(frozen=True)
class CutSet:
    """The valid cuts of a model; ``cuts[0]`` is the whole model (0, L)."""

    num_layers: int
    cuts: tuple[Span, ...]

    @property
    def num_terminal(self) -> int:
        return sum(1 for a, b in self.cuts if a == b)


def valid_cuts(num_layers: int, spans: list[Span]) -> CutSet:
    """All valid cuts usable inside a chain: (0, L) first, then 1 <= a <= b <= L-1.

    Cuts with a == 0 or b == L other than (0, L) would leave an encoder or a
    decoder chunk empty, so they are never part of a chain and are left out.
    """
    n = num_layers
    found: list[Span] = [(0, n)]
    for a in range(1, n):
        hi = min((t for s, t in spans if s < a), default=n - 1)
        lo = max((t + 1 for s, t in spans if s >= a), default=0)
        for b in range(max(a, lo), min(hi, n - 1) + 1):
            found.append((a, b))
    return CutSet(n, tuple(found))


def is_valid(cut: Span, spans: list[Span]) -> bool:
    a, b = cut
    return a <= b and all((s < a) == (t >= b) for s, t in spans)


def heaviest_nested_subset(spans: list[Span], weights: list[int]) -> list[int]:
    """Indices of a maximum-weight subset of spans in which no two cross.

    Two spans cross when s1 < s2 < t1 < t2. An interval DP over endpoints:
    best(l, r) is the heaviest non-crossing choice among spans inside [l, r];
    either no chosen span starts at l, or the outermost one chosen there,
    (l, t), splits the problem into inside (l, t) and [t, r].
    """
    by_start: dict[int, list[int]] = {}
    for i, (s, t) in enumerate(spans):
        by_start.setdefault(s, []).append(i)
    points = sorted({p for span in spans for p in span})

    @lru_cache(maxsize=None)
    def best(li: int, r: int, skip: int) -> tuple[int, tuple[int, ...]]:
        # heaviest subset of spans within [points[li], r], excluding span `skip`
        if li >= len(points) or points[li] >= r:
            return 0, ()
        options = [best(li + 1, r, skip)]
        for i in by_start.get(points[li], []):
            s, t = spans[i]
            if i == skip or t > r:
                continue
            inner_w, inner = best(li, t, i)
            rest_w, rest = best(points.index(t), r, skip)
            options.append((weights[i] + inner_w + rest_w, (i, *inner, *rest)))
        return max(options, key=lambda o: (o[0], -len(o[1])))

    if not spans:
        return []
    return sorted(best(0, max(t for _, t in spans), -1)[1])
