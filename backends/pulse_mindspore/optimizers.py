"""The optimizer a MindSpore worker steps (``--optimizer``, ``pulse.optimizers``): MindSpore's own.

::

    adamw      mindspore.experimental.optim.AdamW(lr, betas, eps, weight_decay)   torch's interface
    adafactor  mindspore.nn.AdaFactor(learning_rate=lr, weight_decay, relative_step=False,
               scale_parameter=False, warmup_init=False, beta1=0)            the given lr, no first moment

Both are called with a chunk's gradients in its parameters' order; each keeps per-parameter state the
checkpoint saves by parameter name (``state_of``: AdamW's moments; AdaFactor's factored second moment,
rows and columns over a tensor's last two dims, whole for a 1-D one) and one step count per optimizer
(``step_of``). MindSpore 2.10 has no 8-bit AdamW, Lion or Prodigy: those are refused before launch
(``BackendTraits.check_supported`` reads ``pulse.optimizers``' backends) and again here.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor

from pulse.optimizers import check_backend

# what a checkpoint keeps per parameter, by optimizer: the optimizer's ParameterTuple attributes
STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adafactor": ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")}


def build_optimizer(name: str, params: Sequence[Any], lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> Any:
    """``name``'s optimizer over ``params`` (their order is its state's order)."""
    check_backend(name, "mindspore")
    if name == "adafactor":
        from mindspore import nn

        return nn.AdaFactor(list(params), learning_rate=float(lr), weight_decay=weight_decay, relative_step=False,
                            scale_parameter=False, warmup_init=False, beta1=0.0)
    from mindspore.experimental.optim import AdamW

    return AdamW(list(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """The rate of the next step: AdamW's param groups, AdaFactor's ``learning_rate`` parameter."""
    if hasattr(optimizer, "param_groups"):
        for group in optimizer.param_groups:
            group["lr"].set_data(Tensor(lr, ms.float32))
    else:
        optimizer.learning_rate.set_data(Tensor(lr, ms.float32))


def state_of(optimizer: Any, name: str, index: int) -> dict[str, Callable[[], np.ndarray]]:
    """Parameter ``index``'s state arrays by kind (each made when the writer gets to it)."""
    return {kind: getattr(optimizer, kind)[index].asnumpy for kind in STATE[name]}


def set_state(optimizer: Any, name: str, index: int, arrays: dict[str, np.ndarray]) -> None:
    for kind in STATE[name]:
        getattr(optimizer, kind)[index].set_data(Tensor(np.ascontiguousarray(arrays[kind])))


def step_of(optimizer: Any) -> int:
    """How many steps it has taken (AdamW's ``state_step``, AdaFactor's ``step``, which its beta2 schedule reads)."""
    count = optimizer.state_step if hasattr(optimizer, "state_step") else optimizer.step
    return int(count.asnumpy().reshape(-1)[0])


def set_step(optimizer: Any, step: int) -> None:
    if hasattr(optimizer, "state_step"):
        optimizer.state_step.set_data(Tensor(step, ms.int32))
    else:
        optimizer.step.set_data(Tensor(np.array([step], np.float32)))
        optimizer.global_step.set_data(Tensor(np.array([step], np.int32)))
