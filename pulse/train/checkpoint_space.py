"""Whether a checkpoint fits on its filesystem, decided alike on every rank before any file of it is written.

::

    every rank:  need = its file's bytes (the tensors about to be written, ``pulse_torch.checkpoint``
                        ``payload_bytes``), free = shutil.disk_usage of the checkpoint folder (or its
                        nearest existing parent)
                 ─ one sum_values over the world: [need of rank 0..W-1, free seen by rank 0..W-1] in MiB
    every rank:  the same table ─ fits when every file together, plus HEADROOM, is at most the least
                 free space any rank saw; else the step's checkpoint is skipped as a whole (rank 0 says
                 it in one warning line), the run goes on and the earlier checkpoints stay

Why the sum of every rank's file: step folders live on one filesystem every rank reads
(``pulse.train.checkpoints``), so the files share its free space. Why decide before
writing: a disk that fills mid-checkpoint leaves a partial step the manifest must never
describe, and may take log.json's next write with it. MiB units keep the table exact in a
float32 all-reduce (MindSpore's), up to 16 TiB a figure.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

MIB = 2**20
GIB = 2**30
HEADROOM = 64 * MIB  # left free beyond the files: the manifest, log.json's rewrites, the filesystem's own


def free_bytes(root: Path) -> int:
    """Free bytes where ``root`` is (or will be made: its nearest existing parent)."""
    where = Path(root).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


@dataclass(frozen=True)
class SpaceCheck:
    """Every rank's verdict on one step's checkpoint, from the same summed table."""

    need_bytes: int  # every rank's file together
    free_bytes: int  # the least free space a rank saw

    @property
    def fits(self) -> bool:
        return self.need_bytes + HEADROOM <= self.free_bytes

    def warning(self, step: int, root: Path) -> str:
        return (f"warning: checkpoint: step {step} not written: its files need {self.need_bytes / GIB:.2f} GiB "
                f"(+ {HEADROOM // MIB} MiB kept free) but {root} has {self.free_bytes / GIB:.2f} GiB free; training "
                "goes on, the earlier checkpoints stay")


def space_row(rank: int, world: int, need_bytes: int, free: int) -> list[float]:
    """This rank's share of the table: its need (at least 1 MiB: a reported row is never 0) and free
    space in MiB, everyone else's slots 0."""
    row = [0.0] * (2 * world)
    row[rank] = float(max(1, math.ceil(need_bytes / MIB)))
    row[world + rank] = float(free // MIB)
    return row


def verdict(summed: Sequence[float], world: int) -> SpaceCheck:
    """The decision every rank takes from the summed table (a rank whose need slot is 0 did not report)."""
    reported = [r for r in range(world) if summed[r] > 0]
    need = sum(int(round(summed[r])) for r in reported)
    free = min(int(round(summed[world + r])) for r in reported) if reported else 0
    return SpaceCheck(need * MIB, free * MIB)


def agree_on_space(comm: Any, rank: int, world: int, need_bytes: int, root: Path,
                   timeout: float | None = None) -> SpaceCheck:
    """Collective: every rank's need and free space in one ``sum_values``, one verdict everywhere."""
    summed = comm.sum_values(space_row(rank, world, need_bytes, free_bytes(root)), timeout)
    return verdict(summed, world)
