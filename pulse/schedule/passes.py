"""Passes over schedules. ``add_send_recv`` turns compute actions into a
runnable program by inserting the messages ``traffic.transfers()`` implies::

    dev0:  0F0  0SF0:1   ...   0RB0:1  0B0
    dev1:  1RF0:0  1F0   ...   1B0  1SB0:0

A send goes right after the compute that produces it, a receive right before
the compute that consumes it; one pair per Transfer per microbatch. When two
transfers join the same chunk pair (a direct skip to the next chunk), their
actions repeat and are matched in ``transfers()`` order.
"""
from __future__ import annotations

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
