"""Placements: contiguous chunks of layers in execution order, each on a device.

::

    sequential (P=4)      chunk: 0 1 2 3          device: 0 1 2 3
    interleaved (v=2)     chunk: 0 1 2 3 4 5 6 7  device: 0 1 2 3 0 1 2 3
    V (P=4)               chunk: 0 1 2 3 4 5 6 7  device: 0 1 2 3 3 2 1 0
    wave (P=4, 2 folds)   chunk: 0 .. 15          device: 0 1 2 3 3 2 1 0 0 1 2 3 3 2 1 0

Under V and wave placements chunk c and chunk 2kP-1-c (its mirror) share a
device, so a skip from an encoder chunk to the decoder layers that consume it
never leaves the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pulse.errors import PlanError

PlacementKind = Literal["sequential", "interleaved", "v", "wave"]
SkipTransport = Literal["relay", "direct"]


@dataclass(frozen=True)
class Chunk:
    start: int  # first layer index
    end: int  # one past the last layer index
    device: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Placement:
    kind: PlacementKind
    num_devices: int
    chunks: tuple[Chunk, ...]
    # relay: skips ride the main path through every boundary they span
    #        (what sequential pipelines do); direct: a non-local skip is sent
    #        once, from its producer's device to its consumer's.
    skip_transport: SkipTransport = "relay"
    partitioner: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))

    @property
    def num_layers(self) -> int:
        return self.chunks[-1].end

    @property
    def chunks_per_device(self) -> int:
        return len(self.chunks) // self.num_devices

    @property
    def folds(self) -> int:
        """V = 1 fold, wave = k folds; sequential and interleaved have none."""
        return self.chunks_per_device // 2 if self.kind in ("v", "wave") else 0

    def chunks_of(self, device: int) -> list[int]:
        return [i for i, c in enumerate(self.chunks) if c.device == device]

    def chunk_of_layer(self, layer: int) -> int:
        for i, c in enumerate(self.chunks):
            if c.start <= layer < c.end:
                return i
        raise PlanError(f"layer {layer} is in no chunk")

    def validate(self, num_layers: int) -> None:
        """Chunks must tile [0, num_layers) with no gap and no overlap."""
        if not self.chunks:
            raise PlanError("placement has no chunks")
        expected = 0
        for i, c in enumerate(self.chunks):
            if c.start != expected:
                kind = "gap" if c.start > expected else "overlap"
                raise PlanError(f"placement: chunk {i} starts at layer {c.start}, expected {expected} ({kind})")
            if c.end <= c.start:
                raise PlanError(f"placement: chunk {i} is empty ({c.start}..{c.end})")
            if not 0 <= c.device < self.num_devices:
                raise PlanError(f"placement: chunk {i} is on device {c.device}, outside 0..{self.num_devices - 1}")
            expected = c.end
        if expected != num_layers:
            raise PlanError(f"placement covers {expected} layers but the model has {num_layers}")
        used = {c.device for c in self.chunks}
        if len(used) != self.num_devices:
            idle = sorted(set(range(self.num_devices)) - used)
            raise PlanError(f"placement leaves device {idle[0]} without work")


def wave_devices(num_devices: int, folds: int) -> list[int]:
    """Device of each of the 2*folds*P chunks: a zigzag 0..P-1, P-1..0, 0..P-1, ..."""
    order: list[int] = []
    for leg in range(2 * folds):
        down = list(range(num_devices))
        order.extend(down if leg % 2 == 0 else down[::-1])
    return order


def interleaved_devices(num_devices: int, chunks_per_device: int) -> list[int]:
    return [c % num_devices for c in range(num_devices * chunks_per_device)]


def from_cuts(kind: PlacementKind, cuts: list[int], devices: list[int], num_devices: int,
              skip_transport: SkipTransport, partitioner: str) -> Placement:
    """Chunks from boundaries ``cuts`` = [0, c1, ..., L] and one device per chunk."""
    if len(cuts) - 1 != len(devices):
        raise PlanError(f"{len(cuts) - 1} chunks but {len(devices)} devices")
    chunks = tuple(Chunk(cuts[i], cuts[i + 1], devices[i]) for i in range(len(devices)))
    return Placement(kind, num_devices, chunks, skip_transport, partitioner)
