"""Passes over schedules. ``add_send_recv`` turns compute actions into a
runnable program by inserting the messages ``traffic.transfers()`` implies::

    dev0:  0F0  0SF0:1   ...   0RB0:1  0B0
    dev1:  1RF0:0  1F0   ...   1B0  1SB0:0

A send goes right after the compute that produces it, a receive right before
the compute that consumes it; one pair per Transfer per microbatch. When two
transfers join the same chunk pair (a direct skip to the next chunk), their
actions repeat and are matched in ``transfers()`` order.

``add_memory_and_sync`` then makes memory and the data-parallel all-reduce
explicit (Alpa's FREE instructions, DDP's buckets as actions)::

    dev0:  ... 0B6 0FREE6 0SB6:1 ... 0B7 0AR7 0FREE7 0SB7:1
                  │                     │
                  │                     └ chunk 0's gradients are final: its bucket goes now
                  └ chunk 0's forward context and the skips it read for mb 6 are released

A FREE follows the last compute that needs a (chunk, microbatch)'s saved state
(its B, or its W when the backward is split); an AR follows the last compute
that accumulates into a chunk's gradients. Both come before that compute's sends.
"""
from __future__ import annotations

from typing import Sequence

from pulse.placement import Placement
from pulse.schedule.ir import Action, Schedule
from pulse.spec import ModelSpec
from pulse.traffic import transfers


def _peers(spec: ModelSpec, placement: Placement) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per chunk: the chunks it sends activations to, and those it receives from."""
    outs: dict[int, list[int]] = {}
    ins: dict[int, list[int]] = {}
    for tr in transfers(spec, placement):
        outs.setdefault(tr.src_chunk, []).append(tr.dst_chunk)
        ins.setdefault(tr.dst_chunk, []).append(tr.src_chunk)
    return outs, ins


def _with_messages(action: Action, outs: dict[int, list[int]], ins: dict[int, list[int]]) -> list[Action]:
    d, c, m = action.device, action.chunk, action.microbatch
    if action.kind == "F":  # receive activations, compute, send activations on
        before = [Action(d, c, m, "RF", p) for p in ins.get(c, ())]
        after = [Action(d, c, m, "SF", p) for p in outs.get(c, ())]
    elif action.kind == "B":  # receive output gradients, compute, send input gradients back
        before = [Action(d, c, m, "RB", p) for p in outs.get(c, ())]
        after = [Action(d, c, m, "SB", p) for p in ins.get(c, ())]
    else:  # W needs nothing from other devices
        before, after = [], []
    return before + [action] + after


def add_send_recv(schedule: Schedule, spec: ModelSpec, placement: Placement) -> Schedule:
    """The schedule with SF/RF/SB/RB actions; existing ones are replaced, not doubled."""
    outs, ins = _peers(spec, placement)
    rows = {
        device: tuple(a for action in row for a in _with_messages(action, outs, ins))
        for device, row in schedule.compute_only().actions.items()
    }
    return Schedule(schedule.name, schedule.num_microbatches, rows)


def releasing(actions: Sequence[Action]) -> set[int]:
    """Positions of the computes after which a (chunk, microbatch) needs nothing it saved:
    its B, or its W when that backward is split."""
    split = {(a.chunk, a.microbatch) for a in actions if a.kind == "W"}
    return {pos for pos, a in enumerate(actions)
            if a.kind == "W" or (a.kind == "B" and (a.chunk, a.microbatch) not in split)}


def final_gradient_positions(actions: Sequence[Action]) -> dict[int, int]:
    """Chunk -> position of the last action that accumulates its parameter gradients
    (the last releasing compute of that chunk: weight gradients come from B, or from W)."""
    last: dict[int, int] = {}
    for pos in sorted(releasing(actions)):
        last[actions[pos].chunk] = pos
    return last


def _with_marks(row: tuple[Action, ...]) -> tuple[Action, ...]:
    row = tuple(a for a in row if not a.is_mark)
    release, final = releasing(row), final_gradient_positions(row)
    out: list[Action] = []
    for pos, a in enumerate(row):
        out.append(a)
        if pos in release:
            if final.get(a.chunk) == pos:  # launched first: the all-reduce overlaps what follows
                out.append(Action(a.device, a.chunk, a.microbatch, "AR"))
            out.append(Action(a.device, a.chunk, a.microbatch, "FREE"))
    return tuple(out)


def add_memory_and_sync(schedule: Schedule) -> Schedule:
    """The schedule with a FREE per (chunk, microbatch) and an AR per chunk; existing ones are replaced."""
    return Schedule(schedule.name, schedule.num_microbatches,
                    {device: _with_marks(row) for device, row in schedule.actions.items()})
