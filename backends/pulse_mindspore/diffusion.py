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
from mindspore import Tensor

from pulse.errors import PulseError
from pulse.spec import ModelSpec
from pulse_mindspore.layers.inputs import NUM_TRAIN_TIMESTEPS, latent_shape, make_inputs
from pulse_mindspore.model import MAIN, to_tensor

TARGET = "target"  # the batch entry holding the noise the model must predict


def linear_alphas_cumprod(num_steps: int = NUM_TRAIN_TIMESTEPS, beta_start: float = 1e-4,
                          beta_end: float = 0.02) -> np.ndarray:
    """abar_t of DDPM's linear schedule (Ho et al. 2020), float64."""
    return np.cumprod(1.0 - np.linspace(beta_start, beta_end, num_steps, dtype=np.float64))


def q_sample(x0: np.ndarray, t: np.ndarray, noise: np.ndarray,
             alphas_cumprod: np.ndarray | None = None) -> np.ndarray:
    """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, float32, broadcast over the non-batch axes."""
    abar = (linear_alphas_cumprod() if alphas_cumprod is None else alphas_cumprod)[t]
    view = (-1,) + (1,) * (x0.ndim - 1)
    signal = np.sqrt(abar).astype(np.float32).reshape(view)
    sigma = np.sqrt(1.0 - abar).astype(np.float32).reshape(view)
    return signal * x0 + sigma * noise


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
    """Epsilon-prediction MSE and its gradient with respect to the model output (fp32)."""
    out = outputs[MAIN]
    target = batch[TARGET]
    if tuple(out.shape) != tuple(target.shape):
        raise PulseError(f"model output {tuple(out.shape)} does not match the noise target {tuple(target.shape)}")
    diff = out.astype(ms.float32) - to_tensor(target)
    loss = float((diff * diff).mean().asnumpy())
    return loss, {MAIN: (diff * (2.0 / diff.size)).astype(out.dtype)}
