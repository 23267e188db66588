"""The diffusion loss in torch: mean((model output - target)^2), target = eps or v (``pulse.data.noise``).

The pipeline's first chunk reads ``x_t`` as its main-path input "h"; the last
chunk's rank calls ``eps_loss(outputs, batch)``, which returns the loss and
d loss / d "h" in closed form (no autograd graph needed: the loss is the last
op, so its gradient is exact and cheap), as ``pulse.runtime.LossFn`` expects.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from pulse.errors import PulseError

MAIN = "h"  # the main-path payload name (pulse.runtime.wiring.MAIN)
TARGET = "target"  # the batch entry the output regresses onto (pulse.data.feed)
LOSS_WEIGHT = "loss_weight"  # per-sample MSE weights (pulse.data.feed: min-SNR); absent: all 1


def eps_loss(outputs: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Epsilon-prediction MSE (a 0-d float32 tensor where the output is: reading it would make
    the host wait for the device) and its gradient with respect to the model output.

    Computed in fp32 whatever the output's dtype (autocast may hand us bf16);
    the gradient goes back in the output's dtype, as autograd would return it.
    A learned-variance output (DiT: twice the latent's channels, epsilon
    first) trains its epsilon half; the variance half gets a zero gradient
    (no variational-bound term here). With per-sample weights w (``--snr-gamma``) the loss is
    diffusers' ``mean_i(w_i * mean(diff_i^2))``.
    """
    out = outputs[MAIN]
    target = batch[TARGET]
    eps = out
    if out.dim() == target.dim() and out.shape[1] == 2 * target.shape[1]:
        eps = out[:, : target.shape[1]]
    if eps.shape != target.shape:
        raise PulseError(f"model output {tuple(out.shape)} does not match the noise target {tuple(target.shape)}")
    diff = eps.detach().float() - target.float()
    weights = batch.get(LOSS_WEIGHT)
    if weights is None:
        loss = (diff * diff).mean()
        grad = diff * (2.0 / diff.numel())
    else:
        w = weights.float().reshape(-1, *[1] * (diff.dim() - 1))
        loss = ((diff * diff).mean(dim=tuple(range(1, diff.dim()))) * w.reshape(-1)).mean()
        grad = diff * w * (2.0 / diff.numel())
    if eps is not out:
        grad = torch.cat([grad, torch.zeros_like(grad)], dim=1)
    return loss, {MAIN: grad.to(out.dtype)}
