"""Exact DP for the two-fold wave (k = 2), the common wave.

With two folds device d holds pair d (first leg, going in) and pair 2P-1-d
(second leg, coming back), so the chain is walked from both ends at once::

    c_0 ⊃ c_1 ⊃ ... ⊃ c_P ⊃ ... ⊃ c_2P-1 ⊃ c_2P        (c_2P terminal)
    └ x_d ──▶                            ◀── y_d ┘

    state after d devices: (x, y) = (c_d, c_2P-d), x ⊃ y
    step d -> d+1: x' inside x, y' around y, device d's load
                   = pair(x, x') + pair(y', y); at d+1 = P the fronts meet (x' = y')

The state space is O(C^2) and every step scans it, O(P * C^4) in the worst
case but far less in practice (only nested states are reachable). It is used
when the model has at most ``MAX_CUTS`` valid cuts; beyond that the planner
falls back to the local search in ``wave``. ``two_leg_segment`` runs the same
DP on any two consecutive legs of a k-fold wave with the other legs fixed: the
local search for k >= 3 uses it as an exact large move.

Two passes, as for V: (1) least max device load, ties towards fewer bytes;
(2) least bytes with every device load <= cap, ties towards the least max.
"""
from __future__ import annotations

import numpy as np

from pulse.partition.chain import INF, ChainProblem

MAX_CUTS = 120  # measured: ~0.1 s per pass at 120 cuts on a skip-free model (the worst case)


def two_fold_chain(problem: ChainProblem, num_devices: int, cap: float | None = None,
                   upper: float | None = None) -> list[int]:
    """Cut indices c_0..c_2P of the best two-fold chain ([] if none): least max device
    load when ``cap`` is None, else least bytes with every device load <= cap. ``upper``: a
    max device load some chain reaches (the least max is at most it), which lets the DP drop
    states that cannot beat it; the answer is the same."""
    return two_leg_segment(problem, 0, None, np.zeros(num_devices), cap, upper)


def coarse_two_fold_chain(problem: ChainProblem, num_devices: int) -> list[int]:
    """For problems too large for the exact DP: solve it on an evenly thinned subset of
    at most MAX_CUTS cuts (cut 0 and every terminal cut kept), as a start for the local
    search at full resolution. [] if the thinned problem has no chain."""
    terminal = np.nonzero(problem.terminal)[0]
    others = np.nonzero(~problem.terminal)[0][1:]  # all but cut 0
    budget = MAX_CUTS - 1 - len(terminal)
    if budget <= 0:
        return []
    keep = np.unique(np.concatenate([[0], others[:: -(-len(others) // budget)], terminal]))
    return subset_two_fold_chain(problem, keep, num_devices)


def subset_two_fold_chain(problem: ChainProblem, keep, num_devices: int, cap: float | None = None) -> list[int]:
    """``two_fold_chain`` over the cuts ``keep`` only (cut 0 first), as indices into ``problem``."""
    keep = np.asarray(keep, dtype=np.int64)
    sub = ChainProblem(problem.a[keep], problem.b[keep], problem.pair_time[np.ix_(keep, keep)],
                       problem.cut_bytes[keep], problem.terminal[keep], problem.later_bytes[keep])
    return [int(keep[c]) for c in two_fold_chain(sub, num_devices, cap)]


def two_leg_segment(problem: ChainProblem, outer: int, inner: int | None, offsets: np.ndarray,
                    cap: float | None = None, upper: float | None = None) -> list[int]:
    """The same DP on any two consecutive legs of a wave: 2S pairs between a fixed
    ``outer`` cut and a fixed ``inner`` cut (None: any terminal cut), where step i's
    device already carries ``offsets[i]`` seconds from pairs outside the segment.

    With a ceiling on every device's load (``cap``, or ``upper`` on the least max load),
    a state is dropped once its load is over it or the work left between its fronts
    cannot fit under it on the devices left (``_fits``): no chain through it can end under
    the ceiling, so the best chain, and every tie-break on the way to it, is unchanged."""
    size, steps = problem.size, len(offsets)
    load = np.full((size, size), INF)
    if inner is None:
        load[outer, problem.terminal] = 0.0
    else:
        load[outer, inner] = 0.0
    nbytes = load.copy()
    back = []
    a, b = problem.a, problem.b
    inside = (a[:, None] < a[None, :]) & (b[:, None] > b[None, :])  # x' strictly contains y'
    # x' is on the zigzag's first leg iff the segment starts at cut 0; y' never is
    x_bytes = problem.cut_bytes if outer == 0 else problem.later_bytes
    ceiling = None if cap is None and upper is None else (cap if cap is not None else upper) * (1 + _SLACK)
    for i in range(steps):
        last = i == steps - 1
        step_bytes = 0.0 if last else x_bytes[:, None] + problem.later_bytes[None, :]
        load, nbytes, parent = _step(problem, load, nbytes, step_bytes, float(offsets[i]), cap)
        keep = np.eye(size, dtype=bool) if last else inside
        if ceiling is not None and not last:
            keep = keep & _fits(problem, load, ceiling, offsets[i + 1:])
        load, nbytes = np.where(keep, load, INF), np.where(keep, nbytes, INF)
        back.append(parent)
    primary, secondary = (load, nbytes) if cap is None else (nbytes, load)
    primary, secondary = primary.diagonal(), secondary.diagonal()
    if not np.isfinite(primary).any():
        return []
    meet = int(np.argmin(np.where(primary == primary.min(), secondary, INF)))
    return _walk(back, meet, steps)


_SLACK = 1e-9  # relative: a ceiling reached exactly by a sum in another order stays under it


def _fits(problem: ChainProblem, load: np.ndarray, ceiling: float, offsets_left: np.ndarray) -> np.ndarray:
    """States (x, y) that can still end with every load <= ``ceiling``: their own load is, and
    the pairs left between the fronts (encoder [a_x, a_y) + decoder [b_y, b_x), ``pair_time``)
    fit under it on the devices left with what those already carry."""
    room = ceiling * len(offsets_left) - float(np.sum(offsets_left))
    return (load <= ceiling) & (problem.pair_time <= room * (1 + _SLACK))


def _step(problem: ChainProblem, load: np.ndarray, nbytes: np.ndarray, step_bytes, offset: float,
          cap: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Relax every reachable (x, y) into all (x', y'); returns new load, bytes and parents."""
    size = problem.size
    pt = problem.pair_time
    best_load, best_bytes = np.full((size, size), INF), np.full((size, size), INF)
    parent = np.full((size, size), -1, dtype=np.int64)
    for x, y in zip(*np.nonzero(np.isfinite(load))):
        step = offset + pt[x, :][:, None] + pt[:, y][None, :]  # device load with (x -> x', y' -> y)
        new_load = np.maximum(load[x, y], step)
        new_bytes = nbytes[x, y] + step_bytes
        if cap is None:
            better = (new_load < best_load) | ((new_load == best_load) & (new_bytes < best_bytes))
        else:
            better = (step <= cap) & ((new_bytes < best_bytes) |
                                      ((new_bytes == best_bytes) & (new_load < best_load)))
        best_load = np.where(better, new_load, best_load)
        best_bytes = np.where(better, new_bytes, best_bytes)
        parent = np.where(better, x * size + y, parent)
    return best_load, best_bytes, parent


def _walk(back: list[np.ndarray], meet: int, steps: int) -> list[int]:
    size = back[0].shape[0]
    chain = [0] * (2 * steps + 1)
    x, y = meet, meet
    for i in range(steps, 0, -1):
        chain[i], chain[2 * steps - i] = x, y
        x, y = divmod(int(back[i - 1][x, y]), size)
    chain[0], chain[2 * steps] = x, y
    return chain
