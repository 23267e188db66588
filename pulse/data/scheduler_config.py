"""The noise schedule and prediction type a diffusers pipeline trained with, read from its scheduler folder.

``pulse train --diffusers-config PIPELINE/unet`` trains what ``PIPELINE/scheduler/scheduler_config.json``
says (SD 2 768 is v-prediction over scaled-linear betas) unless the run names its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pulse.data.noise import NoiseSchedule, noise_schedule
from pulse.errors import PulseError
from pulse.train.run_config import PREDICTION_TYPES
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX


@dataclass(frozen=True)
class NoiseSettings:
    beta_schedule: str = "linear"
    beta_start: float | None = None
    beta_end: float | None = None
    num_train_timesteps: int = 1000
    prediction_type: str = "epsilon"

    def schedule(self) -> NoiseSchedule:
        return noise_schedule(self.beta_schedule, self.num_train_timesteps, self.beta_start, self.beta_end)


def scheduler_file(model: str) -> Path | None:
    """``<pipeline>/scheduler/scheduler_config.json`` beside a diffusers backbone folder, if there is one."""
    if not model.startswith(DIFFUSERS_PREFIX):
        return None
    folder = Path(model[len(DIFFUSERS_PREFIX):])
    path = folder.parent / "scheduler" / "scheduler_config.json"
    return path if path.is_file() else None


def noise_settings(model: str, beta_schedule: str | None, prediction_type: str | None) -> NoiseSettings:
    """The run's own choices where given, else the pipeline scheduler's, else DDPM (linear, epsilon)."""
    base = NoiseSettings()
    path = scheduler_file(model)
    if path is not None:
        try:
            cfg = json.loads(path.read_text())
            base = NoiseSettings(str(cfg.get("beta_schedule", "linear")), cfg.get("beta_start"), cfg.get("beta_end"),
                                 int(cfg.get("num_train_timesteps", 1000)),
                                 str(cfg.get("prediction_type", "epsilon")))
        except (OSError, ValueError, TypeError) as exc:
            raise PulseError(f"{path}: cannot read the pipeline's scheduler ({exc})") from None
        if base.prediction_type not in PREDICTION_TYPES:
            raise PulseError(f"{path}: prediction_type '{base.prediction_type}' is not one PULSE trains "
                             f"({', '.join(PREDICTION_TYPES)})")
    if beta_schedule is not None and beta_schedule != base.beta_schedule:
        base = NoiseSettings(beta_schedule, None, None, base.num_train_timesteps, base.prediction_type)
    if prediction_type is not None:
        base = NoiseSettings(base.beta_schedule, base.beta_start, base.beta_end, base.num_train_timesteps,
                             prediction_type)
    return base


def noise_info(model: str, beta_schedule: str | None, prediction_type: str | None) -> dict[str, str]:
    """What a run trains with, for its log: the resolved beta schedule and prediction type."""
    noise = noise_settings(model, beta_schedule, prediction_type)
    return {"beta_schedule": noise.beta_schedule, "prediction_type": noise.prediction_type}
