"""The optimizer a PyTorch rank steps (``--optimizer``; what each keeps: ``pulse.optimizers``), built from
the run's settings with the library class users know::

    adamw      torch.optim.AdamW(lr, betas, eps, weight_decay)
    adafactor  transformers.optimization.Adafactor(lr, weight_decay, relative_step=False,
               scale_parameter=False, warmup_init=False)        the given lr, as kohya's scripts run it
    adamw8bit  bitsandbytes.optim.AdamW8bit(lr, betas, eps, weight_decay)
    lion       lion_pytorch.Lion(lr, weight_decay)              its own betas (0.9, 0.99)
    prodigy    prodigyopt.Prodigy(lr, betas, eps, weight_decay)

Which parameters one optimizer steps (``optimizer_of``): an element-wise optimizer is built per chunk
(one per chunk equals one over the model: each update reads only its parameter's state); Prodigy, whose
step size d sums over every parameter it steps, is one optimizer over all of a rank's chunks, so a rank
at pp 1 steps the whole model as one device would (pp > 1 is refused: ``pulse.optimizers.check_pipeline``).
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from pulse.errors import PulseError
from pulse.optimizers import check_installed, optimizer_kind


@dataclass(frozen=True)
class OptimizerSettings:
    """What a run's optimizer is built with (``RunConfig``'s --optimizer, --lr, --adam-*, --weight-decay)."""

    name: str = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # torch's one-pass _fused_adamw_ kernel (CPU from torch 2.4)


def _adamw(params: list[Tensor], s: OptimizerSettings) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel: the same update in one pass over each tensor. The
    per-tensor loop makes two temporaries of every parameter's size a step; on a CPU it took an
    SD v2-size resnet block 0.4-0.6 s a step against the fused kernel's 0.07-0.09 s."""
    kwargs = dict(lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)
    if params and all(p.device.type in FUSED_ADAMW_DEVICES for p in params):
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except RuntimeError:  # an older torch without the CPU kernel
            pass
    return torch.optim.AdamW(params, **kwargs)


def _adafactor(params: list[Tensor], s: OptimizerSettings) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=s.lr, weight_decay=s.weight_decay, relative_step=False, scale_parameter=False,
                     warmup_init=False)


def _adamw8bit(params: list[Tensor], s: OptimizerSettings) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)


def _lion(params: list[Tensor], s: OptimizerSettings) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(params, lr=s.lr, weight_decay=s.weight_decay)


def _prodigy(params: list[Tensor], s: OptimizerSettings) -> torch.optim.Optimizer:
    from prodigyopt import Prodigy

    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Using decoupled weight decay" on every rank
        return Prodigy(params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)


BUILDERS: dict[str, Callable[[list[Tensor], OptimizerSettings], torch.optim.Optimizer]] = {
    "adamw": _adamw, "adafactor": _adafactor, "adamw8bit": _adamw8bit, "lion": _lion, "prodigy": _prodigy}
BNB_DEVICES = ("cpu", "cuda", "xpu")  # where bitsandbytes' 8-bit optimizers have kernels


def build_optimizer(settings: OptimizerSettings, params: list[Tensor]) -> torch.optim.Optimizer:
    """``settings.name``'s optimizer over ``params``; one line where its library or device support is missing."""
    check_installed(settings.name)
    devices = {p.device.type for p in params}
    if settings.name == "adamw8bit" and devices - set(BNB_DEVICES):
        raise PulseError(f"--optimizer adamw8bit: bitsandbytes has no 8-bit optimizer kernels for "
                         f"{sorted(devices - set(BNB_DEVICES))[0]} devices; use --optimizer adafactor or adamw")
    return BUILDERS[settings.name](params, settings)


def optimizer_of(chunk: Any, chunks: Sequence[Any], settings: OptimizerSettings,
                 trainable: Callable[[Any], list[Tensor]]) -> torch.optim.Optimizer:
    """``chunk``'s optimizer (``chunk.optimizer``), built on first use: its own for an element-wise optimizer;
    for Prodigy one over every chunk of ``chunks`` (the rank's), set on each of them."""
    if chunk.optimizer is None:
        if optimizer_kind(settings.name).elementwise:
            chunk.optimizer = build_optimizer(settings, trainable(chunk))
        else:
            shared = build_optimizer(settings, [p for c in chunks for p in trainable(c)])
            for c in chunks:
                c.optimizer = shared
    return chunk.optimizer


def steps_here(chunk: Any, chunks: Sequence[Any], trainable: Callable[[Any], list[Tensor]]) -> bool:
    """Whether ``chunk``'s call steps its optimizer: always for its own; a shared one steps once, at the
    first of its chunks that trains (the loop steps a rank's chunks after the whole step's backward)."""
    sharing = [c for c in chunks if c.optimizer is chunk.optimizer and trainable(c)]
    return not sharing or sharing[0] is chunk


def group_state(optimizer: torch.optim.Optimizer, name: str) -> dict[str, float]:
    """What ``name``'s optimizer learned in its param group (Prodigy's d and its sums), as plain numbers."""
    group = optimizer.param_groups[0]
    return {k: float(group[k]) for k in optimizer_kind(name).group_state if k in group}


def set_group_state(optimizer: torch.optim.Optimizer, saved: dict[str, float]) -> None:
    """Put back what ``group_state`` saved (``k``, Prodigy's step count, as the integer it keeps)."""
    for group in optimizer.param_groups:
        for k, v in saved.items():
            group[k] = int(v) if k == "k" else v
