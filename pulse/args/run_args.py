"""The training flags, defined once: `pulse train` and every rank entry take the same ones.

A flag left out is ``None`` in the namespace, so a rank entry knows what was
given on its own command line (which overrides ``--config run.yaml``) and
`pulse train` knows what to write into ``run.yaml``.
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from pulse.args.parser import (OneLineParser, finite_non_negative_float, float_between, finite_positive_float,
                               int_between, learning_rate, output_dir, output_file, positive_int, seconds_float,
                               seed_int)
from pulse.args.bucket_args import bucket_flags
from pulse.args.image_set_args import image_set_flags
from pulse.data.captioned_images import BAD_SAMPLES
from pulse.optimizers import NAMES as OPTIMIZERS
from pulse.train.run_config import (BETA_SCHEDULES, LORA_FORMATS, LR_SCHEDULES, PRECISIONS, PREDICTION_TYPES,
                                    REPORT_TO, RunConfig)

_DEFAULT = RunConfig()


def add_run_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Every ``RunConfig`` setting as a flag (``skip``: settings the command defines otherwise)."""
    d = _DEFAULT
    flags = [
        ("--steps", dict(type=int_between(1, 10**9), help=f"optimizer steps (default {d.steps})")),
        ("--seed", dict(type=seed_int, help="weights, data order, noise and timesteps (default 0)")),
        ("--lr", dict(type=learning_rate, help=f"the optimizer's learning rate (default {d.lr:g}; a pretrained "
                                               "pipeline 1e-4; --optimizer prodigy 1.0)")),
        ("--lr-schedule", dict(choices=LR_SCHEDULES, help="constant, linear or cosine decay to 0 at the last step "
                                                          "(default constant)")),
        ("--warmup-steps", dict(type=int_between(0, 10**9), metavar="N",
                                help="linear learning-rate warm-up from 0 over the first N steps (default 0)")),
        ("--ema", dict(type=float_between(0.0, 1.0, low_open=True), metavar="DECAY",
                       help="keep an exponential moving average of the weights (e.g. 0.999), saved beside them")),
        ("--ema-power", dict(type=finite_positive_float, metavar="P",
                             help="EMA warm-up as diffusers' use_ema_warmup: decay min(DECAY, 1 - (1 + t/G)^-P) at "
                                  "update t (default: diffusers' default min(DECAY, (1 + t) / (10 + t)))")),
        ("--ema-inv-gamma", dict(type=finite_positive_float, metavar="G",
                                 help="--ema-power's inverse multiplicative factor G (default 1)")),
        ("--weight-decay", dict(type=finite_non_negative_float,
                                help=f"AdamW weight decay (default {d.weight_decay:g}; diffusers' scripts use 1e-2)")),
        ("--bucket-cap-mb", dict(type=finite_positive_float, metavar="MB",
                                 help=f"data-parallel gradient buckets of MB MiB of whole layers, each all-reduced "
                                      f"as soon as the backward has made it, as DDP's bucket_cap_mb (default "
                                      f"{d.bucket_cap_mb:g})")),
        ("--adam-beta1", dict(type=float_between(0.0, 1.0), metavar="B1", help=f"AdamW beta1 (default {d.adam_beta1:g})")),
        ("--adam-beta2", dict(type=float_between(0.0, 1.0), metavar="B2", help=f"AdamW beta2 (default {d.adam_beta2:g})")),
        ("--adam-epsilon", dict(type=float_between(0.0, 1.0, low_open=True), metavar="EPS",
                                help=f"AdamW epsilon (default {d.adam_epsilon:g})")),
        ("--optimizer", dict(choices=OPTIMIZERS,
                             help="adamw (torch.optim.AdamW, the default), adafactor (transformers' Adafactor at the "
                                  "given lr: relative_step and scale_parameter off), adamw8bit (bitsandbytes), lion "
                                  "(lion-pytorch, its betas 0.9/0.99), prodigy (prodigyopt; lr 1.0 unless --lr; pp 1); "
                                  "--adam-beta1/2 and --adam-epsilon apply to adamw, adamw8bit and prodigy; MindSpore: "
                                  "adamw, adafactor (nn.AdaFactor)")),
        ("--lora-rank", dict(type=int_between(1, 4096), metavar="R",
                             help="LoRA fine-tune (PyTorch, needs --pipeline): peft adapters of rank R on the "
                                  "backbone's attention projections, the base frozen; --export writes "
                                  "pytorch_lora_weights.safetensors")),
        ("--lora-alpha", dict(type=finite_positive_float, metavar="A",
                              help="LoRA scale numerator: updates scaled by A/R (default: R)")),
        ("--lora-targets", dict(metavar="NAMES", help="modules given adapters, comma-separated (default "
                                                      "to_q,to_k,to_v,to_out.0)")),
        ("--lora-format", dict(choices=LORA_FORMATS, help="how --export writes the adapters: diffusers (peft keys, "
                                                          "the default) or kohya (lora_unet_* keys: A1111, ComfyUI; "
                                                          "diffusers' load_lora_weights reads both)")),
        ("--snr-gamma", dict(type=finite_positive_float, metavar="GAMMA",
                             help="min-SNR loss weighting, as diffusers' train_text_to_image.py (5.0 is usual; "
                                  "default: plain MSE)")),
        ("--noise-offset", dict(type=finite_non_negative_float, metavar="OFFSET",
                                help="offset noise: add OFFSET x N(0, 1) per sample and channel to the noise "
                                     "(diffusers' --noise_offset; default 0)")),
        ("--clip", dict(type=finite_non_negative_float,
                        help=f"clip the pipeline's global gradient norm (0: off; default {d.clip:g})")),
        ("--precision", dict(choices=PRECISIONS,
                             help="fp32, or bf16/fp16 mixed precision: autocast compute, fp32 weights and AdamW "
                                  "state; fp16 with dynamic loss scaling, overflow steps skipped and counted "
                                  "(default fp32)")),
        ("--beta-schedule", dict(choices=BETA_SCHEDULES, help="noise schedule (default: the diffusers pipeline "
                                                                 "scheduler's, else linear)")),
        ("--prediction-type", dict(choices=PREDICTION_TYPES, help="what the model predicts: epsilon or v_prediction "
                                                                   "(default: the pipeline scheduler's, else epsilon)")),
        ("--data", dict(help=".npy/.npz latents (N, C, H, W) or a `pulse cache-latents` folder; default synthetic")),
        ("--images", dict(metavar="DIR", help="captioned images (metadata.jsonl or NAME.txt beside each; a datasets "
                                              "folder or file, kohya N_name folders, WebDataset shards: "
                                              "--dataset-format), encoded on the fly by --pipeline's frozen VAE "
                                              "and text encoder")),
        *image_set_flags(with_defaults=False),
        ("--random-flip", dict(action="store_true", help="--images: flip each image left-right with probability "
                                                         "1/2 (seeded per image, as `pulse cache-latents`)")),
        *bucket_flags(with_defaults=False),
        ("--bad-samples", dict(choices=BAD_SAMPLES, help="--images: a sample that cannot train (an image PIL cannot "
                                                         "decode, a metadata.jsonl line that is not JSON or names no "
                                                         "file or caption) stops the run before launch in one line "
                                                         "(stop, the default), or is left out, named once and counted "
                                                         "in log.json (skip)")),
        ("--caption-dropout", dict(type=float_between(0.0, 1.0), metavar="P",
                                   help="train a sample on the empty prompt's embedding with probability P "
                                        "(for classifier-free guidance; needs --images or a latent cache)")),
        ("--report-to", dict(choices=REPORT_TO, help="also write TensorBoard event files to OUT_DIR/tensorboard")),
        ("--sample-every", dict(type=int_between(0, 10**9), metavar="N",
                                help="every N steps, checkpoint and write sample images of --sample-prompt to "
                                     "OUT_DIR/samples (needs --pipeline)")),
        ("--sample-prompt", dict(action="append", metavar="TEXT",
                                 help=f"a prompt of --sample-every; repeat it for several (default "
                                      f"'{d.sample_prompt[0]}')")),
        ("--sample-steps", dict(type=int_between(1, 10000), metavar="N",
                                help=f"denoising steps per sample (default {d.sample_steps})")),
        ("--num-inference-steps", dict(type=int_between(1, 10000), metavar="N", dest="sample_steps",
                                       help="--sample-steps by diffusers' name")),
        ("--sample-prompts", dict(metavar="FILE", help="--sample-every's prompts from a kohya prompt file: a line "
                                                       "'a castle --n blurry --s 30 --l 7.5 --d 1234 --w 512 --h 512' "
                                                       "(negative prompt, steps, guidance, seed, size), '#' comments; "
                                                       "or .json (in place of --sample-prompt)")),
        ("--validation-negative-prompt", dict(metavar="TEXT", help="every sample's negative prompt (a prompt "
                                                                   "line's --n wins)")),
        ("--guidance-scale", dict(type=float_between(0.0, 1000.0), metavar="G",
                                  help="the samples' classifier-free guidance scale (default: the pipeline's, "
                                       "7.5 for SD)")),
        ("--validation-seed", dict(type=int_between(0, 2**63 - 1), metavar="SEED",
                                   help="the samples' generator seed, the same at every step (a prompt line's --d "
                                        "wins; default --seed)")),
        ("--validation-split", dict(type=validation_split, metavar="F|N",
                                    help="hold out a fraction F (< 1) or N samples from training, the same on "
                                         "every rank and resume, and log their loss at fixed timesteps and noise "
                                         "(val/loss) every --validation-every steps")),
        ("--validation-every", dict(type=int_between(1, 10**9), metavar="N",
                                    help="steps between validation losses (default: --sample-every, else 100)")),
        ("--export", dict(type=output_dir, metavar="DIR", help="at the end, write a diffusers pipeline folder with "
                                                               "the trained backbone to DIR (needs --pipeline; EMA "
                                                               "weights with --ema)")),
        ("--fuse", dict(action="store_true", help="with --lora-rank and --export: write a whole pipeline folder, "
                                                  "the adapters fused into the backbone's weights (instead of "
                                                  "pytorch_lora_weights.safetensors)")),
        ("--out-dir", dict(type=output_dir, help="where log.json, loss.png and weights go (default: the plan's)")),
        ("--timeout", dict(type=seconds_float, help=f"seconds any send/recv/all-reduce may wait (default {d.timeout:g})")),
        ("--emulate-bandwidth", dict(type=finite_positive_float, metavar="BYTES_PER_S",
                                     help="emulated asynchronous link: pipeline messages arrive as a link of "
                                          "BYTES_PER_S would deliver them (one link each way per rank)")),
        ("--checkpoint-every", dict(type=int_between(0, 10**9), metavar="N",
                                    help="save a checkpoint after every N steps (0: never)")),
        ("--checkpoint-dir", dict(type=output_dir, help="where step-<k>/ go (default OUT_DIR/checkpoints)")),
        ("--checkpoints-total-limit", dict(type=positive_int, metavar="N",
                                           help="keep only the newest N complete checkpoints")),
        ("--resume", dict(nargs="?", const="", metavar="latest|STEP|DIR",
                          help="continue from a checkpoint: the newest complete one (alone or 'latest'), step STEP "
                               "of --checkpoint-dir, the newest in DIR, or DIR/step-N; the plan may differ from the "
                               "one that saved it")),
        ("--resume-any", dict(action="store_true", help="resume a checkpoint of another run too (other model, "
                                                        "options, seed or data)")),
        ("--save-final", dict(action="store_true", help="checkpoint the last step and write OUT_DIR/final_weights.pt "
                                                        "(--backend mindspore: final_weights.npz, by reference parameter name)")),
        ("--trace", dict(type=output_file, metavar="FILE", help="Chrome-trace JSON of the last step as every rank "
                                                                "ran it (the measured twin of `pulse simulate --trace`)")),
        ("--deterministic", dict(action="store_true", help="deterministic kernels on a GPU or NPU "
                                                           "(torch.use_deterministic_algorithms; slower, off by "
                                                           "default; CPU kernels are deterministic already)")),
        ("--preempt-signals", dict(metavar="SIGNALS",
                                   help="on these signals every rank finishes the step, checkpoints it (marked "
                                        "preempted) and exits 128 + the signal; a second one, or --preempt-grace "
                                        f"seconds, exits at once (default {d.preempt_signals}; 'none': they end "
                                        "the ranks at once)")),
        ("--preempt-grace", dict(type=float_between(0.1, 3600.0), metavar="SECONDS",
                                 help=f"seconds from the first stop signal to exit, checkpoint done or not (default "
                                      f"{d.preempt_grace:g}: under Slurm's 30 s KillWait)")),
    ]
    for flag, kwargs in flags:
        if kwargs.get("dest", flag.lstrip("-").replace("-", "_")) not in skip:
            parser.add_argument(flag, default=None, **kwargs)


def validation_split(text: str) -> float:
    """``--validation-split``: a fraction in (0, 1) or a whole number of samples (>= 1)."""
    value = finite_positive_float(text)
    if value >= 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{text}: a fraction below 1 (0.05) or a whole number of samples (64)")
    return int(value) if value >= 1 else value


def rank_entry_parser(prog: str, launcher: str) -> argparse.ArgumentParser:
    """A rank entry's command line: the plan, the run configuration, and every setting to override it."""
    parser = OneLineParser(prog=f"python -m {prog}", description=f"Run one rank of a PULSE plan (launch with {launcher}).")
    parser.add_argument("--plan", required=True, help="plan YAML written by `pulse train`, `tune` or `simulate --out`")
    parser.add_argument("--config", default=None, metavar="RUN_YAML", help="run configuration `pulse train` wrote")
    add_run_arguments(parser)
    return parser


def given_settings(args: argparse.Namespace) -> dict:
    """The settings the command line named (the rest stay the file's or the defaults)."""
    out = {}
    for f in fields(RunConfig):
        value = getattr(args, f.name, None)
        if value is not None and value is not False:
            out[f.name] = value
    return out


def run_config_of(args: argparse.Namespace, config_path: str | None = None) -> RunConfig:
    """``--config FILE`` (if any) with the command line's own flags on top."""
    base = RunConfig.load(config_path) if config_path else RunConfig()
    return base.replace(**given_settings(args))
