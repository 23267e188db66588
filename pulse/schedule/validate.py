"""Schedule validation with errors that show the picture.

Every error's first line says what is wrong; below it a Step x Device grid
(PyTorch pipelining's layout) marks the offending action::

    schedule deadlocks: no device can run its next action (cyclic wait)
    Step | Dev 0                  | Dev 1
       0 | 0F0                    | 1B0 <-- ERROR HERE
       1 | 0B0 <-- ERROR HERE     | 1F0
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.schedule.deps import ComputeKey, chain_edges
from pulse.schedule.ir import COMM_KINDS, COMPUTE_KINDS, ENCODE_KINDS, Action, Schedule
from pulse.schedule.passes import final_gradient_positions, releasing

MARK = "<-- ERROR HERE"
_MAX_ROWS = 40  # long schedules: show the rows around the marks only

Marks = dict[tuple[int, int], str]  # (device, step) -> note after the marker


def format_grid(schedule: Schedule, marks: Marks) -> str:
    """The Step x Device grid, rows clipped to the neighbourhood of the marks."""
    devices = schedule.devices
    rows = max((len(r) for r in schedule.actions.values()), default=0)
    marked = sorted(step for _, step in marks) or [0]
    first, last = 0, rows - 1
    if rows > _MAX_ROWS:
        first = max(0, marked[0] - 5)
        last = min(rows - 1, max(first + _MAX_ROWS - 1, marked[-1] + 5))

    def cell(device: int, step: int) -> str:
        row = schedule.actions[device]
        text = row[step].text if step < len(row) else ""
        if (device, step) in marks:
            note = marks[(device, step)]
            text = f"{text} {MARK}" + (f" ({note})" if note else "")
        return text

    table = [[cell(d, s) for d in devices] for s in range(first, last + 1)]
    widths = [max([len(f"Dev {d}")] + [len(r[i]) for r in table]) for i, d in enumerate(devices)]
    lines = ["Step | " + " | ".join(f"Dev {d}".ljust(w) for d, w in zip(devices, widths))]
    if first > 0:
        lines.append("  ...")
    for s, row in zip(range(first, last + 1), table):
        lines.append(f"{s:>4} | " + " | ".join(t.ljust(w) for t, w in zip(row, widths)).rstrip())
    if last < rows - 1:
        lines.append("  ...")
    return "\n".join(lines)


def fail(schedule: Schedule, headline: str, marks: Marks) -> PlanError:
    return PlanError(f"{headline}\n{format_grid(schedule, marks)}")


def key_of(action: Action) -> ComputeKey:
    return action.task


def is_split(schedule: Schedule) -> bool:
    return any(a.kind == "W" for a in schedule.all_actions())


def check_coverage(schedule: Schedule, placement: Placement, num_microbatches: int) -> None:
    """Each (chunk, mb) has exactly one F and B (and W if split), on the chunk's device."""
    chunks = placement.chunks
    seen: dict[ComputeKey, tuple[int, int]] = {}
    for device, row in schedule.actions.items():
        for step, a in enumerate(row):
            where = {(device, step): ""}
            if a.is_encode:  # any device may encode: it names an encoder, no chunk
                _check_encode(schedule, a, (device, step), seen, num_microbatches)
                continue
            if a.is_encode_comm:
                continue  # paired and placed by check_comm
            if not 0 <= a.chunk < len(chunks):
                raise fail(schedule, f"action {a} names chunk {a.chunk}; the placement has "
                           f"chunks 0..{len(chunks) - 1}", where)
            if not 0 <= a.microbatch < num_microbatches:
                raise fail(schedule, f"action {a} names microbatch {a.microbatch}; expected "
                           f"0..{num_microbatches - 1}", where)
            if chunks[a.chunk].device != device:
                raise fail(schedule, f"action {a} is on device {device} but chunk {a.chunk} "
                           f"lives on device {chunks[a.chunk].device}", where)
            if a.is_compute:
                if key_of(a) in seen:
                    where[seen[key_of(a)]] = "first here"
                    raise fail(schedule, f"action {a} appears twice", where)
                seen[key_of(a)] = (device, step)
    kinds = ("F", "B", "W") if is_split(schedule) else ("F", "B")
    for c, chunk in enumerate(chunks):
        for m in range(num_microbatches):
            for kind in kinds:
                if (kind, c, m) not in seen:
                    row = schedule.actions.get(chunk.device, ())
                    missing = Action(chunk.device, c, m, kind).text
                    raise fail(schedule, f"schedule lacks {missing} (chunk {c}, microbatch {m}) on device "
                               f"{chunk.device}", {(chunk.device, max(len(row) - 1, 0)): f"missing {missing}"})
    _check_backward_after_forward(schedule, seen)
    _check_encodes_complete(schedule, seen, placement, num_microbatches)


def _check_encode(schedule: Schedule, a: Action, at: tuple[int, int], seen: dict[ComputeKey, tuple[int, int]],
                  num_microbatches: int) -> None:
    if not 0 <= a.microbatch < 2 * num_microbatches:  # M + m: the next step's m, prefetched
        raise fail(schedule, f"action {a} names microbatch {a.microbatch}; expected 0..{num_microbatches - 1} "
                   f"(or {num_microbatches}..{2 * num_microbatches - 1}: the next step's, prefetched)", {at: ""})
    if key_of(a) in seen:
        raise fail(schedule, f"encode {a} appears twice", {at: "", seen[key_of(a)]: "first here"})
    seen[key_of(a)] = at


def _check_encodes_complete(schedule: Schedule, seen: dict[ComputeKey, tuple[int, int]], placement: Placement,
                            num_microbatches: int) -> None:
    """An encoder that runs in the plan encodes every microbatch once, in this step or prefetched in
    the step before (E of M + m), and an encode on the first chunk's device comes before that
    microbatch's first forward there (elsewhere its RE, placed by lowering, makes the forward wait
    for the output's arrival)."""
    encoders = sorted({c for (kind, c, _) in seen if kind == "E"})
    first = placement.chunks[0].device
    for e in encoders:
        for m in range(num_microbatches):
            if ("E", e, m) in seen and ("E", e, m + num_microbatches) in seen:
                raise fail(schedule, f"microbatch {m} of encoder {e} is encoded twice: {e}E{m} in this step and "
                           f"{e}E{m + num_microbatches} for the next", {seen[("E", e, m)]: ""})
            if ("E", e, m + num_microbatches) in seen:
                continue  # prefetched: this step reads what the step before encoded
            if ("E", e, m) not in seen:
                row = schedule.actions.get(first, ())
                raise fail(schedule, f"schedule lacks {e}E{m}: encoder {e} runs in this plan but does not "
                           f"encode microbatch {m}", {(first, max(len(row) - 1, 0)): f"missing {e}E{m}"})
            device, step = seen[("E", e, m)]
            forward = seen.get(("F", 0, m))
            if device == first and forward is not None and forward[1] < step:
                raise fail(schedule, f"encode {e}E{m} comes after 0F{m}, microbatch {m}'s first forward, "
                           f"which reads its output", {(device, step): "", forward: "first forward"})


def _check_backward_after_forward(schedule: Schedule, seen: dict[ComputeKey, tuple[int, int]]) -> None:
    for (kind, c, m), (device, step) in seen.items():
        before = {"B": "F", "W": "B"}.get(kind)
        if before and seen[(before, c, m)][1] > step:
            raise fail(schedule, f"{c}{kind}{m} comes before {c}{before}{m} on device {device}",
                       {(device, step): "", seen[(before, c, m)]: f"its {before}"})


Ready = Callable[[int, int], bool]  # (device, position) -> can that action run now? (it has run if so)


def check_progress(schedule: Schedule, ready: Ready, headline: str) -> None:
    """Run every device's list with zero costs; raise with the stuck actions marked."""
    rows = schedule.actions
    pos = {d: 0 for d in rows}
    moved = True
    while moved:
        moved = False
        for d, row in rows.items():
            p, n = pos[d], len(row)
            while p < n and ready(d, p):
                p += 1
            if p != pos[d]:
                pos[d], moved = p, True
    stuck = {(d, pos[d]): "" for d, row in rows.items() if pos[d] < len(row)}
    if stuck:
        raise fail(schedule, headline, stuck)


# what an action waits for in ``_ready_fn``'s zero-cost run
_GO, _COMPUTE, _SEND, _RECV = range(4)
Step = tuple[int, object, object]  # (one of the above, its key, its predecessors / ordinal)


def _ready_fn(schedule: Schedule, num_chunks: int, num_microbatches: int, with_comm: bool) -> Ready:
    """The zero-cost run's readiness: a compute once its chain predecessors ran, a receive once the
    matching send (the as-many-th of equal receives on its row) ran; sends and marks never wait.
    Every action is turned into a ``Step`` once: the run asks a blocked head again on every pass."""
    preds: dict[ComputeKey, list[ComputeKey]] = {}
    for pred, succ in chain_edges(num_chunks, num_microbatches, is_split(schedule)):
        preds.setdefault(succ, []).append(pred)
    for a in schedule.all_actions():  # a microbatch's first forward reads every encoder's output
        if a.is_encode:
            preds.setdefault(("F", 0, a.microbatch), []).append(key_of(a))
    steps = {d: _steps(row, preds, with_comm) for d, row in schedule.actions.items()}
    done_keys: set[ComputeKey] = set()
    sends: Counter = Counter()

    def ready(d: int, p: int) -> bool:
        kind, key, extra = steps[d][p]
        if kind == _GO:
            return True
        if kind == _COMPUTE:
            ok = all(q in done_keys for q in extra)
            if ok:
                done_keys.add(key)
            return ok
        if kind == _SEND:  # sends are asynchronous: they never wait for the peer
            sends[key] += 1
            return True
        return sends[key] > extra

    return ready


def _steps(row: tuple[Action, ...], preds: dict[ComputeKey, list[ComputeKey]], with_comm: bool) -> list[Step]:
    """``row`` as ``Step``s; a receive's ordinal counts the equal receives before it on the row
    (equal actions name the same device, so they are all on this row, and run in its order; on
    one row a receive's message key names it: kind, peer or encoder, chunk, microbatch)."""
    seen: dict[tuple, int] = {}
    out: list[Step] = []
    for a in row:
        kind = a.kind
        if kind in COMPUTE_KINDS or kind in ENCODE_KINDS:
            key = key_of(a)
            out.append((_COMPUTE, key, preds.get(key, ())))
        elif kind in ("SF", "SB", "SE"):
            here, there = a.ends  # SE: encoder -> reader chunk
            out.append((_SEND, (kind[1], here, there, a.microbatch), None))
        elif kind in ("RF", "RB", "RE") and with_comm:
            here, there = a.ends  # RE: reader chunk <- encoder
            key = (kind[1], there, here, a.microbatch)
            ordinal = seen.get(key, 0)
            out.append((_RECV, key, ordinal))
            seen[key] = ordinal + 1
        else:  # a free or a bucket launch waits for nothing (nor a receive without messages)
            out.append((_GO, None, None))
    return out


def check_comm(schedule: Schedule, placement: Placement) -> None:
    """Every send has its receive on the peer's device, next to the right compute."""
    if _comm_fine(schedule, placement):
        return
    _check_comm_pairs(schedule, placement)
    _check_comm_positions(schedule)


_PRODUCER = {"SF": "F", "SB": "B", "RF": "F", "RB": "B", "SE": "E", "RE": "F"}  # the compute next to it


def _comm_fine(schedule: Schedule, placement: Placement) -> bool:
    """Whether ``check_comm`` passes, in one pass and without the grids: lowering checks every
    program the tuner prices, so the checks that find and mark the culprit run only on a failure."""
    counts: dict[tuple[str, int, int, int], int] = {}
    num_chunks = len(placement.chunks)
    for row in schedule.actions.values():
        index = {key_of(a): i for i, a in enumerate(row) if a.kind in COMPUTE_KINDS or a.kind in ENCODE_KINDS}
        for step, a in enumerate(row):
            kind = a.kind
            if kind not in COMM_KINDS:
                continue
            here, there = a.ends
            key = (kind, here, there, a.microbatch)
            counts[key] = counts.get(key, 0) + 1
            if a.peer is not None and not 0 <= a.peer < num_chunks:
                return False
            at = index.get((_PRODUCER[kind], here, a.microbatch))
            if at is not None and (at > step if kind[0] == "S" else at < step):
                return False
    for (kind, here, there, m), n in counts.items():
        twin = ("R" if kind[0] == "S" else "S") + kind[1]
        if kind[0] == "S" and counts.get((twin, there, here, m), 0) != n:
            return False
        if kind[0] == "R" and (twin, there, here, m) not in counts:
            return False
    return True


def _check_comm_pairs(schedule: Schedule, placement: Placement) -> None:
    """``check_comm``'s pairing, raising with the culprits marked."""
    where: dict[tuple[str, int, int, int], list[tuple[int, int]]] = {}
    for device, row in schedule.actions.items():
        for step, a in enumerate(row):
            if a.is_comm:  # keyed by the text's numbers: (this end, other end), an encoder's end for SE/RE
                where.setdefault((a.kind, *a.ends, a.microbatch), []).append((device, step))
                if a.peer is not None and not 0 <= a.peer < len(placement.chunks):
                    raise fail(schedule, f"action {a} names peer chunk {a.peer}, which does not exist",
                               {(device, step): ""})
    for (kind, chunk, peer, m), spots in where.items():
        if kind not in ("SF", "SB", "SE"):
            continue
        twin = "R" + kind[1]
        got = len(where.get((twin, peer, chunk, m), []))
        if got != len(spots):
            sent = schedule.actions[spots[0][0]][spots[0][1]]
            raise fail(schedule, f"send {sent} has "
                       f"{got} matching receive(s) {peer}{twin}{m}:{chunk}, expected {len(spots)}",
                       {s: "" for s in spots})
    for (kind, chunk, peer, m), spots in where.items():
        if kind in ("RF", "RB", "RE") and (("S" + kind[1], peer, chunk, m) not in where):
            raise fail(schedule, f"receive {chunk}{kind}{m}:{peer} has no matching send",
                       {s: "" for s in spots})


def _check_comm_positions(schedule: Schedule) -> None:
    """A send follows the compute producing it; a receive precedes the one consuming it."""
    producer = _PRODUCER
    for device, row in schedule.actions.items():
        index = {key_of(a): i for i, a in enumerate(row) if a.is_compute or a.is_encode}
        for step, a in enumerate(row):
            if not a.is_comm:
                continue
            at = index.get((producer[a.kind], a.ends[0], a.microbatch))  # SE's producer: its encoder's E
            if at is None:
                continue  # coverage reports the missing compute
            if a.kind[0] == "S" and at > step:
                raise fail(schedule, f"send {a} comes before the compute that produces it",
                           {(device, step): "", (device, at): "producer"})
            if a.kind[0] == "R" and at < step:
                raise fail(schedule, f"receive {a} comes after the compute that needs it",
                           {(device, step): "", (device, at): "consumer"})


def check_marks(schedule: Schedule, placement: Placement) -> None:
    """Per device: one FREE per (chunk, microbatch) after the compute that last needs its saved
    state, one AR per chunk after the last compute that accumulates its gradients."""
    for device, row in schedule.actions.items():
        release = {(row[p].chunk, row[p].microbatch): p for p in releasing(row)}
        final = final_gradient_positions(row)
        seen: dict[tuple[str, int, int], int] = {}
        for step, a in enumerate(row):
            if not a.is_mark:
                continue
            key = (a.kind, a.chunk, a.microbatch if a.kind == "FREE" else -1)
            if key in seen:
                raise fail(schedule, f"action {a} appears twice" if a.kind == "FREE" else
                           f"chunk {a.chunk} has two all-reduces", {(device, step): "", (device, seen[key]): "first"})
            seen[key] = step
            after = release.get((a.chunk, a.microbatch)) if a.kind == "FREE" else final.get(a.chunk)
            if after is None or after > step:
                what = "the compute that last needs what it frees" if a.kind == "FREE" else \
                    "the last compute that accumulates its gradients"
                marks = {(device, step): ""} | ({(device, after): "that compute"} if after is not None else {})
                raise fail(schedule, f"{a} comes before {what}", marks)
            if a.kind == "AR" and row[after].microbatch != a.microbatch:
                raise fail(schedule, f"{a} names microbatch {a.microbatch}, but chunk {a.chunk}'s gradients "
                           f"become final with {row[after]}", {(device, step): "", (device, after): ""})
        missing = [f"{c}FREE{m}" for c, m in sorted(release) if ("FREE", c, m) not in seen]
        missing += [f"{c}AR{row[p].microbatch}" for c, p in sorted(final.items()) if ("AR", c, -1) not in seen]
        if missing:
            raise fail(schedule, f"device {device} lacks {', '.join(missing[:4])}"
                       + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                       + " (frees and all-reduces come from pulse.schedule.lower)",
                       {(device, max(len(row) - 1, 0)): "end of the list"})


def validate_communication(schedule: Schedule, placement: Placement) -> None:
    """A program whose compute passed ``check_coverage``: its messages pair up next to the right
    compute, its frees and all-reduces (if any) sit right, and no rank waits forever."""
    check_comm(schedule, placement)
    if any(a.is_mark for a in schedule.all_actions()):
        check_marks(schedule, placement)
    ready = _ready_fn(schedule, len(placement.chunks), schedule.num_microbatches, True)
    check_progress(schedule, ready, "schedule deadlocks: no device can run its next action (cyclic wait)")


def validate(schedule: Schedule, placement: Placement, num_microbatches: int, *,
             with_comm: bool = False) -> None:
    """Raise PlanError (first line: what is wrong; then the grid) if the schedule cannot run."""
    check_shape(schedule, placement, num_microbatches)
    if not with_comm:  # also without frees and all-reduces: they only ride on a lowered program
        schedule = schedule.compute_only()
    check_coverage(schedule, placement, num_microbatches)
    if with_comm:
        validate_communication(schedule, placement)
        return
    ready = _ready_fn(schedule, len(placement.chunks), num_microbatches, False)
    check_progress(schedule, ready, "schedule deadlocks: no device can run its next action (cyclic wait)")


def check_shape(schedule: Schedule, placement: Placement, num_microbatches: int) -> None:
    """The schedule is for this microbatch count and names only the placement's devices."""
    if schedule.num_microbatches != num_microbatches:
        raise PlanError(f"schedule '{schedule.name}' is for {schedule.num_microbatches} microbatches, "
                        f"expected {num_microbatches}")
    unknown = sorted(set(schedule.devices) - set(range(placement.num_devices)))
    if unknown:
        raise PlanError(f"schedule has actions for device {unknown[0]}; the placement has devices "
                        f"0..{placement.num_devices - 1}")
