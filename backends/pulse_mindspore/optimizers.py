"""The optimizer a MindSpore worker steps (``--optimizer``, ``pulse.optimizers``).

::

    adamw      EagerAdamW(lr, betas, eps, weight_decay): torch.optim.AdamW's update in PyNative ops
    adafactor  mindspore.nn.AdaFactor(learning_rate=lr, weight_decay, relative_step=False,
               scale_parameter=False, warmup_init=False, beta1=0)            the given lr, no first moment

Not ``mindspore.experimental.optim.AdamW``: it runs as one compiled graph whose intermediates the CPU
runtime's pool keeps, about 40 bytes a parameter beyond the moments (320 M float32 parameters held
18.0 GiB after a step against a 5.0 GiB floor, the eager update 5.6: benchmarks/mindspore_adamw_memory.py),
which put SD v2's pp 2 worker 1 out of memory in its first step on this 23 GiB host.

Both are called with a chunk's gradients in its parameters' order; each keeps per-parameter state the
checkpoint saves by parameter name (``state_of``: AdamW's moments; AdaFactor's factored second moment,
rows and columns over a tensor's last two dims, whole for a 1-D one) and one step count per optimizer
(``step_of``). MindSpore 2.10 has no 8-bit AdamW, Lion or Prodigy: those are refused before launch
(``BackendTraits.check_supported`` reads ``pulse.optimizers``' backends) and again here.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from pulse.optimizers import check_backend

# what a checkpoint keeps per parameter, by optimizer: the optimizer's lists of Parameters
STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adafactor": ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")}


def build_optimizer(name: str, params: Sequence[Any], lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> Any:
    """``name``'s optimizer over ``params`` (their order is its state's order)."""
    check_backend(name, "mindspore")
    if name == "adafactor":
        from mindspore import nn

        return nn.AdaFactor(list(params), learning_rate=float(lr), weight_decay=weight_decay, relative_step=False,
                            scale_parameter=False, warmup_init=False, beta1=0.0)
    return EagerAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class EagerAdamW:
    """``torch.optim.AdamW`` (its single-tensor update, in its order), one parameter at a time in PyNative ops.

    Each parameter's update holds a few of its own tensor-sized temporaries, freed before the next
    parameter's (``ops.assign`` writes the results into the parameter and its moments); a compiled graph
    over all of them holds every one's at once. ``Tensor.mul_`` and friends are no help: on the CPU in
    MindSpore 2.10 they return the product and leave the tensor as it was. The step count and learning
    rate are host numbers: a step reads nothing back from the device."""

    def __init__(self, params: Sequence[Parameter], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self.params = list(params)
        self.exp_avg = [Parameter(ops.zeros_like(p), name=f"exp_avg.{p.name}") for p in self.params]
        self.exp_avg_sq = [Parameter(ops.zeros_like(p), name=f"exp_avg_sq.{p.name}") for p in self.params]
        self.steps = 0
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), betas, eps, weight_decay

    def __call__(self, grads: Sequence[Tensor]) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        step_size = self.lr / (1 - beta1 ** self.steps)
        root = math.sqrt(1 - beta2 ** self.steps)
        for p, g, m, v in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            g = g.astype(p.dtype)
            ops.assign(p, p * (1 - self.lr * self.weight_decay))
            ops.assign(m, ops.lerp(m, g, 1 - beta1))
            ops.assign(v, v * beta2 + g * g * (1 - beta2))
            ops.assign(p, p - step_size * (m / (ops.sqrt(v) / root + self.eps)))


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """The rate of the next step: AdamW's, AdaFactor's ``learning_rate`` parameter."""
    if isinstance(optimizer, EagerAdamW):
        optimizer.lr = float(lr)
    else:
        optimizer.learning_rate.set_data(Tensor(lr, ms.float32))


def state_of(optimizer: Any, name: str, index: int) -> dict[str, Callable[[], np.ndarray]]:
    """Parameter ``index``'s state arrays by kind (each made when the writer gets to it)."""
    return {kind: getattr(optimizer, kind)[index].asnumpy for kind in STATE[name]}


def set_state(optimizer: Any, name: str, index: int, arrays: dict[str, np.ndarray]) -> None:
    for kind in STATE[name]:
        getattr(optimizer, kind)[index].set_data(Tensor(np.ascontiguousarray(arrays[kind])))


def step_of(optimizer: Any) -> int:
    """How many steps it has taken (AdamW's ``steps``, AdaFactor's ``step``, which its beta2 schedule reads)."""
    if isinstance(optimizer, EagerAdamW):
        return optimizer.steps
    return int(optimizer.step.asnumpy().reshape(-1)[0])


def set_step(optimizer: Any, step: int) -> None:
    if isinstance(optimizer, EagerAdamW):
        optimizer.steps = int(step)
    else:
        optimizer.step.set_data(Tensor(np.array([step], np.float32)))
        optimizer.global_step.set_data(Tensor(np.array([step], np.int32)))
