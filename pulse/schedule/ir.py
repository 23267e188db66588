"""The schedule IR: a frozen ``Action`` and per-device action lists.

Text forms (one device's row is a list of these)::

    0F3      chunk 0, forward, microbatch 3
    5B0      chunk 5, backward (input and weight grads), microbatch 0
    5W0      chunk 5, weight-gradient half of a split backward
    3SF0:4   chunk 3 sends microbatch 0's forward payload to chunk 4
    4RF0:3   chunk 4 receives it;  SB/RB: the same for gradients going back
"""
from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pulse.errors import PlanError, PulseError
from pulse.yamlio import dump_yaml, load_mapping, write_atomic

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SF", "RF", "SB", "RB")
KINDS = COMPUTE_KINDS + COMM_KINDS

_TEXT = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|W)(\d+)(?::(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    device: int
    chunk: int
    microbatch: int
    kind: str
    peer: int | None = None  # the other chunk of a send/recv

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown action kind '{self.kind}' (known: {', '.join(KINDS)})")
        if (self.kind in COMM_KINDS) != (self.peer is not None):
            raise PlanError(f"action {self.kind}: send/recv need a peer chunk, compute must not have one")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def text(self) -> str:
        tail = f":{self.peer}" if self.peer is not None else ""
        return f"{self.chunk}{self.kind}{self.microbatch}{tail}"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str, device: int) -> "Action":
        match = _TEXT.match(text.strip())
        if not match:
            raise PulseError(f"cannot parse action '{text}' (expected e.g. 0F3, 2B1, 3SF0:4)")
        chunk, kind, mb, peer = match.groups()
        return cls(device, int(chunk), int(mb), kind, None if peer is None else int(peer))


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
        return Schedule(self.name, self.num_microbatches,
                        {d: tuple(a for a in row if a.is_compute) for d, row in self.actions.items()})

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
        try:
            rows = data["actions"]
            actions = {
                int(d): tuple(Action.parse(t, int(d)) for t in str(row).split())
                for d, row in rows.items()
            }
            return cls(str(data.get("name", "loaded")), int(data["num_microbatches"]), actions)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PulseError(f"{where}: not a schedule ({exc!r}); expected name, num_microbatches, actions") from None

    def to_csv(self) -> str:
        """One row per device, one column per slot (PyTorch's pipelining CSV layout)."""
        buf = io.StringIO()
        writer = csv.writer(buf)
        for device, row in self.actions.items():
            writer.writerow([device, *[a.text for a in row]])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, name: str, num_microbatches: int) -> "Schedule":
        actions = {}
        for row in csv.reader(io.StringIO(text)):
            if not row:
                continue
            device = int(row[0])
            actions[device] = tuple(Action.parse(t, device) for t in row[1:] if t.strip())
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
        path = Path(path)
        if path.suffix == ".csv":
            if num_microbatches is None:
                text = path.read_text()
                num_microbatches = 1 + max(
                    (Action.parse(t, 0).microbatch for row in csv.reader(io.StringIO(text)) for t in row[1:] if t.strip()),
                    default=-1,
                )
            return cls.from_csv(path.read_text(), name, num_microbatches)
        return cls.from_dict(load_mapping(path), where=str(path))
