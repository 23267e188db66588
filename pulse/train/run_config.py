"""How a run trains, beside what it trains (the plan): one typed record every rank reads.

::

    pulse train ... ──▶ RUN/plan.yaml  (model, placement, schedule, degrees)
                        RUN/run.yaml   (RunConfig: steps, seed, optimizer, data, checkpoints, ...)
    every rank:         python -m pulse_torch.train --plan RUN/plan.yaml --config RUN/run.yaml
                        (flags given to the rank entry itself override the file: direct torchrun use)

The launcher never turns settings into argv strings for the ranks to parse
again: it writes this file, and each rank loads and checks it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from pulse.errors import PulseError
from pulse.optimizers import NAMES as OPTIMIZERS
from pulse.optimizers import optimizer_kind
from pulse.yamlio import SAFE_DUMPER, load_mapping
from pulse.atomic_io import write_atomic
from pulse.train.preemption import DEFAULT_GRACE_S, DEFAULT_SIGNALS, signal_names

PRECISIONS = ("fp32", "bf16", "fp16")
BETA_SCHEDULES = ("linear", "scaled_linear")
PREDICTION_TYPES = ("epsilon", "v_prediction")  # pulse.data.noise
LR_SCHEDULES = ("constant", "linear", "cosine")  # pulse.train.schedules.learning_rate
REPORT_TO = ("tensorboard",)  # pulse.train.tensorboard
BAD_SAMPLES = ("stop", "skip")  # --bad-samples: pulse.data.captioned_images
DATASET_FORMATS = ("auto", "imagefolder", "hf", "kohya", "webdataset")  # --dataset-format: pulse.data.image_sets
LORA_FORMATS = ("diffusers", "kohya")  # pulse_torch.diffusers_adapter.lora


# diffusers' train_text_to_image.py and train_text_to_image_lora.py both default to 1e-4 for a pretrained
# pipeline; random weights train at PULSE's 1e-3 (RunConfig.lr)
PRETRAINED_LR = 1e-4


def default_learning_rate(pipeline: bool, optimizer: str = "adamw") -> tuple[float, str]:
    """The learning rate a run gets when ``--lr`` is not given, and why (said on the opening line)."""
    own = optimizer_kind(optimizer).default_lr
    if own is not None:  # Prodigy estimates its own step size: its authors' lr is 1.0
        return own, f"--optimizer {optimizer}'s own default: it estimates the step size itself"
    if pipeline:
        return PRETRAINED_LR, "diffusers' training scripts' default for a pretrained pipeline, full or LoRA"
    return RunConfig.lr, "PULSE's default for random weights"


@dataclass(frozen=True)
class RunConfig:
    """Every training setting a rank needs (defaults: what a rank uses when nothing says otherwise)."""

    steps: int = 20
    seed: int = 0
    lr: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip: float = 1.0  # global gradient-norm limit; 0: no clipping
    ema: float | None = None  # decay of an exponential moving average of the weights; None: none kept
    # the EMA's warm-up, as diffusers' EMAModel: None min(ema, (1 + t) / (10 + t)); a power P its
    # use_ema_warmup schedule min(ema, 1 - (1 + t / ema_inv_gamma) ** -P) (pulse.train.schedules.ema_decay)
    ema_power: float | None = None
    ema_inv_gamma: float = 1.0
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (diffusers' scripts default to 1e-2)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8  # AdamW's (and 8-bit AdamW's, Prodigy's) epsilon, as diffusers' --adam_epsilon
    optimizer: str = "adamw"  # pulse.optimizers: adamw | adafactor | adamw8bit | lion | prodigy
    # data-parallel gradient buckets of this many MiB of whole layers (pulse.grad_buckets), DDP's bucket_cap_mb
    bucket_cap_mb: float = 25.0
    # LoRA (PyTorch, a diffusers UNet): peft adapters of this rank on the attention projections, base frozen
    lora_rank: int | None = None
    lora_alpha: float | None = None  # None: the rank (scale alpha / rank = 1)
    lora_targets: str | None = None  # module names, comma-separated; None: to_q,to_k,to_v,to_out.0
    lora_format: str = "diffusers"  # how --export writes the adapters: diffusers/peft keys or kohya's lora_unet_*
    snr_gamma: float | None = None  # min-SNR loss weighting min(SNR, gamma) / SNR (v: SNR + 1); None: plain MSE
    noise_offset: float = 0.0  # add offset * N(0, 1) per sample and channel to the noise (pulse.data.feed)
    precision: str = "fp32"  # bf16/fp16: autocast compute, fp32 weights and optimizer; fp16 scales the loss
    beta_schedule: str | None = None  # None: the pipeline scheduler's, else linear (DDPM)
    prediction_type: str | None = None  # epsilon | v_prediction; None: the pipeline scheduler's, else epsilon
    data: str | None = None  # .npy/.npz latents or a `pulse cache-latents` folder; None: synthetic
    out_dir: str | None = None  # None: the plan's folder
    timeout: float = 300.0  # seconds any send/recv/all-reduce may wait
    emulate_bandwidth: float | None = None  # bytes/s of an emulated asynchronous link
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    checkpoints_total_limit: int | None = None
    resume: str | None = None  # "": the checkpoint directory; None: start fresh
    resume_any: bool = False
    save_final: bool = False
    trace: str | None = None  # Chrome trace of the last step
    pipeline: str | None = None  # the diffusers pipeline folder the backbone came from (export, sampling, --images)
    images: str | None = None  # captioned images encoded on the fly by the pipeline's frozen encoders
    random_flip: bool = False  # --images: flip each image left-right with probability 1/2 (seeded per image)
    # --images in aspect-ratio buckets at the pipeline's resolution as the area (pulse.data.buckets, kohya's meanings)
    buckets: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    random_crop: bool = False  # --buckets: crop at an offset seeded per image instead of the center
    bad_samples: str = "stop"  # --images: a sample that cannot train stops the run, or is skipped
    # the bad samples' keys `pulse train` found screening --images before launch (pulse.cli.bad_samples):
    # every rank leaves out these; None: not screened (a rank then screens the folder itself)
    skipped_samples: list[str] | None = None
    # what --images holds (pulse.data.image_sets): auto (read off it), imagefolder, hf (datasets), kohya, webdataset
    dataset_format: str = "auto"
    image_column: str = "image"  # --images of a datasets format: the images' column (diffusers' --image_column)
    caption_column: str = "text"  # the captions' column (its --caption_column); a WebDataset .json's caption key
    caption_extension: str = ".caption"  # --images of kohya N_name folders: the caption files' (sd-scripts')
    caption_dropout: float = 0.0  # probability a sample trains on the empty prompt's embedding instead
    report_to: str | None = None  # "tensorboard": event files in OUT_DIR/tensorboard beside log.json
    sample_every: int = 0  # write sample images every N steps (0: never)
    sample_prompt: list[str] = field(default_factory=lambda: ["a photo"])  # one or more (a text: one)
    sample_steps: int = 20  # denoising steps of each sample (--num-inference-steps)
    sample_prompts: str | None = None  # a prompt file in kohya's --sample_prompts format (pulse.train.validation_prompts)
    validation_negative_prompt: str | None = None  # every sample's negative prompt (a prompt line's --n wins)
    guidance_scale: float | None = None  # classifier-free guidance of the samples; None: the pipeline's default
    validation_seed: int | None = None  # the samples' generator seed (a prompt line's --d wins); None: --seed
    # held-out samples (pulse.train.validation): a fraction of the data (< 1) or a count (>= 1); None: none
    validation_split: float | None = None
    validation_every: int | None = None  # steps between validation losses; None: --sample-every, else 100
    export: str | None = None  # write a diffusers pipeline folder with the trained backbone at the end
    fuse: bool = False  # --export of a LoRA run: a whole pipeline, the adapters fused into the backbone
    deterministic: bool = False  # torch.use_deterministic_algorithms on the device (slower; CPU kernels already are)
    # the signals every rank stops on after the step in progress, checkpointing it (pulse.train.preemption);
    # "none": they end the rank at once, as before
    preempt_signals: str = DEFAULT_SIGNALS
    preempt_grace: float = DEFAULT_GRACE_S  # seconds from the first signal to exit, checkpoint written or not

    def __post_init__(self) -> None:
        if isinstance(self.sample_prompt, str):  # a run.yaml from before several prompts
            object.__setattr__(self, "sample_prompt", [self.sample_prompt])
        for f in fields(self):
            _check(f.name, getattr(self, f.name))
        if self.images is not None and self.data is not None:
            raise PulseError("give --images (encoded on the fly) or --data (a cache or latents file), not both")
        needs_pipeline = [flag for flag, given in (("--images", self.images), ("--export", self.export),
                                                   ("--sample-every", self.sample_every),
                                                   ("--lora-rank", self.lora_rank)) if given]
        if needs_pipeline and self.pipeline is None:
            raise PulseError(f"{needs_pipeline[0]} needs --pipeline DIR (the diffusers pipeline folder whose "
                             "backbone trains)")
        if self.ema is None and (self.ema_power is not None or self.ema_inv_gamma != 1.0):
            raise PulseError("--ema-power and --ema-inv-gamma shape the EMA's warm-up: give --ema DECAY too")
        if self.ema_inv_gamma != 1.0 and self.ema_power is None:
            raise PulseError("--ema-inv-gamma applies to the power warm-up: give --ema-power too")
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_targets is not None
                                       or self.lora_format != "diffusers"):
            raise PulseError("--lora-alpha, --lora-targets and --lora-format shape LoRA adapters: give --lora-rank R "
                             "too")
        # one line naming an unknown signal; kept as 'TERM,USR1' whatever the spelling given
        object.__setattr__(self, "preempt_signals", ",".join(signal_names(self.preempt_signals)) or "none")
        split = self.validation_split
        if split is not None and split >= 1 and split != int(split):
            raise PulseError(f"--validation-split {split:g}: a fraction below 1 (0.05: 5% of the samples) or a whole "
                             "number of samples (64)")
        if self.fuse and (self.lora_rank is None or self.export is None):
            raise PulseError("--fuse merges a LoRA run's adapters into the pipeline --export writes: give "
                             "--lora-rank R and --export DIR too")

    def save(self, path: str | Path) -> None:
        write_atomic(Path(path), yaml.dump({"pulse_run": 1, **asdict(self)}, Dumper=SAFE_DUMPER, sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        data = load_mapping(path)
        if data.pop("pulse_run", None) != 1:
            raise PulseError(f"{path}: not a PULSE run configuration (no 'pulse_run: 1'); write it with "
                             "`pulse train --plan-only`")
        config = cls.from_mapping(data, str(path))  # bad values and unknown keys first: they say more
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:  # a truncated file would train on defaults nobody chose
            raise PulseError(f"{path}: incomplete run configuration, missing {', '.join(missing[:5])}"
                             f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''} (truncated?); write "
                             "it again with `pulse train --plan-only`")
        return config

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "run configuration") -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PulseError(f"{where}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except PulseError as exc:
            raise PulseError(f"{where}: {exc}") from None

    @property
    def bucket_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes: what ``pulse.grad_buckets`` cuts by."""
        return max(int(self.bucket_cap_mb * 2 ** 20), 1)

    def replace(self, **changes: Any) -> "RunConfig":
        return type(self).from_mapping({**asdict(self), **changes})


# name -> (types allowed, lowest, highest, choices); None stands for "any" where it is allowed
_RULES: dict[str, tuple[tuple[type, ...], float | None, float | None, tuple[str, ...] | None]] = {
    "steps": ((int,), 1, 1e9, None),
    "seed": ((int,), 0, 2**32 - 1, None),
    "lr": ((float, int), 0.0, 1e6, None),
    "clip": ((float, int), 0.0, 1e300, None),
    "lr_schedule": ((str,), None, None, LR_SCHEDULES),
    "warmup_steps": ((int,), 0, 1e9, None),
    "ema": ((float, type(None)), 0.0, 1.0, None),
    "ema_power": ((float, int, type(None)), 0.0, 1e3, None),
    "ema_inv_gamma": ((float, int), 0.0, 1e12, None),
    "weight_decay": ((float, int), 0.0, 1e6, None),
    "adam_beta1": ((float, int), 0.0, 1.0, None),
    "adam_beta2": ((float, int), 0.0, 1.0, None),
    "adam_epsilon": ((float, int), 0.0, 1.0, None),
    "optimizer": ((str,), None, None, OPTIMIZERS),
    "bucket_cap_mb": ((float, int), 0.0, 1e6, None),
    "lora_rank": ((int, type(None)), 1, 4096, None),
    "lora_alpha": ((float, int, type(None)), 0.0, 1e6, None),
    "lora_targets": ((str, type(None)), None, None, None),
    "lora_format": ((str,), None, None, LORA_FORMATS),
    "snr_gamma": ((float, int, type(None)), 0.0, 1e6, None),
    "noise_offset": ((float, int), 0.0, 1e3, None),
    "precision": ((str,), None, None, PRECISIONS),
    "beta_schedule": ((str, type(None)), None, None, BETA_SCHEDULES),
    "prediction_type": ((str, type(None)), None, None, PREDICTION_TYPES),
    "data": ((str, type(None)), None, None, None),
    "out_dir": ((str, type(None)), None, None, None),
    "timeout": ((float, int), 0.1, 7 * 24 * 3600.0, None),
    "emulate_bandwidth": ((float, int, type(None)), 1e-300, 1e300, None),
    "checkpoint_every": ((int,), 0, 1e9, None),
    "checkpoint_dir": ((str, type(None)), None, None, None),
    "checkpoints_total_limit": ((int, type(None)), 1, 1e9, None),
    "resume": ((str, type(None)), None, None, None),
    "resume_any": ((bool,), None, None, None),
    "save_final": ((bool,), None, None, None),
    "trace": ((str, type(None)), None, None, None),
    "pipeline": ((str, type(None)), None, None, None),
    "images": ((str, type(None)), None, None, None),
    "random_flip": ((bool,), None, None, None),
    "buckets": ((bool,), None, None, None),
    "min_bucket_reso": ((int,), 8, 16384, None),
    "max_bucket_reso": ((int,), 8, 16384, None),
    "bucket_reso_steps": ((int,), 8, 4096, None),
    "bucket_no_upscale": ((bool,), None, None, None),
    "random_crop": ((bool,), None, None, None),
    "bad_samples": ((str,), None, None, BAD_SAMPLES),
    "skipped_samples": ((list, type(None)), None, None, None),
    "dataset_format": ((str,), None, None, DATASET_FORMATS),
    "image_column": ((str,), None, None, None),
    "caption_column": ((str,), None, None, None),
    "caption_extension": ((str,), None, None, None),
    "caption_dropout": ((float, int), 0.0, 1.0, None),
    "report_to": ((str, type(None)), None, None, REPORT_TO),
    "sample_every": ((int,), 0, 1e9, None),
    "sample_prompt": ((list,), None, None, None),
    "sample_steps": ((int,), 1, 10000, None),
    "sample_prompts": ((str, type(None)), None, None, None),
    "validation_negative_prompt": ((str, type(None)), None, None, None),
    "guidance_scale": ((float, int, type(None)), 0.0, 1e3, None),
    "validation_seed": ((int, type(None)), 0, 2**63 - 1, None),
    "validation_split": ((float, int, type(None)), 0.0, 1e12, None),
    "validation_every": ((int, type(None)), 1, 1e9, None),
    "export": ((str, type(None)), None, None, None),
    "fuse": ((bool,), None, None, None),
    "deterministic": ((bool,), None, None, None),
    "preempt_signals": ((str,), None, None, None),
    "preempt_grace": ((float, int), 0.1, 3600.0, None),
}


def _check(name: str, value: Any) -> None:
    types, low, high, choices = _RULES[name]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        allowed = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise PulseError(f"'{name}' must be {allowed}, got {value!r}")
    if isinstance(value, list):
        if (not value and name not in _MAY_BE_EMPTY) or not all(isinstance(v, str) for v in value):
            raise PulseError(f"'{name}' must be one text or a list of texts, got {value!r}")
        return
    if value is None or isinstance(value, (bool, str)):
        if choices is not None and value is not None and value not in choices:
            raise PulseError(f"'{name}' must be one of {', '.join(choices)}, got {value!r}")
        return
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        raise PulseError(f"'{name}' must be a finite number in [{low:g}, {high:g}], got {value!r}")
    positive, below_one = name in _POSITIVE, name in _BELOW_ONE
    if positive and value <= 0 or below_one and value >= 1:
        want = "in (0, 1)" if positive and below_one else "> 0" if positive else "in [0, 1)"
        raise PulseError(f"'{name}' must be {want}, got {value!r}")


_MAY_BE_EMPTY = {"skipped_samples"}  # lists that may hold nothing (sample_prompt needs one prompt)
_POSITIVE = {"adam_epsilon", "lr", "bucket_cap_mb", "ema", "ema_power", "ema_inv_gamma", "snr_gamma", "lora_alpha", "validation_split"}  # beyond _RULES' closed ranges: > 0
_BELOW_ONE = {"ema", "adam_beta1", "adam_beta2"}  # < 1
