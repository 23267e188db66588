"""The schedule IR: a frozen ``Action`` and per-device action lists.

Text forms (one device's row is a list of these)::

    0F3      chunk 0, forward, microbatch 3
    5B0      chunk 5, backward (input and weight grads), microbatch 0
    5W0      chunk 5, weight-gradient half of a split backward
    3SF0:4   chunk 3 sends microbatch 0's forward payload to chunk 4
    4RF0:3   chunk 4 receives it;  SB/RB: the same for gradients going back
    5FREE0   release what chunk 5 saved for microbatch 0 (its forward context, the skips it read)
    5AR7     all-reduce chunk 5's gradient bucket over its data-parallel group: launched once
             microbatch 7, the last to accumulate into it, is done (one per chunk)
    1E3      frozen encoder 1 (of the plan's ``EncoderSet``) encodes microbatch 3: forward only,
             nothing saved; here the number before the kind is the encoder, not a chunk
    1SE3:4   encoder 1 sends microbatch 3's output to chunk 4 (a device that reads it)
    4RE3:1   chunk 4 receives it from encoder 1 (before its forward of microbatch 3)

An ``Action`` keeps each number under the name of what it counts: ``chunk`` (None for E and
SE, which run no chunk), ``peer`` (the other chunk of a send/recv; None for RE, whose other end
is an encoder) and ``encoder`` (E, SE, RE only). ``ends`` gives a message's two numbers in text
order, ``task`` the (kind, chunk or encoder, microbatch) key of the task graph.

Generators emit F/B/W; ``pulse.schedule.lower`` adds the rest (the runtime's program).
"""
from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from functools import total_ordering
from pathlib import Path

from pulse.errors import PlanError, PulseError
from pulse.yamlio import check_keys, dump_yaml, load_mapping, read_text, require_number, require_text
from pulse.atomic_io import write_atomic

COMPUTE_KINDS = ("F", "B", "W")
ENCODE_KINDS = ("E",)  # a frozen encoder's forward (pulse.encoders): its own kind, not a chunk's compute
COMM_KINDS = ("SF", "RF", "SB", "RB", "SE", "RE")
MEMORY_KINDS = ("FREE",)
SYNC_KINDS = ("AR",)
KINDS = COMPUTE_KINDS + ENCODE_KINDS + COMM_KINDS + MEMORY_KINDS + SYNC_KINDS
_ENCODER_KINDS = ("E", "SE", "RE")  # the kinds that name an encoder

_TEXT = re.compile(r"^(\d+)(SF|RF|SB|RB|SE|RE|FREE|AR|F|B|W|E)(\d+)(?::(\d+))?$")


@total_ordering
@dataclass(frozen=True)
class Action:
    """One entry of a device's list (text forms in the module docstring).

    ``chunk``: the chunk it runs on or for (None for E and SE: they run an encoder);
    ``peer``: the other chunk of SF/RF/SB/RB/SE (None otherwise: an RE's other end is an encoder);
    ``encoder``: the frozen encoder of E/SE/RE (None otherwise).
    """

    device: int
    chunk: int | None
    microbatch: int
    kind: str
    peer: int | None = None
    encoder: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown action kind '{self.kind}' (known: {', '.join(KINDS)})")
        if self.kind == "RE" and self.encoder is None:
            raise PlanError("action RE: a receive of an encoder's output names that encoder after the colon "
                            "(e.g. 4RE3:1)")
        if (self.kind in ("SF", "RF", "SB", "RB", "SE")) != (self.peer is not None):
            raise PlanError(f"action {self.kind}: send/recv need a peer chunk, compute must not have one")
        if (self.kind in _ENCODER_KINDS) != (self.encoder is not None):
            raise PlanError(f"action {self.kind}: E, SE and RE name an encoder, other kinds must not")
        if (self.kind in ("E", "SE")) != (self.chunk is None):
            raise PlanError(f"action {self.kind}: E and SE run an encoder, not a chunk; every other kind "
                            "names its chunk")

    def __lt__(self, other: "Action") -> bool:
        """The order of (device, first number, microbatch, kind, second number): the text's."""
        if not isinstance(other, Action):
            return NotImplemented
        return self._sort_key() < other._sort_key()

    def _sort_key(self) -> tuple[int, int, int, str, int]:
        first, second = self.ends
        return (self.device, first, self.microbatch, self.kind, -1 if second is None else second)

    @property
    def ends(self) -> tuple[int, int | None]:
        """The numbers before the kind and after the colon: (this end, the other end) of a message
        (SE: encoder, reader chunk; RE: reader chunk, encoder), (chunk or encoder, None) otherwise."""
        if self.kind in ("E", "SE"):
            return self.encoder, self.peer
        if self.kind == "RE":
            return self.chunk, self.encoder
        return self.chunk, self.peer

    @property
    def task(self) -> tuple[str, int, int]:
        """(kind, chunk, microbatch) of an F/B/W/FREE/AR, (E, encoder, microbatch) of an encode:
        a ``pulse.schedule.deps.ComputeKey``."""
        return (self.kind, self.ends[0], self.microbatch)

    @classmethod
    def of_task(cls, device: int, task: tuple[str, int, int]) -> "Action":
        """The action of a task key (``task``'s inverse, for compute and encodes)."""
        kind, index, microbatch = task
        if kind == "E":
            return cls(device, None, microbatch, kind, encoder=index)
        return cls(device, index, microbatch, kind)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_encode(self) -> bool:
        """An encode (E): ``encoder`` runs, no chunk."""
        return self.kind in ENCODE_KINDS

    def prefetches(self, num_microbatches: int) -> bool:
        """An encode action (or its SE / RE) for the next step's microbatch ``microbatch - M``:
        encoded in this step's idle time, read by the next step (``pulse.schedule.encode``)."""
        return self.kind in _ENCODER_KINDS and self.microbatch >= num_microbatches

    @property
    def is_encode_comm(self) -> bool:
        """SE / RE: an encoder's output on its way to a reader chunk."""
        return self.kind in ("SE", "RE")

    @property
    def is_comm(self) -> bool:
        """A point-to-point send or receive (AR is a collective, not a message to one peer)."""
        return self.kind in COMM_KINDS

    @property
    def is_mark(self) -> bool:
        """FREE or AR: takes no compute time on the rank's thread."""
        return self.kind in MEMORY_KINDS + SYNC_KINDS

    @property
    def text(self) -> str:
        first, second = self.ends
        tail = f":{second}" if second is not None else ""
        return f"{first}{self.kind}{self.microbatch}{tail}"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str, device: int) -> "Action":
        match = _TEXT.match(text.strip())
        if not match:
            raise PulseError(f"cannot parse action '{text}' (expected e.g. 0F3, 2B1, 3SF0:4, 2FREE1, 2AR3, 1E3)")
        first, kind, mb, second = match.groups()
        one, two = int(first), None if second is None else int(second)
        if kind in ("E", "SE"):
            return cls(device, None, int(mb), kind, two, encoder=one)
        if kind == "RE":
            return cls(device, one, int(mb), kind, encoder=two)
        return cls(device, one, int(mb), kind, two)


@dataclass(frozen=True)
class Schedule:
    """Ordered actions per device; ``name`` says which generator made it."""

    name: str
    num_microbatches: int
    actions: dict[int, tuple[Action, ...]] = field(hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", {d: tuple(a) for d, a in sorted(self.actions.items())})
        for device, row in self.actions.items():
            for action in row:
                if action.device != device:
                    raise PlanError(f"action {action} is listed under device {device} but belongs to {action.device}")

    @property
    def devices(self) -> list[int]:
        return list(self.actions)

    def compute_only(self) -> "Schedule":
        """F/B/W and the encodes (E): what a generator emits, before lowering."""
        return Schedule(self.name, self.num_microbatches,
                        {d: tuple(a for a in row if a.is_compute or a.is_encode) for d, row in self.actions.items()})

    def without_encodes(self) -> "Schedule":
        """The schedule with its encodes and their messages removed (the encoders cached offline)."""
        return Schedule(self.name, self.num_microbatches,
                        {d: tuple(a for a in row if not (a.is_encode or a.is_encode_comm))
                         for d, row in self.actions.items()})

    @property
    def has_encodes(self) -> bool:
        return any(a.is_encode for row in self.actions.values() for a in row)

    def all_actions(self) -> list[Action]:
        return [a for row in self.actions.values() for a in row]

    # -- serialisation -----------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "num_microbatches": self.num_microbatches,
            "actions": {int(d): " ".join(a.text for a in row) for d, row in self.actions.items()},
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "schedule") -> "Schedule":
        """A schedule from ``to_dict`` data: each device's row is a string of action texts (or a list)."""
        if not isinstance(data, dict):
            raise PulseError(f"{where}: expected a mapping with name, num_microbatches, actions, "
                             f"got {type(data).__name__}")
        check_keys(data, {"num_microbatches", "actions"}, {"name"}, where)
        name = require_text(data, "name", where) if "name" in data else "loaded"
        num_mb = require_number(data, "num_microbatches", where, positive=True, integer=True)
        rows = data["actions"]
        if not isinstance(rows, dict) or not rows:
            raise PulseError(f"{where}: 'actions' must be a non-empty mapping of device -> actions, "
                             f"got {_brief(rows)}")
        actions: dict[int, tuple[Action, ...]] = {}
        for key, row in rows.items():
            device = _device(key, f"{where}: actions")
            if device in actions:
                raise PulseError(f"{where}: actions: device {device} is listed twice")
            at = f"{where}: actions[{device}]"
            if isinstance(row, str):
                texts = row.split()
            elif isinstance(row, list) and all(isinstance(t, str) for t in row):
                texts = row
            elif row is None:
                texts = []
            else:
                raise PulseError(f"{at}: expected action texts such as '0F0 0B0', got {_brief(row)}")
            actions[device] = tuple(_parse(t, device, num_mb, at) for t in texts)
        return cls(name, num_mb, actions)

    def to_csv(self) -> str:
        """One row per device, one column per slot (PyTorch's pipelining CSV layout)."""
        buf = io.StringIO()
        writer = csv.writer(buf)
        for device, row in self.actions.items():
            writer.writerow([device, *[a.text for a in row]])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, name: str, num_microbatches: int | None, *,
                 where: str = "schedule CSV") -> "Schedule":
        """Rows ``device,action,action,...``; ``num_microbatches`` None: one past the largest used."""
        parsed: dict[int, list[tuple[int, str]]] = {}
        try:
            lines = list(csv.reader(io.StringIO(text)))
        except csv.Error as exc:
            raise PulseError(f"{where}: malformed CSV ({exc})") from None
        for line, row in enumerate(lines, 1):
            if not row or not any(cell.strip() for cell in row):
                continue
            device = _device(row[0].strip(), f"{where}: line {line}")
            if device in parsed:
                raise PulseError(f"{where}: line {line}: device {device} already has a row")
            parsed[device] = [(line, t) for t in row[1:] if t.strip()]
        if not parsed:
            raise PulseError(f"{where}: no rows; expected one 'device,action,action,...' row per device")
        if num_microbatches is None:
            largest = -1
            for device, cells in parsed.items():
                for line, t in cells:
                    action = _parse(t, device, None, f"{where}: line {line}")
                    if action.kind not in _ENCODER_KINDS:  # encodes may name the next step's
                        largest = max(largest, action.microbatch)
            num_microbatches = largest + 1
        if num_microbatches < 1:
            raise PulseError(f"{where}: no compute actions; a schedule needs at least one microbatch")
        actions = {device: tuple(_parse(t, device, num_microbatches, f"{where}: line {line}") for line, t in cells)
                   for device, cells in parsed.items()}
        return cls(name, num_microbatches, actions)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix == ".csv":
            write_atomic(path, self.to_csv())
        elif path.suffix == ".json":
            write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")
        else:
            write_atomic(path, dump_yaml(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path, *, name: str = "loaded", num_microbatches: int | None = None) -> "Schedule":
        """A YAML/JSON (``to_dict``) or CSV (``to_csv``) schedule; CSV needs the microbatch count
        from the caller or takes one past the largest microbatch it names."""
        path = Path(path)
        if path.suffix == ".csv":
            return cls.from_csv(read_text(path), name, num_microbatches, where=str(path))
        return cls.from_dict(load_mapping(path), where=str(path))


def _brief(value: object) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _device(key: object, where: str) -> int:
    """A device index: a whole number >= 0 (JSON and CSV give it as text)."""
    if isinstance(key, str) and key.strip().isdigit() and key.strip().isascii():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise PulseError(f"{where}: device must be a whole number >= 0, got {_brief(key)}")


def _parse(text: str, device: int, num_microbatches: int | None, where: str) -> Action:
    """``Action.parse`` with the file and device in the error, and the microbatch range checked."""
    try:
        action = Action.parse(text, device)
    except PulseError as exc:  # one line even for a CSV cell with a newline inside quotes
        raise PulseError(f"{where}: {' '.join(str(exc).split())}") from None
    # an encode's M + m is the next step's microbatch m (prefetched in this step's idle time)
    limit = None if num_microbatches is None else num_microbatches * (2 if action.kind in _ENCODER_KINDS else 1)
    if limit is not None and action.microbatch >= limit:
        raise PulseError(f"{where}: action {action} names microbatch {action.microbatch}, "
                         f"but the schedule has {num_microbatches} (0..{limit - 1})")
    return action
