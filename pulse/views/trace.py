"""Chrome-trace / Perfetto JSON of a simulated iteration.

One process per device: thread 0 holds its compute (F/B/W, and E: a frozen
encoder's forward, named after the encoder) and an instant
event at each AR (the chunk's gradient bucket is launched), thread 1+d the
messages it sends to device d. FREE actions are left out: the memory they
release is in the simulator's figures, not worth a mark per microbatch.
Open in chrome://tracing or ui.perfetto.dev.
"""
from __future__ import annotations

import json
from pathlib import Path

from pulse.sim.result import SimResult
from pulse.atomic_io import write_atomic

_US = 1e6  # trace timestamps are microseconds


def trace_events(result: SimResult) -> list[dict]:
    events: list[dict] = []
    for d in range(result.num_devices):
        events.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": 0, "args": {"name": "compute"}})
    links = sorted({(m.src_device, m.dst_device) for m in result.messages})
    for src, dst in links:
        events.append({"ph": "M", "name": "thread_name", "pid": src, "tid": 1 + dst,
                       "args": {"name": f"send to device {dst}"}})
    num_mb = 1 + max((s.microbatch for s in result.compute if s.kind == "F"), default=-1)
    for s in result.compute:
        if s.kind == "E":
            encoder = result.encoder_names[s.chunk] if s.chunk < len(result.encoder_names) else str(s.chunk)
            ahead = s.microbatch >= num_mb  # a prefetch: M + m is the next step's m
            mb = s.microbatch - num_mb if ahead else s.microbatch
            name = f"encode {encoder} mb{mb}" + (" (next step)" if ahead else "")
            args = {"encoder": encoder, "microbatch": mb, "next_step": ahead}
        else:
            name, args = f"{s.chunk}{s.kind}{s.microbatch}", {"chunk": s.chunk, "microbatch": s.microbatch}
        events.append({"ph": "X", "name": name, "cat": s.kind,
                       "pid": s.device, "tid": 0, "ts": s.start * _US, "dur": (s.end - s.start) * _US,
                       "args": args})
    for m in result.messages:
        events.append({"ph": "X", "name": f"{m.src_chunk}S{m.direction}{m.microbatch}:{m.dst_chunk}",
                       "cat": "message", "pid": m.src_device, "tid": 1 + m.dst_device,
                       "ts": m.start * _US, "dur": (m.end - m.start) * _US,
                       "args": {"bytes": m.nbytes, "skips": list(m.skips), "ready_us": m.ready * _US}})
    for mark in result.marks:
        if mark.kind == "AR":
            events.append({"ph": "i", "s": "t", "name": f"{mark.chunk}AR{mark.microbatch}", "cat": "AR",
                           "pid": mark.device, "tid": 0, "ts": mark.time * _US,
                           "args": {"chunk": mark.chunk, "what": "gradient bucket launched"}})
    return events


def write_trace(result: SimResult, path: str | Path) -> Path:
    path = Path(path)
    doc = {"traceEvents": trace_events(result), "displayTimeUnit": "ms",
           "otherData": {"schedule": result.schedule_name, "makespan_s": result.makespan}}
    write_atomic(path, json.dumps(doc) + "\n")
    return path


def measured_trace_events(ranks: dict[int, list[dict]], pid_offset: int = 0, label: str = "rank") -> list[dict]:
    """Events of one step as it ran: ``ranks[r]`` lists ``{"label", "kind", "start", "end"}`` in
    seconds from the step's start (``pulse_torch.train --trace``); message calls (SF/RF/SB/RB, whose
    time includes waiting for the message) and bucket launches (AR) get their own row under each
    rank's compute; FREE actions are skipped."""
    events: list[dict] = []
    for r, spans in sorted(ranks.items()):
        pid = pid_offset + r
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{label} {r}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "messages, waits"}})
        for s in spans:
            if s["kind"] == "FREE":  # a dictionary pop: nothing to see at this scale
                continue
            compute = s["kind"] in ("F", "B", "W")
            event = {"ph": "X", "name": s["label"], "cat": s["kind"], "pid": pid, "tid": 0 if compute else 1,
                     "ts": s["start"] * _US, "dur": (s["end"] - s["start"]) * _US}
            if "cpu" in s:  # the thread's processor time in it: the rest was waiting or preempted
                event["args"] = {"cpu_ms": s["cpu"] * 1e3}
            events.append(event)
    return events


def write_measured_trace(ranks: dict[int, list[dict]], path: str | Path,
                         predicted: SimResult | None = None) -> Path:
    """The measured step (one process per rank), beside the simulated one when ``predicted`` is given."""
    events = measured_trace_events(ranks, pid_offset=100 if predicted is not None else 0, label="measured rank")
    if predicted is not None:
        events = trace_events(predicted) + events
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"measured_ranks": sorted(ranks)}}
    path = Path(path)
    write_atomic(path, json.dumps(doc) + "\n")
    return path
