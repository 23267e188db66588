"""Learning-rate schedules and the fp16 loss scale: the numbers the training loop sets each step.

Learning rate, as diffusers' ``get_scheduler`` (transformers' LambdaLR
schedules) gives it for optimizer step ``s`` (0-based) of ``total``::

    warm-up      s < W:  lr * s / max(1, W)                       (step 0 trains at lr 0, as there)
    constant     lr
    linear       lr * max(0, (total - s) / max(1, total - W))
    cosine       lr * 0.5 * (1 + cos(pi * (s - W) / max(1, total - W)))

Dynamic loss scaling (fp16): gradients are computed for ``loss * scale``,
unscaled before clipping; a step whose gradients are not finite is skipped
and halves the scale, ``growth_interval`` good steps in a row double it
(``torch.amp.GradScaler``'s rule, written once for every backend).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pulse.runtime.run_config import LR_SCHEDULES


def learning_rate(base: float, step: int, total: int, schedule: str = "constant", warmup: int = 0) -> float:
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule '{schedule}' ({', '.join(LR_SCHEDULES)})")
    if step < warmup:
        return base * step / max(1, warmup)
    if schedule == "constant":
        return base
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return base * max(0.0, 1.0 - progress)
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class DynamicLossScale:
    """The fp16 loss scale and its bookkeeping; every rank updates it identically (same finite flag)."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    factor: float = 2.0
    good_steps: int = 0
    skipped: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / self.factor, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.factor
            self.good_steps = 0
