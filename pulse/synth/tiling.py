"""The steady-state pattern of a window, found per device and tiled to any microbatch count::

    window order   prefix | block block block | suffix        block: each (kind, chunk) once,
    tiled to M     prefix | block x (R + M - W) | suffix (+M-W)   block k = block 0 shifted by k
"""
from __future__ import annotations

from typing import Mapping, Sequence

from pulse.schedule.ir import Action, Schedule
from pulse.schedule.timing import Key


def shifted(key: Key, by: int) -> Key:
    return (key[0], key[1], key[2] + by)


def find_block(row: Sequence[Key], period: int) -> tuple[int, int] | None:
    """(start, repeats) of the longest run (two or more) of ``period``-action blocks in which
    each (kind, chunk) appears once and block k is block 0 with every microbatch + k."""
    best: tuple[int, int] | None = None
    for start in range(len(row) - 2 * period + 1):
        block = row[start:start + period]
        if len({(k, c) for k, c, _ in block}) != period:
            continue
        repeats = 1
        while start + (repeats + 1) * period <= len(row) and all(
                row[start + repeats * period + i] == shifted(block[i], repeats) for i in range(period)):
            repeats += 1
        if repeats >= 2 and (best is None or repeats > best[1]):
            best = (start, repeats)
    return best


def tile_row(row: Sequence[Key], block: tuple[int, int], period: int, extra: int) -> list[Key]:
    """The row with ``extra`` more repeats of its block; what follows shifts by ``extra``."""
    start, repeats = block
    body = row[start:start + period]
    out = list(row[:start])
    out += [shifted(a, k) for k in range(repeats + extra) for a in body]
    out += [shifted(a, extra) for a in row[start + repeats * period:]]
    return out


def tile(orders: Mapping[int, Sequence[Key]], window: int, total: int) -> dict[int, list[Key]] | None:
    """Each device's order stretched from ``window`` to ``total`` microbatches; None if some
    device shows no repeating block (or the block does not reproduce the window)."""
    if total < window:
        raise ValueError(f"cannot tile a {window}-microbatch window down to {total}")
    out: dict[int, list[Key]] = {}
    for device, row in orders.items():
        period = len({(k, c) for k, c, _ in row})
        block = find_block(row, period)
        if block is None or tile_row(row, block, period, 0) != list(row):
            return None
        out[device] = tile_row(row, block, period, total - window)
    return out


def to_schedule(name: str, num_microbatches: int, orders: Mapping[int, Sequence[Key]]) -> Schedule:
    return Schedule(name, num_microbatches,
                    {d: tuple(Action.of_task(d, key) for key in row) for d, row in orders.items()})


def orders_of(schedule: Schedule, split: bool) -> dict[int, list[Key]]:
    """Compute keys per device; with ``split``, a whole backward becomes B then W."""
    has_w = any(a.kind == "W" for a in schedule.all_actions())
    out: dict[int, list[Key]] = {}
    for d, row in schedule.actions.items():
        keys: list[Key] = []
        for a in row:
            if a.is_compute:
                keys.append((a.kind, a.chunk, a.microbatch))
                if split and not has_w and a.kind == "B":
                    keys.append(("W", a.chunk, a.microbatch))
        out[d] = keys
    return out
