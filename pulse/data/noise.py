"""DDPM noising and targets in numpy (what diffusers' ``DDPMScheduler.add_noise`` / ``get_velocity`` do)::

    x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps
    target: eps (epsilon prediction) or v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0 (v-prediction)

Min-SNR loss weights (``--snr-gamma``), as diffusers' ``train_text_to_image.py`` with
``compute_snr``: SNR_t = abar_t / (1 - abar_t) (+ 1 for v-prediction), weight = min(SNR, gamma) / SNR.

Betas: ``linear`` (DDPM, 1e-4..0.02) or ``scaled_linear`` (Stable Diffusion: sqrt(beta)
evenly spaced over 0.00085..0.012), over ``num_steps`` training timesteps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pulse.errors import PulseError

from pulse.train.run_config import PREDICTION_TYPES
_DEFAULT_BETAS = {"linear": (1e-4, 0.02), "scaled_linear": (0.00085, 0.012)}


@dataclass(frozen=True)
class NoiseSchedule:
    kind: str
    alphas_cumprod: np.ndarray  # abar_t, float64

    @property
    def num_steps(self) -> int:
        return int(self.alphas_cumprod.shape[0])

    def _rates(self, t: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        if t.dtype.kind not in "iu" or t.min() < 0 or t.max() >= self.num_steps:
            raise PulseError(f"timesteps must be integers in [0, {self.num_steps}), got {t.dtype} "
                             f"{t.min()}..{t.max()}")
        abar = self.alphas_cumprod[t]
        view = (-1,) + (1,) * (ndim - 1)
        return (np.sqrt(abar).astype(np.float32).reshape(view),
                np.sqrt(1.0 - abar).astype(np.float32).reshape(view))

    def add_noise(self, x0: np.ndarray, noise: np.ndarray, t: np.ndarray) -> np.ndarray:
        signal, sigma = self._rates(t, x0.ndim)
        return signal * x0 + sigma * noise

    def target(self, x0: np.ndarray, noise: np.ndarray, t: np.ndarray, prediction_type: str) -> np.ndarray:
        if prediction_type == "epsilon":
            return noise
        if prediction_type == "v_prediction":
            signal, sigma = self._rates(t, x0.ndim)
            return signal * noise - sigma * x0
        raise PulseError(f"unknown prediction type '{prediction_type}' ({', '.join(PREDICTION_TYPES)})")

    def min_snr_weights(self, t: np.ndarray, gamma: float, prediction_type: str) -> np.ndarray:
        """Per-sample loss weights of min-SNR-gamma weighting (float32, one per timestep)."""
        signal, sigma = self._rates(t, 1)
        snr = (signal.astype(np.float64) / sigma) ** 2  # diffusers' compute_snr: (sqrt(abar) / sqrt(1 - abar))^2
        if prediction_type == "v_prediction":  # the velocity objective divides by SNR + 1
            snr = snr + 1.0
        return (np.minimum(snr, gamma) / snr).astype(np.float32)


def noise_schedule(kind: str = "linear", num_steps: int = 1000, beta_start: float | None = None,
                   beta_end: float | None = None) -> NoiseSchedule:
    if kind not in _DEFAULT_BETAS:
        raise PulseError(f"unknown beta schedule '{kind}' ({', '.join(_DEFAULT_BETAS)})")
    if num_steps < 1:
        raise PulseError(f"a noise schedule needs at least one step, got {num_steps}")
    lo = _DEFAULT_BETAS[kind][0] if beta_start is None else beta_start
    hi = _DEFAULT_BETAS[kind][1] if beta_end is None else beta_end
    if not 0 < lo <= hi < 1:
        raise PulseError(f"betas must satisfy 0 < start <= end < 1, got {lo}..{hi}")
    if kind == "linear":
        betas = np.linspace(lo, hi, num_steps, dtype=np.float64)
    else:
        betas = np.linspace(lo ** 0.5, hi ** 0.5, num_steps, dtype=np.float64) ** 2
    return NoiseSchedule(kind, np.cumprod(1.0 - betas))
