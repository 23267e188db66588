"""DDPM training data and loss for the MindSpore backend: noised batches and the epsilon-prediction MSE.

The maths of ``pulse_torch.diffusion`` (linear DDPM betas, ``x_t = sqrt(abar_t)
x0 + sqrt(1 - abar_t) eps``, loss = mean((eps_hat - eps)^2)) with numpy for
the data and a closed-form gradient for the loss, as ``pulse.runtime.LossFn``
expects::

    batch(mb) = {"h": x_t, data shared inputs, "target": eps}   (MindSpore tensors)
    eps_loss({"h": eps_hat}, batch) -> (loss, {"h": d loss / d eps_hat})
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from pulse.data.noise import noise_schedule
from pulse.errors import PulseError
from pulse.spec import ModelSpec
from pulse_mindspore.layers.inputs import NUM_TRAIN_TIMESTEPS, latent_shape, make_inputs
from pulse_mindspore.model import MAIN, to_tensor

TARGET = "target"  # the batch entry holding the noise the model must predict
LOSS_WEIGHT = "loss_weight"  # per-sample MSE weights (pulse.data.feed: min-SNR); absent: all 1


LINEAR = noise_schedule("linear", NUM_TRAIN_TIMESTEPS)


def q_sample(x0: np.ndarray, t: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps under DDPM's linear betas (``pulse.data.noise``)."""
    return LINEAR.add_noise(x0, noise, t)


def output_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    """The model output's shape: the latent's grid, with as many channels as the last layer makes."""
    _, height, width = latent_shape(spec)
    channels = spec.layers[-1].out_bytes // spec.act_bytes // (height * width)
    return (batch, channels, height, width)


def make_batches(spec: ModelSpec, microbatch_size: int, seed: int = 0,
                 replica: int = 0) -> Callable[[int], dict[str, Tensor]]:
    """Noised latents as "h", the data shared inputs, and the noise as "target", per microbatch.

    The same (seed, replica, microbatch) gives the same batch every call. A
    model predicting more channels than the latent has (DiT's learned
    variance) gets standard-normal targets for the extra channels.
    """
    def batch(mb: int) -> dict[str, Tensor]:
        g = np.random.default_rng([seed, replica, mb])
        x0, shared = make_inputs(spec, microbatch_size, g)
        noise = g.standard_normal(x0.shape, dtype=np.float32)
        t = shared.get("timesteps")
        h = q_sample(x0, t, noise) if t is not None else x0
        out_shape = output_shape(spec, microbatch_size)
        target = noise
        if out_shape[1] > noise.shape[1]:
            extra = g.standard_normal((out_shape[0], out_shape[1] - noise.shape[1], *out_shape[2:]),
                                      dtype=np.float32)
            target = np.concatenate([noise, extra], axis=1)
        return {k: to_tensor(v) for k, v in {MAIN: h, **shared, TARGET: target}.items()}

    return batch


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
