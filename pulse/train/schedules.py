"""Learning-rate schedules and the fp16 loss scale: the numbers the training loop sets each step.

Learning rate, as diffusers' ``get_scheduler`` (transformers' LambdaLR
schedules) gives it for optimizer step ``s`` (0-based) of ``total``::

    warm-up      s < W:  lr * s / max(1, W)                       (step 0 trains at lr 0, as there)
    constant     lr
    linear       lr * max(0, (total - s) / max(1, total - W))
    cosine       lr * 0.5 * (1 + cos(pi * (s - W) / max(1, total - W)))

EMA decay, as diffusers' ``EMAModel.get_decay`` gives it for its ``u``-th update
(``u`` = 1, 2, ...; the average starts as the weights before update 1, so update 1,
at decay 0, makes it the weights after step 1), with t = u - 1::

    t = 0:          0
    default:        min(decay, (1 + t) / (10 + t))
    power (P, G):   min(decay, 1 - (1 + t / G) ** -P)       (diffusers' use_ema_warmup=True)

Dynamic loss scaling (fp16): gradients are computed for ``loss * scale``,
unscaled before clipping; a step whose gradients are not finite is skipped
and halves the scale, ``growth_interval`` good steps in a row double it
(``torch.amp.GradScaler``'s rule, written once for every backend).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pulse.train.run_config import LR_SCHEDULES


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


def ema_decay(decay: float, update: int, power: float | None = None, inv_gamma: float = 1.0) -> float:
    """The decay of EMA update ``update`` (1-based; diffusers' ``optimization_step``), warmed up as diffusers'
    ``EMAModel`` does by default (``power`` None) or by its power schedule (``use_ema_warmup``)."""
    t = update - 1
    if t <= 0:
        return 0.0
    warm = (1 + t) / (10 + t) if power is None else 1 - (1 + t / inv_gamma) ** -power
    return min(warm, decay)


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
