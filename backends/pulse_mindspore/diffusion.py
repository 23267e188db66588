"""The MindSpore backend's training loss: the epsilon-prediction MSE with a closed-form gradient.

The loss of ``pulse_torch.diffusion`` (loss = mean((eps_hat - eps)^2)), as
``pulse.runtime.LossFn`` expects; the batches are ``pulse.data.feed``'s, the
same arrays for every backend::

    eps_loss({"h": eps_hat}, batch) -> (loss, {"h": d loss / d eps_hat})
"""
from __future__ import annotations

from typing import Any, Mapping

import mindspore as ms
from mindspore import Tensor, ops

from pulse.errors import PulseError
from pulse_mindspore.model import MAIN, to_tensor

TARGET = "target"  # the batch entry holding the noise the model must predict
LOSS_WEIGHT = "loss_weight"  # per-sample MSE weights (pulse.data.feed: min-SNR); absent: all 1


def eps_loss(outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> tuple[float, dict[str, Tensor]]:
    """The MSE to the target and its gradient with respect to the model output (fp32).

    A learned-variance output (DiT: twice the target's channels, the prediction first) trains
    its prediction half; the variance half gets a zero gradient, as in ``pulse_torch.diffusion``.
    Per-sample weights w (``--snr-gamma``): mean_i(w_i * mean(diff_i^2)), as there.
    """
    out = outputs[MAIN]
    target = to_tensor(batch[TARGET])
    pred = out
    if len(out.shape) == len(target.shape) and out.shape[1] == 2 * target.shape[1]:
        pred = out[:, : target.shape[1]]
    if tuple(pred.shape) != tuple(target.shape):
        raise PulseError(f"model output {tuple(out.shape)} does not match the target {tuple(target.shape)}")
    diff = pred.astype(ms.float32) - target
    weights = batch.get(LOSS_WEIGHT)
    if weights is None:
        loss = float((diff * diff).mean().asnumpy())
        grad = diff * (2.0 / diff.size)
    else:
        w = to_tensor(weights).astype(ms.float32).reshape((-1,) + (1,) * (len(diff.shape) - 1))
        loss = float(((diff * diff).mean(axis=tuple(range(1, len(diff.shape)))) * w.reshape(-1)).mean().asnumpy())
        grad = diff * w * (2.0 / diff.size)
    if pred is not out:
        grad = ops.cat([grad, ops.zeros_like(grad)], axis=1)
    return loss, {MAIN: grad.astype(out.dtype)}
