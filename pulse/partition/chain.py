"""Dynamic programs over chains of nested valid cuts (the core of the V planner).

A chain (0, L) = c_0 ⊃ c_1 ⊃ ... ⊃ c_n, with c_n terminal (a == b), gives n
encoder/decoder pairs; pair j is encoder [a_j, a_j+1) + decoder [b_j+1, b_j),
both non-empty, both on the device of pair j::

    a_0      a_1      a_2 = b_2      b_1      b_0
     |  enc 0 | enc 1  |     dec 1    |  dec 0 |
       dev 0    dev 1        dev 1       dev 0

Everything is a (C x C) matrix over the C valid cuts: ``pair_time[c, d]`` is
the fwd+bwd seconds of the pair between outer cut c and inner cut d, +inf
unless d nests strictly inside c. Each DP level is one vectorised min over
that matrix, so a chain of n pairs costs O(n * C^2) numpy work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pulse.partition.cuts import CutSet

INF = float("inf")


@dataclass(frozen=True)
class ChainProblem:
    a: np.ndarray  # (C,) encoder-side cut position per cut
    b: np.ndarray  # (C,) decoder-side cut position per cut
    pair_time: np.ndarray  # (C, C) seconds of the pair between two cuts, inf if not nested
    cut_bytes: np.ndarray  # (C,) forward bytes per sample crossing both boundaries of a first-leg cut
    terminal: np.ndarray  # (C,) bool, a == b
    later_bytes: np.ndarray  # (C,) the same at a later-leg cut (a wave's), no produced shared input

    @property
    def size(self) -> int:
        return len(self.a)


def build_problem(cutset: CutSet, prefix: list[float], boundary_bytes: list[int],
                  produced_bytes: list[int] | None = None) -> ChainProblem:
    """Matrices for ``cutset``; ``prefix`` are layer-time prefix sums, ``boundary_bytes[x]``
    the forward bytes per sample crossing boundary x when a device boundary falls there,
    ``produced_bytes[x]`` those of the layer-made shared inputs made before layer x.

    Under direct transport a device receives a produced shared input once
    (``traffic.transfers``): every device with a chunk after its maker's chunk
    but the maker's device. Charging it at the decoder-side boundary b_j of
    the first-leg cuts j = 1..P-1 only (``cut_bytes``; ``later_bytes`` elsewhere)
    counts exactly that for every V and wave chain: a maker before all of those
    b_j (encoder side, any leg but the last) is paid P-1 times, a maker in
    pair j0's outermost decoder chunk j0 times, once for each device 0..j0-1.
    """
    a = np.array([c[0] for c in cutset.cuts], dtype=np.int64)
    b = np.array([c[1] for c in cutset.cuts], dtype=np.int64)
    pre = np.asarray(prefix, dtype=np.float64)
    nested = (a[None, :] > a[:, None]) & (b[None, :] < b[:, None])
    # encoder [a_c, a_d) + decoder [b_d, b_c)
    times = (pre[a][None, :] - pre[a][:, None]) + (pre[b][:, None] - pre[b][None, :])
    pair_time = np.where(nested, times, INF)
    bb = np.asarray(boundary_bytes, dtype=np.float64)
    made = np.zeros_like(bb) if produced_bytes is None else np.asarray(produced_bytes, dtype=np.float64)
    later = bb[a] + bb[b]
    return ChainProblem(a, b, pair_time, later + made[b], a == b, later)


def leg_bytes(problem: ChainProblem, position: int, num_devices: int) -> np.ndarray:
    """Bytes of every cut put at chain ``position`` (1 .. pairs - 1): positions below
    ``num_devices`` are on the first leg of the zigzag."""
    return problem.cut_bytes if position < num_devices else problem.later_bytes


def min_max_chain(problem: ChainProblem, pairs: int) -> tuple[float, list[int]]:
    """Exact least max pair time over chains of ``pairs`` pairs from cut 0; (inf, []) if none."""
    value = np.where(problem.terminal, 0.0, INF)
    choices = []
    rows = np.arange(problem.size)
    for _ in range(pairs):
        cand = np.maximum(problem.pair_time, value[None, :])
        pick = np.argmin(cand, axis=1)
        value = cand[rows, pick]
        choices.append(pick)
    if not np.isfinite(value[0]):
        return INF, []
    return float(value[0]), _walk(choices)


def k_best_chains(problem: ChainProblem, pairs: int, k: int) -> list[tuple[float, list[int]]]:
    """The ``k`` best distinct chains of ``pairs`` pairs by (max pair time, sum of squared pair times).

    ``min_max_chain`` keeps one path per (depth, cut); this keeps the ``k`` best, each a
    (next cut, its rank there) pointer, so the ``k`` paths of a state are distinct and so
    are the chains read back from cut 0. Many chains tie on the max (only the bottleneck
    pair sets it): the sum of squares ranks the tied ones, evener first, and exact ties go to
    the lower (next cut, rank). Lawler-style k-best over a DAG, with max in place of sum.

    Each level ranks only the finite (cut, rank) states below it, and the last level only cut 0's
    row (nothing else is read back): SD v2 in finer layers has 3,571 cuts, whose full (C, C k)
    ranking took 2-5 s a call."""
    size = problem.size
    worst = np.full((size, k), INF)
    worst[problem.terminal, 0] = 0.0
    squares = worst.copy()
    pointers = []  # per depth: (next cut, next rank) of every (cut, rank)
    for depth in range(pairs):
        rows = np.arange(size) if depth < pairs - 1 else np.zeros(1, dtype=np.int64)
        live = np.flatnonzero(np.isfinite(worst.ravel()))  # (cut, rank) states, in (cut, rank) order
        pair = problem.pair_time[np.ix_(rows, live // k)]
        cand_max = np.maximum(pair, worst.ravel()[live][None, :])
        cand_sq = pair ** 2 + squares.ravel()[live][None, :]
        order = _k_smallest(cand_max, cand_sq, k)
        picked = live[order]  # (rows, k') flat (cut, rank) indices; k' = min(k, live states)
        new_worst, new_squares = np.full((size, k), INF), np.full((size, k), INF)
        new_worst[rows, :order.shape[1]] = np.take_along_axis(cand_max, order, axis=1)
        new_squares[rows, :order.shape[1]] = np.take_along_axis(cand_sq, order, axis=1)
        nxt, nxt_rank = np.zeros((size, k), dtype=np.int64), np.zeros((size, k), dtype=np.int64)
        nxt[rows, :order.shape[1]], nxt_rank[rows, :order.shape[1]] = np.divmod(picked, k)
        worst, squares = new_worst, new_squares
        pointers.append((nxt, nxt_rank))
    chains = []
    for top in range(k):
        if not np.isfinite(worst[0, top]):
            break
        chain, cut, rank = [0], 0, top
        for nxt, nxt_rank in reversed(pointers):
            cut, rank = int(nxt[cut, rank]), int(nxt_rank[cut, rank])
            chain.append(cut)
        chains.append((float(worst[0, top]), chain))
    return chains


def _k_smallest(first: np.ndarray, second: np.ndarray, k: int) -> np.ndarray:
    """Per row, the column indices of the ``k`` smallest (first, second, column) entries, in that
    order (fewer if the row is shorter); entries whose ``first`` is inf come last in any order.
    Only the columns that can be among them are sorted: those with ``first`` at most the row's
    k-th smallest, which ``np.argpartition`` gathers without sorting the rest."""
    columns = first.shape[1]
    if columns <= 2 * k:
        return np.lexsort((second, first), axis=-1)[:, :k]
    kth = np.partition(first, k - 1, axis=1)[:, k - 1:k]
    contenders = int(((first <= kth) & np.isfinite(first)).sum(axis=1).max(initial=0))
    keep = max(contenders, k)
    if keep * 2 > columns:
        return np.lexsort((second, first), axis=-1)[:, :k]
    gathered = np.sort(np.argpartition(first, keep - 1, axis=1)[:, :keep], axis=1)  # column order: ties by column
    order = np.lexsort((np.take_along_axis(second, gathered, axis=1),
                        np.take_along_axis(first, gathered, axis=1)), axis=-1)[:, :k]
    return np.take_along_axis(gathered, order, axis=1)


def even_chain(problem: ChainProblem, pairs: int) -> list[int]:
    """The chain of ``pairs`` pairs with the least sum of squared pair times (a second
    starting point for the wave search: even pairs make even devices whatever the fold)."""
    value = np.where(problem.terminal, 0.0, INF)
    choices = []
    rows = np.arange(problem.size)
    for _ in range(pairs):
        cand = problem.pair_time ** 2 + value[None, :]
        pick = np.argmin(cand, axis=1)
        value = cand[rows, pick]
        choices.append(pick)
    return _walk(choices) if np.isfinite(value[0]) else []


def min_bytes_chain(problem: ChainProblem, devices: list[int], cap: float) -> tuple[float, list[int]]:
    """Least forward bytes over chains whose every pair time is <= cap; ties go to the
    least max pair time. ``devices[j]`` is pair j's device: moving from pair j to
    j+1 costs the inner cut's boundary bytes only if the device changes."""
    pairs = len(devices)
    size = problem.size
    feasible = problem.pair_time <= cap
    cost = np.where(problem.terminal, 0.0, INF)
    worst = np.where(problem.terminal, 0.0, INF)
    choices = []
    rows = np.arange(size)
    for depth in range(1, pairs + 1):
        j = pairs - depth  # index of the pair that starts at the outer cut
        crosses = j + 1 < pairs and devices[j] != devices[j + 1]
        entry = problem.cut_bytes if crosses else np.zeros(size)
        cand = np.where(feasible, (entry + cost)[None, :], INF)
        least = cand.min(axis=1)
        tied = np.where((cand == least[:, None]) & np.isfinite(cand),
                        np.maximum(problem.pair_time, worst[None, :]), INF)
        pick = np.argmin(tied, axis=1)
        cost, worst = least, tied[rows, pick]
        choices.append(pick)
    if not np.isfinite(cost[0]):
        return INF, []
    return float(cost[0]), _walk(choices)


def max_pairs(problem: ChainProblem) -> int:
    """The longest chain from cut 0 (0 if no terminal cut exists)."""
    nested = np.isfinite(problem.pair_time)
    reach = problem.terminal.copy()
    depth = 0
    while True:
        reach = (nested & reach[None, :]).any(axis=1)
        if not reach[0]:
            return depth
        depth += 1


def _walk(choices: list[np.ndarray]) -> list[int]:
    """Cut indices c_0 = 0, c_1, ..., c_n from per-depth argmin tables (last = outermost)."""
    chain = [0]
    for pick in reversed(choices):
        chain.append(int(pick[chain[-1]]))
    return chain
