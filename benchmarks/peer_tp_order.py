"""torch.distributed.pipelining's own action order for a multi-stage schedule, as PULSE's schedule IR:
what ``peer_pricing`` prices beside PULSE's generator of the same shape, to tell the two apart.

torch computes every rank's list of actions (``pipeline_order``: F, I = input backward, W = weight
backward, B = full backward, None = a bubble) in the schedule's constructor from the rank count,
stage count and microbatches alone; ``tp_schedule`` runs that computation without stages or a
process group (the constructor's own attribute set, then its two order methods) and maps I to
PULSE's B (the input half of a split backward: the row also holds the W), bubbles dropped (PULSE's
simulator waits on the dependencies). Single-stage schedules (1F1B, GPipe) have no such list in
torch; PULSE's 1f1b and gpipe are the textbook orders torch runs.
"""
from __future__ import annotations

ORDERED = ("interleaved_1f1b", "interleaved_zb", "zbv")
KINDS = {"F": "F", "I": "B", "W": "W", "B": "B"}


def tp_order(schedule: str, pp: int, microbatches: int) -> dict[int, list]:
    """torch's ``pipeline_order`` of ``schedule`` (``ORDERED``) on ``pp`` ranks, two stages each."""
    import torch.distributed.pipelining.schedules as S

    classes = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "interleaved_zb": S.ScheduleInterleavedZeroBubble,
               "zbv": S.ScheduleZBVZeroBubble}
    if schedule not in classes:
        raise ValueError(f"no multi-stage torch order for '{schedule}'; known: {', '.join(ORDERED)}")
    o = object.__new__(classes[schedule])  # the constructor's attributes, without stages or a group
    o.pp_group_size, o.n_local_stages, o._n_microbatches, o.num_stages = pp, 2, microbatches, 2 * pp
    o.number_of_rounds = max(1, microbatches // pp)
    o.microbatches_per_round = microbatches // o.number_of_rounds
    o.stage_index_to_group_rank = ({c: c % pp for c in range(2 * pp)} if schedule != "zbv"
                                   else {c: c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)})
    o.pipeline_order = {r: o._calculate_single_rank_operations(r) for r in range(pp)}
    if schedule == "interleaved_zb":  # as its constructor does
        o.pipeline_order = o._add_bubbles_to_actions(2 * pp)
    return o.pipeline_order


def tp_schedule(schedule: str, pp: int, microbatches: int):
    """``tp_order`` as a ``pulse.schedule.ir.Schedule`` (chunk = TP's stage index)."""
    from pulse.schedule.ir import Action, Schedule

    rows = {r: tuple(Action(r, a.stage_index, a.microbatch_index, KINDS[a.computation_type.value])
                     for a in actions if a is not None)
            for r, actions in tp_order(schedule, pp, microbatches).items()}
    return Schedule(f"tp-{schedule}", microbatches, rows)
