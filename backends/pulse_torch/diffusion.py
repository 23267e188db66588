"""DDPM training math: the noise schedule, forward noising and the epsilon-prediction loss.

::

    x0 (clean latent) ──q_sample(t, eps)──▶ x_t ──model(x_t, t, context)──▶ eps_hat
                                                   loss = mean((eps_hat - eps)^2)

The pipeline's first chunk reads ``x_t`` as its main-path input "h"; the last
chunk's rank calls ``eps_loss(outputs, batch)``, which returns the loss and
d loss / d "h" in closed form (no autograd graph needed: the loss is the last
op, so its gradient is exact and cheap), as ``pulse.runtime.LossFn`` expects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch
from torch import Tensor

from pulse.errors import PulseError
from pulse_torch.layers.inputs import NUM_TRAIN_TIMESTEPS  # the T the timestep embeddings expect

MAIN = "h"  # the main-path payload name (pulse.runtime.wiring.MAIN)
TARGET = "target"  # the batch entry holding the noise the model must predict
BetaSchedule = Literal["linear", "scaled_linear"]
_DEFAULT_BETAS = {"linear": (1e-4, 0.02), "scaled_linear": (0.00085, 0.012)}


@dataclass(frozen=True)
class NoiseSchedule:
    """Cumulative signal rates of a DDPM; ``alphas_cumprod[t]`` is abar_t (float64, CPU)."""

    kind: str
    betas: Tensor
    alphas_cumprod: Tensor

    @property
    def num_steps(self) -> int:
        return int(self.betas.numel())

    def coefficients(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(sqrt(abar_t), sqrt(1 - abar_t)) for integer timesteps ``t`` of shape (B,), fp32."""
        if t.dtype not in (torch.int32, torch.int64):
            raise PulseError(f"timesteps must be integers, got {t.dtype}")
        if int(t.min()) < 0 or int(t.max()) >= self.num_steps:
            raise PulseError(f"timesteps must lie in [0, {self.num_steps}), got {int(t.min())}..{int(t.max())}")
        abar = self.alphas_cumprod[t.cpu()]
        return abar.sqrt().float().to(t.device), (1.0 - abar).sqrt().float().to(t.device)


def make_schedule(kind: BetaSchedule = "linear", num_steps: int = NUM_TRAIN_TIMESTEPS,
                  beta_start: float | None = None, beta_end: float | None = None) -> NoiseSchedule:
    """``linear``: DDPM (Ho et al. 2020), betas 1e-4..0.02 evenly spaced.
    ``scaled_linear``: Stable Diffusion, sqrt(beta) evenly spaced over 0.00085..0.012."""
    if num_steps < 1:
        raise PulseError(f"a noise schedule needs at least one step, got {num_steps}")
    if kind not in _DEFAULT_BETAS:
        raise PulseError(f"unknown beta schedule '{kind}' (linear, scaled_linear)")
    lo = _DEFAULT_BETAS[kind][0] if beta_start is None else beta_start
    hi = _DEFAULT_BETAS[kind][1] if beta_end is None else beta_end
    if not 0 < lo <= hi < 1:
        raise PulseError(f"betas must satisfy 0 < start <= end < 1, got {lo}..{hi}")
    if kind == "linear":
        betas = torch.linspace(lo, hi, num_steps, dtype=torch.float64)
    else:  # scaled_linear
        betas = torch.linspace(lo ** 0.5, hi ** 0.5, num_steps, dtype=torch.float64) ** 2
    return NoiseSchedule(kind, betas, torch.cumprod(1.0 - betas, dim=0))


def q_sample(schedule: NoiseSchedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, broadcast over every non-batch dimension."""
    if noise.shape != x0.shape:
        raise PulseError(f"noise shape {tuple(noise.shape)} differs from the latent's {tuple(x0.shape)}")
    signal, sigma = schedule.coefficients(t)
    view = (-1,) + (1,) * (x0.dim() - 1)
    return signal.view(view).to(x0.dtype) * x0 + sigma.view(view).to(x0.dtype) * noise


def eps_loss(outputs: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> tuple[float, dict[str, Tensor]]:
    """Epsilon-prediction MSE and its gradient with respect to the model output.

    Computed in fp32 whatever the output's dtype (autocast may hand us bf16);
    the gradient goes back in the output's dtype, as autograd would return it.
    A learned-variance output (DiT: twice the latent's channels, epsilon
    first) trains its epsilon half; the variance half gets a zero gradient
    (no variational-bound term here).
    """
    out = outputs[MAIN]
    target = batch[TARGET]
    eps = out
    if out.dim() == target.dim() and out.shape[1] == 2 * target.shape[1]:
        eps = out[:, : target.shape[1]]
    if eps.shape != target.shape:
        raise PulseError(f"model output {tuple(out.shape)} does not match the noise target {tuple(target.shape)}")
    diff = eps.detach().float() - target.float()
    loss = float((diff * diff).mean())
    grad = diff * (2.0 / diff.numel())
    if eps is not out:
        grad = torch.cat([grad, torch.zeros_like(grad)], dim=1)
    return loss, {MAIN: grad.to(out.dtype)}
