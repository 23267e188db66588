"""Passes over schedules. ``add_send_recv`` turns compute actions into a
runnable program by inserting the messages ``traffic.transfers()`` implies::

    dev0:  0F0  0SF0:1   ...   0RB0:1  0B0
    dev1:  1RF0:0  1F0   ...   1B0  1SB0:0

A send goes right after the compute that produces it, a receive right before
the compute that consumes it; one pair per Transfer per microbatch. An encode
(E) is followed by an SE to each reader chunk on another device
(``traffic.encode_transfers``), whose RE comes right before that chunk's F (a
prefetch for the next step, E of M + m, has its RE at the end of the reader's row)::

    dev3:  1E2  1SE2:0            (encoder 1 runs microbatch 2 in device 3's bubble)
    dev0:  0RE2:1  0F2  0SF2:1 When two
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

from pulse.encoders import EncoderSet
from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.schedule.ir import Action, Schedule
from pulse.spec import ModelSpec
from pulse.traffic import encode_transfers, transfers

EncodeMessages = tuple[dict[tuple[int, int], list[Action]], dict[tuple[int, int], list[Action]]]


def _peers(spec: ModelSpec, placement: Placement) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per chunk: the chunks it sends activations to, and those it receives from."""
    outs: dict[int, list[int]] = {}
    ins: dict[int, list[int]] = {}
    for tr in transfers(spec, placement):
        outs.setdefault(tr.src_chunk, []).append(tr.dst_chunk)
        ins.setdefault(tr.dst_chunk, []).append(tr.src_chunk)
    return outs, ins


def encode_messages(schedule: Schedule, spec: ModelSpec, placement: Placement,
                    encoders: EncoderSet | None) -> EncodeMessages:
    """SE actions after each (encoder, microbatch)'s E, and RE actions before each (chunk,
    microbatch)'s F, for the deliveries crossing devices; empty without encodes."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    encodes = [a for a in schedule.all_actions() if a.is_encode]
    if not encodes:
        return sends, recvs
    if encoders is None:
        raise PlanError(f"schedule '{schedule.name}' has encode actions ({encodes[0]}) but no encoders "
                        "were given: lower it with the plan's EncoderSet")
    deliveries = encode_transfers(spec, placement, encoders)
    for a in encodes:
        if not 0 <= a.encoder < len(encoders.encoders):
            raise PlanError(f"action {a} names encoder {a.encoder}; the plan has encoders "
                            f"0..{len(encoders.encoders) - 1}")
        for tr in deliveries:
            if tr.encoder == a.encoder and tr.dst_device != a.device:
                sends.setdefault((a.encoder, a.microbatch), []).append(
                    Action(a.device, None, a.microbatch, "SE", tr.dst_chunk, encoder=a.encoder))
                recvs.setdefault((tr.dst_chunk, a.microbatch), []).append(
                    Action(tr.dst_device, tr.dst_chunk, a.microbatch, "RE", encoder=a.encoder))
    return sends, recvs


def _with_messages(action: Action, outs: dict[int, list[int]], ins: dict[int, list[int]],
                   encode: EncodeMessages = ({}, {})) -> list[Action]:
    d, c, m = action.device, action.chunk, action.microbatch
    if action.kind == "E":  # forward only: its output goes to the readers on other devices
        before, after = [], list(encode[0].get((action.encoder, m), ()))
    elif action.kind == "F":  # receive activations (and encoder outputs), compute, send activations on
        before = list(encode[1].get((c, m), ())) + [Action(d, c, m, "RF", p) for p in ins.get(c, ())]
        after = [Action(d, c, m, "SF", p) for p in outs.get(c, ())]
    elif action.kind == "B":  # receive output gradients, compute, send input gradients back
        before = [Action(d, c, m, "RB", p) for p in outs.get(c, ())]
        after = [Action(d, c, m, "SB", p) for p in ins.get(c, ())]
    else:  # W needs nothing from other devices
        before, after = [], []
    return before + [action] + after


def add_send_recv(schedule: Schedule, spec: ModelSpec, placement: Placement,
                  encoders: EncoderSet | None = None) -> Schedule:
    """The schedule with SF/RF/SB/RB (and SE/RE) actions; existing ones are replaced, not doubled."""
    outs, ins = _peers(spec, placement)
    encode = encode_messages(schedule, spec, placement, encoders)
    rows = {
        device: tuple(a for action in row for a in _with_messages(action, outs, ins, encode))
        for device, row in schedule.compute_only().actions.items()
    }
    # a prefetch (the next step's microbatch) has no forward here to precede: its RE ends the row
    # (the message travels while the rank works: receives are posted early)
    for (_, m), received in sorted(encode[1].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for r in received if m >= schedule.num_microbatches else ():
            rows[r.device] = rows.get(r.device, ()) + (r,)
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
