"""Local search over a chain for wave placements with k >= 3 folds (and for two
folds on models with too many valid cuts for the exact ``fold2`` DP).

With k > 1 a device's load is the sum of its k pairs, which no per-pair DP
sees. The planner starts from chains a per-pair DP finds (least max pair time,
least sum of squared pair times and, for two folds, the exact DP on a thinned
cut set) and improves each, vectorised over all candidate cuts:

1. balance: accept a move that lowers the max device load, or keeps it and
   lowers the sum of squared loads. Moves: one cut to any valid cut that keeps
   the chain strictly nested; when stuck, two consecutive legs re-cut exactly
   by the two-fold DP (``fold2.two_leg_segment``, the other legs fixed), or two
   adjacent cuts moved together. (max, sum of squares) strictly decreases, so
   the search ends, at a local optimum: on small random models it is within a
   few percent of brute force (tests/test_partition_dp.py).
2. bytes: with the max load capped at (1 + slack) x the balanced optimum,
   accept a single-cut move that lowers forward bytes (or keeps them and lowers
   the max).
"""
from __future__ import annotations

import functools

import numpy as np

from pulse.partition.chain import ChainProblem, leg_bytes
from pulse.partition.fold2 import MAX_CUTS, two_leg_segment

REL = 1e-9  # relative improvements smaller than this are float noise
MAX_SWEEPS = 100  # a hard stop; in practice a handful of sweeps converge


def device_loads(problem: ChainProblem, chain: list[int], devices: list[int], num_devices: int) -> np.ndarray:
    loads = np.zeros(num_devices)
    for j, dev in enumerate(devices):
        loads[dev] += problem.pair_time[chain[j], chain[j + 1]]
    return loads


def chain_bytes(problem: ChainProblem, chain: list[int], devices: list[int]) -> float:
    """Forward bytes per sample: a cut between pairs on different devices is crossed."""
    num_devices = len(set(devices))
    return float(sum(leg_bytes(problem, j + 1, num_devices)[chain[j + 1]] for j in range(len(devices) - 1)
                     if devices[j] != devices[j + 1]))


def _candidates(problem: ChainProblem, chain: list[int], devices: list[int],
                num_devices: int, pos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every cut c put at chain position ``pos``: (max load, sum of squared loads, bytes)."""
    pairs = len(devices)
    outer = problem.pair_time[chain[pos - 1], :]  # pair pos-1 becomes (chain[pos-1], c)
    if pos == pairs:  # the terminal cut may only move to another terminal cut
        inner = np.where(problem.terminal, 0.0, np.inf)
    else:
        inner = problem.pair_time[:, chain[pos + 1]]
    loads = np.tile(device_loads(problem, chain, devices, num_devices), (problem.size, 1))
    loads[:, devices[pos - 1]] += outer - problem.pair_time[chain[pos - 1], chain[pos]]
    if pos < pairs:
        loads[:, devices[pos]] += inner - problem.pair_time[chain[pos], chain[pos + 1]]
    ok = np.isfinite(outer) & np.isfinite(inner)
    worst = np.where(ok, loads.max(axis=1), np.inf)
    squares = np.where(ok, (loads ** 2).sum(axis=1), np.inf)
    before = chain_bytes(problem, chain, devices)
    at = leg_bytes(problem, pos, num_devices)
    crossing = pos < pairs and devices[pos - 1] != devices[pos]
    moved = before - at[chain[pos]] + at if crossing else np.full(problem.size, before)
    return worst, squares, moved


def _search(problem: ChainProblem, chain: list[int], devices: list[int], num_devices: int,
            better) -> list[int]:
    """Repeat single-cut moves chosen by ``better(worst, squares, bytes, current) -> index|None``."""
    chain = list(chain)
    for _ in range(MAX_SWEEPS):
        improved = False
        for pos in range(1, len(devices) + 1):
            worst, squares, nbytes = _candidates(problem, chain, devices, num_devices, pos)
            current = (worst[chain[pos]], squares[chain[pos]], nbytes[chain[pos]])
            pick = better(worst, squares, nbytes, current)
            if pick is not None and pick != chain[pos]:
                chain[pos] = int(pick)
                improved = True
        if not improved:
            break
    return chain


def balance(problem: ChainProblem, chain: list[int], devices: list[int], num_devices: int) -> list[int]:
    """Phase 1: least max device load (local optimum), then least sum of squares.
    Single-cut moves first; when they are stuck, a block move (two legs re-cut
    exactly, if the model has at most MAX_CUTS cuts) or a move of two adjacent cuts
    (O(C^2) candidates), then single moves resume."""
    def better(worst, squares, _nbytes, current):
        ok = (worst < current[0] * (1 - REL)) | ((worst <= current[0]) & (squares < current[1] * (1 - REL)))
        if not ok.any():
            return None
        keyed = np.where(ok, worst, np.inf)
        return int(np.argmin(np.where(keyed <= keyed.min() * (1 + REL), squares, np.inf)))

    chain = _search(problem, chain, devices, num_devices, better)
    for _ in range(MAX_SWEEPS):
        moved = ((_block_move(problem, chain, devices, num_devices) if problem.size <= MAX_CUTS else None)
                 or _double_move(problem, chain, devices, num_devices))
        if moved is None:
            return chain
        chain = _search(problem, moved, devices, num_devices, better)
    return chain


def _improves(loads: np.ndarray, current: tuple[float, float]) -> bool:
    worst, squares = loads.max(), (loads ** 2).sum()
    return worst < current[0] * (1 - REL) or (worst <= current[0] and squares < current[1] * (1 - REL))


def _block_move(problem: ChainProblem, chain: list[int], devices: list[int],
                num_devices: int) -> list[int] | None:
    """Re-cut two consecutive legs (2P pairs, each device twice) exactly with the
    two-fold DP, the other legs fixed; the first block that improves wins."""
    pt, pairs = problem.pair_time, len(devices)
    base = device_loads(problem, chain, devices, num_devices)
    current = (base.max(), (base ** 2).sum())
    for lo in range(0, pairs - 2 * num_devices + 1, num_devices):
        hi = lo + 2 * num_devices  # pairs lo..hi-1; step i pairs lo+i with hi-1-i
        other = base.copy()
        for j in range(lo, hi):
            other[devices[j]] -= pt[chain[j], chain[j + 1]]
        offsets = np.array([other[devices[lo + i]] for i in range(num_devices)])
        segment = two_leg_segment(problem, chain[lo], chain[hi] if hi < pairs else None, offsets)
        moved = chain[:lo] + segment + chain[hi + 1:]
        if segment and moved != chain and _improves(device_loads(problem, moved, devices, num_devices), current):
            return moved
    return None


def _double_move(problem: ChainProblem, chain: list[int], devices: list[int],
                 num_devices: int) -> list[int] | None:
    """The chain with cuts pos, pos+1 moved together, for the first pos that lowers
    (max load, sum of squares); None if no such move exists."""
    pairs, pt = len(devices), problem.pair_time
    base = device_loads(problem, chain, devices, num_devices)
    current = (base.max(), (base ** 2).sum())
    for pos in range(1, pairs):
        touched = [j for j in (pos - 1, pos, pos + 1) if j < pairs]
        old = [pt[chain[j], chain[j + 1]] for j in touched]
        last = (np.where(problem.terminal, 0.0, np.inf) if pos + 1 == pairs
                else pt[:, chain[pos + 2]])
        new = [pt[chain[pos - 1], :][:, None], pt, last[None, :]]
        moved: dict[int, np.ndarray] = {}  # the C x C loads of the (at most three) devices the move changes
        for k, j in enumerate(touched):
            moved[devices[j]] = moved.get(devices[j], base[devices[j]]) + (new[k] - old[k])
        if pos + 1 == pairs:  # the terminal "pair" has no load, only the validity mask
            moved[0] = moved.get(0, base[0]) + np.where(np.isfinite(last), 0.0, np.inf)[None, :]
        others = np.delete(base, list(moved))
        worst = functools.reduce(np.maximum, moved.values(), others.max(initial=-np.inf))
        squares = sum((loads ** 2 for loads in moved.values()), (others ** 2).sum())
        ok = np.isfinite(worst) & ((worst < current[0] * (1 - REL)) |
                                   ((worst <= current[0]) & (squares < current[1] * (1 - REL))))
        if ok.any():
            x, y = np.unravel_index(np.argmin(np.where(ok, worst, np.inf)), worst.shape)
            return chain[:pos] + [int(x), int(y)] + chain[pos + 2:]
    return None


def trim_bytes(problem: ChainProblem, chain: list[int], devices: list[int], num_devices: int,
               cap: float) -> list[int]:
    """Phase 2: least forward bytes with the max device load kept <= cap."""
    def better(worst, _squares, nbytes, current):
        ok = (worst <= cap) & ((nbytes < current[2]) | ((nbytes == current[2]) & (worst < current[0] * (1 - REL))))
        if not ok.any():
            return None
        keyed = np.where(ok, nbytes, np.inf)
        return int(np.argmin(np.where(keyed == keyed.min(), worst, np.inf)))
    return _search(problem, chain, devices, num_devices, better)
