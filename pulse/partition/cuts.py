"""Valid symmetric cuts: where a V may split a model without breaking a skip.

A cut (a, b), a <= b, splits the layers into an outer region [0, a) + [b, L)
and an inner region [a, b)::

    [0 ...... a)[a ...... b)[b ...... L)
       outer        inner       outer

In a chain of nested cuts (``chain``) layer x belongs to pair j or deeper iff
x lies inside cut j, so two layers share a pair (hence a device of the V) iff
every cut of the chain has both inside or both outside. A cut is therefore
valid iff every skip (s, t) has both ends on one side of it::

    (a <= s < b) == (a <= t < b)

This includes the skips of a U (s < a, t >= b: spanning the inner region) and
also skips wholly inside one chunk or one pair, e.g. a short skip in the
encoder (s, t < a) or in the decoder (s, t >= b). The older rule
``(s < a) == (t >= b)`` admitted only the first kind and so missed skip-local
placements (8 layers, one skip 3 -> 7: its best V had a bottleneck of 32
where a split with loads 15 / 20 keeps the skip local).

Because the rule is per cut, any chain of valid cuts keeps every skip in one
pair, and every V placement with all skips on one device is such a chain: the
chain DPs stay exact over that whole space. For a wave a device holds k pairs,
so a skip between two pairs of the same device would also be local; those
placements are not searched (the rule is not per cut for them).

A cut with a == b is *terminal*: the fold point of the V, valid anywhere since
its inner region is empty. Valid cuts are enumerated over the (a, b) grid with
one vectorised test per skip, O(L^2 * S) numpy work.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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
    a = np.arange(n)[:, None]
    b = np.arange(n)[None, :]
    ok = (a >= 1) & (b >= a)
    for s, t in spans:
        ok &= ((a <= s) & (s < b)) == ((a <= t) & (t < b))
    found = [(0, n)] + [(int(x), int(y)) for x, y in zip(*np.nonzero(ok))]
    return CutSet(n, tuple(found))


def spanning_cuts(cutset: CutSet, spans: list[Span]) -> list[int]:
    """Indices of the cuts every skip spans or stays inside, (s < a) == (t >= b): the older,
    narrower rule, about half the cuts on the zoo. The two-fold DP, exact only up to
    ``fold2.MAX_CUTS`` cuts, still solves this subset exactly when the widened set is
    too large, so widening never makes a wave worse than the narrow optimum."""
    return [i for i, (a, b) in enumerate(cutset.cuts) if all((s < a) == (t >= b) for s, t in spans)]


def is_valid(cut: Span, spans: list[Span]) -> bool:
    a, b = cut
    return a <= b and all((a <= s < b) == (a <= t < b) for s, t in spans)


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
