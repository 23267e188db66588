"""The models the peer benchmark trains (``peer_pipelining.py --model NAME``), and how each side builds,
feeds and prices them.

    small (default)  validate.py's "diffusers-unet" (``peer_stages.UNET_CONFIG``, 32x32 latents);
                     microbatch 2, M = 2P, P = 2 and 4; TP's 1F1B, interleaved 1F1B, interleaved ZB,
                     ZBV; slow link: the rate at which one microbatch's boundary tensors take RATIO x
                     a device's compute (``peer_pipelining.calibrate``). Each TP rank builds the
                     whole (tiny) model from seed 0 and keeps its stages, so the quick test's
                     one-process reference has the very weights the ranks train.
    sd2              the real SD v2 UNet (``sd2_unet_config.json``: 865,910,724 parameters, random
                     weights) at 256 px (32x32 latents), 77 text tokens of width 1024; microbatch 1,
                     M = 2 a step, P = 2; TP's 1F1B, interleaved 1F1B, ZBV; slow link 5 MB/s (issue
                     43's rate). Each TP rank builds the model on the meta device and materializes
                     only its own stages (torchtitan's way), as PULSE's ranks hold only theirs.
                     PULSE's costs: the committed real-size profile (``results/sd2_profile``) when it
                     prices this model on this many ranks, else ``pulse profile`` (about 11 min).
                     A step is 8-10 s on the 2-core host: 4 steps a run, 2 of them warm-up (a CPU
                     rank's kept heap, ``pulse.host_heap``, is faulted in over the first two).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from torch import nn

from peer_stages import UNET_CONFIG, Batch, Stage, build_meta_model, build_model, make_batch, materialize, unet_units

HERE = Path(__file__).resolve().parent
SD2_CONFIG = HERE / "sd2_unet_config.json"
SD2_PROFILE = HERE / "results" / "sd2_profile"
STAGE_SEED = 1000  # a materialized stage i draws its weights from seed STAGE_SEED + i


@dataclass(frozen=True)
class PeerModel:
    """One model of the benchmark and its defaults. ``microbatches``: per step (None: 2P);
    ``slow_bandwidth``: the slow link's bytes/s (None: the RATIO rule); ``meta_init``: TP ranks
    materialize only their stages; ``config_file``: PULSE's ``--diffusers-config`` (None: the config
    written into the workdir); ``committed_profile``: a folder of ``costs.yaml`` and ``cluster.yaml``
    profiled on ``profiled_pp`` ranks, reused when it prices this model."""

    name: str
    config: dict
    resolution: int
    microbatch_size: int
    microbatches: int | None
    pp: tuple[int, ...]
    tp_schedules: tuple[str, ...]
    steps: int
    warmup: int
    slow_bandwidth: float | None
    meta_init: bool
    config_file: Path | None = None
    committed_profile: Path | None = None
    profiled_pp: int = 0
    profile_args: tuple[str, ...] = ()
    calibration_repeats: int = 5
    results_stem: str = "peer_pipelining"

    @property
    def latent(self) -> int:
        return self.resolution // 8

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches or 2 * pp

    def pulse_model_args(self, workdir: Path) -> list[str]:
        """``--diffusers-config PATH`` (the committed config, or the one written into ``workdir``) and
        ``--model-option resolution=R`` where R is not the config's own (``sample_size`` x 8)."""
        path = self.config_file or write_model_folder(self.config, workdir)
        options = [] if self.resolution == 8 * self.config["sample_size"] else ["--model-option",
                                                                                f"resolution={self.resolution}"]
        return ["--diffusers-config", str(path), *options]

    def batch(self, global_batch: int, seed: int) -> Batch:
        return make_batch(global_batch, seed, self.config, self.latent)

    def whole(self, seed: int = 0) -> nn.Module:
        return build_model(seed, self.config)

    def rank_stages(self, cuts: Sequence[int], indices: Sequence[int], workarounds: Sequence[str]) -> list[Stage]:
        """This rank's stages ``indices`` of the cut ``cuts``: cut from the whole model (seed 0), or, with
        ``meta_init``, from its meta skeleton, each stage then materialized alone (seed STAGE_SEED + i)."""
        if not self.meta_init:
            model = self.whole(0)
            units = unet_units(model)
            return [Stage(model, units, cuts[i], cuts[i + 1], workarounds=workarounds) for i in indices]
        skeleton = build_meta_model(self.config)
        units = unet_units(skeleton)
        return [materialize(Stage(skeleton, units, cuts[i], cuts[i + 1], workarounds=workarounds), STAGE_SEED + i)
                for i in indices]


def write_model_folder(config: dict, workdir: Path) -> Path:
    """A diffusers model folder holding ``config`` (what ``pulse --diffusers-config`` reads)."""
    folder = workdir / "unet"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


SMALL = PeerModel(name="small", config=UNET_CONFIG, resolution=8 * UNET_CONFIG["sample_size"], microbatch_size=2,
                  microbatches=None, pp=(2, 4), tp_schedules=("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"),
                  steps=6, warmup=2, slow_bandwidth=None, meta_init=False)


def _sd2() -> PeerModel:
    return PeerModel(name="sd2", config=json.loads(SD2_CONFIG.read_text()), resolution=256, microbatch_size=1,
                     microbatches=2, pp=(2,), tp_schedules=("1f1b", "interleaved_1f1b", "zbv"), steps=4, warmup=2,
                     slow_bandwidth=5e6, meta_init=True, config_file=SD2_CONFIG, committed_profile=SD2_PROFILE,
                     profiled_pp=2, profile_args=("--repeats", "1", "--warmup", "0"), calibration_repeats=2,
                     results_stem="peer_pipelining_sd2")


MODELS = ("small", "sd2")


def peer_model(name: str, resolution: int | None = None) -> PeerModel:
    """The model ``name`` (``MODELS``), at ``resolution`` pixels if given."""
    if name not in MODELS:
        raise ValueError(f"unknown peer model '{name}'; known: {', '.join(MODELS)}")
    model = SMALL if name == "small" else _sd2()
    return replace(model, resolution=resolution) if resolution else model


def committed_profile(model: PeerModel, pp: int) -> tuple[tuple[Path, Path] | None, str]:
    """The committed (costs.yaml, cluster.yaml) if they price ``model`` on ``pp`` ranks, checked the way
    ``pulse train --costs`` checks them (same layers, same model name, hence same resolution, same
    microbatch size); else None. Second: why, in a line."""
    if model.committed_profile is None:
        return None, "no committed profile"
    costs, cluster = model.committed_profile / "costs.yaml", model.committed_profile / "cluster.yaml"
    if pp != model.profiled_pp or not (costs.exists() and cluster.exists()):
        return None, f"committed profile is for pp {model.profiled_pp}, not {pp}, or is missing"
    from pulse.cli.common import load_costs
    from pulse.errors import PulseError
    from pulse.zoo.diffusers_config import PREFIX
    from pulse.zoo.loading import load_model

    spec = load_model(PREFIX + str(model.config_file), {"resolution": model.resolution})
    try:
        table = load_costs(str(costs), spec)
    except PulseError as exc:
        return None, str(exc)
    if table.microbatch_size != model.microbatch_size:
        return None, f"{costs}: profiled at microbatch size {table.microbatch_size}, not {model.microbatch_size}"
    return (costs, cluster), f"reusing {costs.parent} (model {table.model}, microbatch {table.microbatch_size})"
