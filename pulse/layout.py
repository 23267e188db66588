"""Which global rank runs which pipeline stage of which data-parallel replica.

One pipeline per replica, stages contiguous so that a pipeline stays inside a
node when it fits::

    rank = replica * pp + stage        pipeline group of a rank: its replica's stages
                                       data-parallel group: the same stage in every replica

Every launcher, runtime and simulator asks this class; nobody writes the formula again.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    rank: int = 0

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        return (self.replica if replica is None else replica) * self.pp + stage

    def dp_ranks(self) -> list[int]:
        """This rank's data-parallel group: its stage in every replica."""
        return self.stage_ranks(self.stage)

    def pp_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline replica, by stage."""
        return self.replica_ranks(self.replica)

    def stage_ranks(self, stage: int) -> list[int]:
        """The data-parallel group of pipeline stage ``stage``: that stage in every replica."""
        return [self.rank_of(stage, r) for r in range(self.dp)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The pipeline of replica ``replica``, by stage."""
        return [self.rank_of(s, replica) for s in range(self.pp)]
