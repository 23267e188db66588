"""Which samples a (step, replica, microbatch) trains on, the same for every backend.

Epochs of seeded permutations; sample positions run step-major, then replica,
then microbatch, so a step reads the next ``dp * M * b`` samples of the stream
whatever the layout (a resumed or resharded run continues the same stream).
"""
from __future__ import annotations

import hashlib

import numpy as np


def seeded(seed: int, *keys: object) -> np.random.Generator:
    """A generator fixed by ``seed`` and any printable keys (step, replica, names, ...)."""
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class Sampler:
    def __init__(self, num_samples: int, microbatch_size: int, num_microbatches: int, dp: int,
                 seed: int) -> None:
        self.n, self.b, self.m, self.dp, self.seed = num_samples, microbatch_size, num_microbatches, dp, seed
        self._perms: dict[int, np.ndarray] = {}

    def indices(self, step: int, replica: int, microbatch: int) -> np.ndarray:
        """Sample indices (int64) of one microbatch."""
        start = ((step * self.dp + replica) * self.m + microbatch) * self.b
        return np.array([self._perm(p // self.n)[p % self.n] for p in range(start, start + self.b)], dtype=np.int64)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # steps move forward: keep only recent epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = seeded(self.seed, "epoch", epoch).permutation(self.n)
        return self._perms[epoch]
