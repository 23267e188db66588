"""`pulse train`: plan a pipeline, write the plan, launch one process per rank.

::

    pulse train --model tiny-unet --pp 2 --dp 2 --steps 20
        │ partition (cpu-local analytic costs, or --costs) + schedule + simulate
        ▼
    runs/tiny-unet-pp2-dp2/plan.yaml          (refused first if its simulated peak exceeds device memory)
        │ python -m pulse_torch.launch --bind 127.0.0.1 -- --nproc-per-node 4 -m pulse_torch.train --plan ...
        │   (torchrun with its store on loopback, or on --master-addr; own process group, dies with us;
        │    SIGTERM/SIGINT passed on)
        ▼
    runs/tiny-unet-pp2-dp2/log.json (every step), loss.png

    pulse train --backend mindspore --model tiny-unet --pp 1 --dp 2 --steps 20
        msrun --worker_num 2 --local_worker_num 2 --master_port <free> --log_dir RUN/msrun_logs
              --join True python -m pulse_mindspore.train --plan ... (see pulse.cli.msrun_launch)

``--recompute`` goes into the plan (``Plan.recompute``), is priced by the schedule choice and
the prediction, and the ranks' backends run it. The MindSpore backend always recomputes (its B
rebuilds the tape: ``pulse_mindspore.backend``), so its plans say so for every chunk.

This module stays framework-free (the core's rule): it only builds a command
line and waits for the launcher, whose output streams straight to this
terminal. Its exit code is the launcher's (128 + the signal when stopped).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from pulse.args.parser import (MAX_COUNT, host_address, int_between, output_dir, path_safe_name, positive_int,
                               seconds_float)
from pulse.backend_traits import BackendTraits, load_traits
from pulse.cli.common import (Setup, add_model_arguments, add_pipeline_arguments, check_positive, fmt_bytes,
                              load_model, load_setup, unused_splits_note)
from pulse.cli.encoders_args import pipeline_encoder_set
from pulse.cli.host_memory import host_refusal
from pulse.cli.sample_fit import sample_refusal, sample_weight_bytes
from pulse.cli.bad_samples import screen_before_launch
from pulse.cli.launchers import LAUNCHERS, Where, launch
from pulse.cli.oom_note import RunMemory
from pulse.cli.plan_cmd import plan_request
from pulse.data.footprint import data_bytes
from pulse.data.image_sets import check_image_set, image_set_of
from pulse.encoders import MODES as ENCODER_MODES
from pulse.args.model_args import option_pairs
from pulse.args.run_args import add_run_arguments, run_config_of
from pulse.errors import PulseError
from pulse.export_folder import check_new_folder
from pulse.hardware import load_cluster
from pulse.host_limits import cgroup_memory_limit
from pulse.plan import Plan, load_plan
from pulse.bucket_pricing import cache_mix, images_mix, plan_for_buckets
from pulse.args.bucket_args import bucket_settings
from pulse.data.buckets import check_backbone
from pulse.planner import make_plan, price_plan
from pulse.train.checkpoints import checkpoint_root
from pulse.optimizers import check_pipeline
from pulse.train.run_config import RunConfig, default_learning_rate
from pulse.train.validation_prompts import read_prompt_file
from pulse.train.run_folder import check_no_links, lock_run_folder
from pulse.schedule.generators import BASELINES
from pulse.sim.memory import MemoryModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_model="tiny-unet", precision="fp32")
    add_pipeline_arguments(parser)
    parser.set_defaults(cluster="cpu-local", pp=2, microbatch_size=2)
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe", "auto"), default="pulse",
                        help="auto: the fastest placement in simulation at this --pp, --dp and microbatching, PULSE's "
                             "V or a sequential / interleaved one (1F1B, interleaved 1F1B, zero-bubble, ...); the "
                             "opening line says which won and by how much")
    parser.add_argument("--schedule", choices=("auto", *BASELINES), default="auto",
                        help="auto: the fastest in simulation among the baselines and the ILP-synthesized "
                             "schedule (what `pulse simulate` picks)")
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="per step and replica (default 2*pp)")
    parser.add_argument("--out-dir", type=output_dir, default=None, help="run directory (default runs/<model>-pp<P>-dp<D>)")
    parser.add_argument("--backend", choices=tuple(LAUNCHERS), default="torch")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a run file: the run.yaml `pulse train` wrote (its plan.yaml beside it trains again), or a "
                             "YAML of flags by name; flags on the command line override it")
    add_run_arguments(parser, skip=("precision", "out_dir"))  # --precision: add_model_arguments' (fp32 here)
    parser.add_argument("--encoders", choices=ENCODER_MODES, default="cached",
                        help="where the pipeline's frozen VAE and text encoder run with --pipeline --images: cached "
                             "(on the fly wherever a chunk reads their output, the default), before (on the first "
                             "device before the pipeline) or bubbles (in the schedule's idle gaps, outputs sent to "
                             "their readers); planned and priced like every action")
    parser.add_argument("--plan-only", action="store_true", help="write the plan, print the command, stop")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="train exactly this plan (from `pulse tune`, `pulse simulate --out` or --plan-only); "
                             "the model and pipeline flags are then ignored")
    parser.add_argument("--time-limit", type=seconds_float, default=20.0,
                        help="seconds of ILP synthesis for --schedule auto (as `pulse simulate`)")
    parser.add_argument("--force", action="store_true",
                        help="launch even when the simulated peak memory exceeds the device's memory")
    launch = parser.add_argument_group("where the job runs (torch backend)")
    launch.add_argument("--master-addr", type=host_address, default="127.0.0.1",
                        help="the address node 0's rendezvous store listens on (default loopback: one node, "
                             "nothing exposed); several nodes: node 0's address on the network they share")
    launch.add_argument("--master-port", type=int_between(0, 65535), default=0,
                        help="the store's port (0: a free one; several nodes need a fixed one)")
    launch.add_argument("--nnodes", type=positive_int, default=1, help="nodes of the job (same command on each)")
    launch.add_argument("--node-rank", type=int_between(0, MAX_COUNT), default=0, help="this node's index")
    launch.add_argument("--max-restarts", type=int_between(0, 1000), default=0, metavar="N",
                        help="restart a failed worker group up to N times (torchrun's --max-restarts); a restarted "
                             "group resumes from this run's newest complete checkpoint by itself")


def run(args: argparse.Namespace) -> int:
    launcher = LAUNCHERS[args.backend]
    where = Where(args.nnodes, args.node_rank, args.master_addr, args.master_port or 0, args.max_restarts)
    check_arguments(args)
    config = run_config_of(args).replace(precision=args.precision)
    if args.lr is None:  # a pretrained pipeline at 1e-3 would train 10x diffusers' rate
        lr, why = default_learning_rate(config.pipeline is not None, config.optimizer)
        config = config.replace(lr=lr)
        print(f"learning rate {lr:g} ({why}; --lr to change)")
    else:
        print(f"learning rate {config.lr:g} (--lr)")
    where = dataclasses.replace(where, preempt_signals=config.preempt_signals, preempt_grace=config.preempt_grace)
    launcher.check(config, where)
    if config.sample_prompts is not None:  # a bad prompt file: one line now, not a warning at the first sample
        read_prompt_file(config.sample_prompts)
    config = screen_before_launch(config)  # --images: a bad sample stops here, or every rank skips it
    traits = load_traits(args.backend)
    args.optimizer = config.optimizer  # the plan is priced with the run's optimizer (its flag or --config's)
    args.bucket_cap_mb = config.bucket_cap_mb  # and its data-parallel buckets
    setup, plan = given_plan(args, traits) if args.plan else build_plan(args, traits, config)
    check_pipeline(config.optimizer, plan.pp)  # Prodigy's step size sums over the whole model: pp 1
    sampling = Sampling(config.sample_every, sample_weight_bytes(config.pipeline)) \
        if config.sample_every and config.pipeline else None
    check_fits(setup, plan, args.force, data_bytes(config.data, setup.spec, config.images), args.nnodes, sampling)
    if plan.encoders is not None and plan.encoders.active and config.images is None:
        raise PulseError(f"the plan runs the frozen encoders in the pipeline ({plan.encoders.mode}): give --pipeline "
                         "DIR --images DIR (images encoded on the fly), or plan with --encoders cached")
    out_dir = Path(args.out_dir or Path("runs") / f"{path_safe_name(setup.spec.name)}-pp{plan.pp}-dp{plan.dp}")
    if plan.world_size % args.nnodes:
        raise PulseError(f"the plan's {plan.world_size} ranks do not split evenly over --nnodes {args.nnodes}")
    out_dir.mkdir(parents=True, exist_ok=True)  # the run folder is PULSE's to make
    with lock_run_folder(out_dir, args.node_rank):  # one run per folder, held until the ranks are done
        check_no_links(out_dir, checkpoint_root(config, out_dir))
        plan_path, config_path = out_dir / "plan.yaml", out_dir / "run.yaml"
        plan.save(plan_path, setup.spec)
        config.replace(out_dir=str(out_dir)).save(config_path)
        print(describe(setup, plan))
        command = launcher.command(plan, plan_path, config_path, where)
        print(f"plan written to {plan_path}, run configuration to {config_path}\nlaunch: {shlex.join(command)}",
              flush=True)
        if args.plan_only:
            return 0
        return launch(command, launcher.output(), launcher.env(where), RunMemory.of(plan, out_dir),
                      launcher.stopping(where, config_path))


def check_arguments(args: argparse.Namespace) -> None:
    check_positive(pp=args.pp, dp=args.dp, microbatch_size=args.microbatch_size, folds=args.folds)
    if args.data is not None and not Path(args.data).exists():
        raise PulseError(f"--data: no file or folder '{args.data}' (expected .npy or .npz latents, N x C x H x W, "
                         "or a `pulse cache-latents` folder)")
    if args.export is not None:  # said now, not after the training
        check_new_folder(Path(args.export), "--export")
    if args.images is not None:  # a folder, file or shard pattern some reader takes (pulse.data.image_sets)
        check_image_set(image_set_of(args))
    if args.pipeline and (args.images or args.sample_every):  # one line naming a missing VAE or text encoder
        from pulse.data.pipeline_folder import read_pipeline

        read_pipeline(args.pipeline, need_encoders=True)
    check_buckets(args)
    if args.resume and args.resume != "latest" and not args.resume.isdigit() and not Path(args.resume).is_dir():
        raise PulseError(f"--resume: no directory '{args.resume}' (expected latest, a step number, a folder "
                         "holding step-<k>/ checkpoints, or one step-<k>/ folder)")
    if args.nnodes > 1 and not args.master_port:
        raise PulseError("--nnodes > 1 needs a fixed --master-port that every node uses")
    if args.node_rank >= args.nnodes:
        raise PulseError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: ranks are 0..{args.nnodes - 1}")


def check_buckets(args: argparse.Namespace) -> None:
    """--buckets and its flags, refused in one line before launch where they cannot make buckets."""
    if args.buckets and not (args.images and args.pipeline):
        raise PulseError("--buckets applies to --images with --pipeline; a `pulse cache-latents --buckets` cache "
                         "(--data) carries its own buckets")
    if not args.buckets:
        bucket_settings(args, 0)  # a bucket flag without --buckets: one line
        return
    if args.encoders != "cached":  # an encode prefetched for the next step would carry that step's bucket
        raise PulseError(f"--buckets with --encoders {args.encoders}: encoders in the pipeline run on one shape per "
                         "plan; encode on the ranks' data path (--encoders cached, the default) or cache the "
                         "buckets with `pulse cache-latents --buckets`")
    from pulse.data.pipeline_folder import read_pipeline, resolution_of

    folder = read_pipeline(args.pipeline)
    resolution, factor = resolution_of(folder)
    check_backbone(folder, bucket_settings(args, resolution), factor)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``--sample-every``: how often, and the pipeline's bytes as sampling loads it."""

    every: int
    pipeline_bytes: int


def check_fits(setup: Setup, plan: Plan, force: bool, data: int = 0, nnodes: int = 1,
               sampling: Sampling | None = None) -> None:
    """Refuse a plan whose simulated peak exceeds the device's memory, or whose ranks with their
    ``data`` bytes each outgrow the host they share (``pulse.cli.host_memory``), or whose rank 0 cannot
    hold the ``sampling`` pipeline beside its training (``pulse.cli.sample_fit``), unless ``--force``."""
    peak = plan.predicted.get("peak_memory_bytes")
    hardware = setup.cluster.hardware
    if peak is None:
        return
    limit = cgroup_memory_limit()
    message = (f"the plan needs {peak / 2**30:.1f} GiB per device in simulation but a {hardware.name} "
               f"device has {hardware.memory_bytes / 2**30:.1f} GiB; raise --pp, lower --microbatch-size or the "
               "model's size, give --recompute, or --force to launch anyway") if peak > hardware.memory_bytes else \
        host_refusal(plan, hardware, data, nnodes, limit)
    if message is None and sampling is not None:
        message = sample_refusal(plan, hardware, sampling.pipeline_bytes, sampling.every, data, nnodes, limit)
    if message is None:
        return
    if not force:
        raise PulseError(message)
    print(f"pulse train: warning (--force): {message.split('; ')[0]}", file=sys.stderr)


def build_plan(args: argparse.Namespace, traits: BackendTraits, config: RunConfig | None = None) -> tuple[Setup, Plan]:
    """The flags' plan (``pulse.planner.make_plan``), priced as ``traits``' backend runs it."""
    setup = load_setup(args)
    encoders = pipeline_encoder_set(args.pipeline, args.images, args.encoders, setup.spec, args.precision)
    request = plan_request(args, setup, traits, encoders)
    request = dataclasses.replace(request, adapters=lora_adapters(args, setup.spec), bucket_cap=bucket_bytes(args),
                                  memory=run_memory_of(args, traits, cpu_host=on_cpus(setup)))
    hooks = dict(progress=lambda m: print(f"  ilp: {m}", flush=True), note=say_note,
                 cuts=lambda m: print(f"  cuts: {m}", flush=True), placed=lambda m: print(m, flush=True))
    microbatches = request.num_microbatches or 2 * request.pp
    global_batch = request.dp * microbatches * request.microbatch_size
    mix = cache_mix(args.data, global_batch)  # a cache in aspect-ratio buckets
    if config is not None and config.buckets and config.images:  # images put in buckets on the fly
        mix = bucket_mix_of_images(config, global_batch)
    if mix is not None:  # cut at the largest bucket, timed over the mix (pulse.bucket_pricing)
        plan = plan_for_buckets(setup.spec, setup.costs, setup.cluster, request, mix, **hooks)
    else:
        plan = make_plan(setup.spec, setup.costs, setup.cluster, request, **hooks)
    note = unused_splits_note(setup.spec, plan.placement, setup.model_options)
    if note:
        say_note(note)
    return setup, plan


def bucket_mix_of_images(config: RunConfig, global_batch: int):
    """--images --buckets: the bucket mix the ranks will train (from the screened images' header sizes)."""
    from pulse.data.captioned_images import screen_images
    from pulse.data.pipeline_folder import read_pipeline, resolution_of

    resolution, factor = resolution_of(read_pipeline(config.pipeline))
    items = screen_images(image_set_of(config), config.bad_samples, config.skipped_samples or []).items
    return images_mix(items, bucket_settings(config, resolution), factor, global_batch)


def lora_adapters(args: argparse.Namespace, spec) -> tuple[int, ...] | None:
    """``--lora-rank``: the adapter parameters peft gives each layer (``pulse.zoo.lora``), which the plan
    prices in place of a full fine-tune's; None without it."""
    if getattr(args, "lora_rank", None) is None:
        return None
    from pulse.zoo.lora import adapter_params, target_names

    return adapter_params(spec, args.lora_rank, target_names(args.lora_targets))


def run_memory_of(args: argparse.Namespace, traits: BackendTraits, dp: int | None = None,
                  cpu_host: bool = False) -> MemoryModel:
    """What the run's ranks will hold per parameter, as its backend trains with these flags."""
    return traits.memory(getattr(args, "precision", "fp32"), getattr(args, "ema", None) is not None,
                         dp if dp is not None else getattr(args, "dp", 1), getattr(args, "lora_rank", None) is not None,
                         cpu_host, getattr(args, "optimizer", None) or "adamw")


def on_cpus(setup: Setup) -> bool:
    """The cluster's devices are a host's CPU cores (its ranks share them, and talk over gloo)."""
    return setup.cluster.hardware.shared_cores is not None


def say_note(note: str) -> None:
    print(f"pulse train: note: {note}", file=sys.stderr)


def given_plan(args: argparse.Namespace, traits: BackendTraits) -> tuple[Setup, Plan]:
    """``--plan FILE``: that plan, unchanged but for its prediction on this cluster and cost table."""
    plan, spec = load_plan(args.plan, load_model)
    if plan.schedule is None:
        raise PulseError(f"{args.plan}: the plan has no schedule; write one with `pulse simulate --plan "
                         f"{args.plan} --out FILE` or `pulse tune`")
    args.model, args.microbatch_size = plan.model, plan.microbatch_size
    args.model_option = option_pairs(plan.model_options)
    try:  # priced on the plan's own cluster when it names one this machine knows, else on --cluster
        load_cluster(plan.cluster)
        args.cluster = plan.cluster
    except PulseError:
        pass
    setup = load_setup(args)
    if plan.encoders is not None and plan.encoders.active and args.pipeline:  # as this run's ranks hold them
        from pulse.data.frozen_precision import frozen_bytes
        from pulse.data.pipeline_folder import read_pipeline

        held = plan.encoders.held_at(frozen_bytes(read_pipeline(args.pipeline), args.precision))
        plan = dataclasses.replace(plan, encoders=held)
    return setup, price_plan(setup.spec, setup.costs, setup.cluster, plan, traits, args.emulate_bandwidth,
                             note=say_note, adapters=lora_adapters(args, setup.spec),
                             memory=run_memory_of(args, traits, plan.dp, on_cpus(setup)), bucket_cap=bucket_bytes(args))


def bucket_bytes(args: argparse.Namespace) -> int:
    """The run's data-parallel bucket bytes (``--bucket-cap-mb``, or --config's), as its ranks cut them."""
    cap = getattr(args, "bucket_cap_mb", None)
    return RunConfig().bucket_bytes if cap is None else RunConfig(bucket_cap_mb=cap).bucket_bytes


def describe(setup: Setup, plan: Plan) -> str:
    spec, placement = setup.spec, plan.placement
    chunks = " | ".join(f"dev{c.device}: {spec.layers[c.start].name}..{spec.layers[c.end - 1].name}"
                        for c in placement.chunks)
    head = (f"{spec.name}: {plan.partitioner} {placement.kind} placement, schedule "
            f"{plan.schedule.name if plan.schedule else '-'}, pp {plan.pp} x dp {plan.dp}, "
            f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch {plan.global_batch})")
    lines = [head, f"chunks: {chunks}"]
    if plan.recompute:
        lines.append(f"recomputing chunks {', '.join(map(str, plan.recompute))} in the backward")
    p = plan.predicted
    if "step_seconds" in p:
        lines.append(f"predicted ({p['cost_source']}): {p['step_seconds'] * 1e3:.1f} ms/step, bubble "
                     f"{p['bubble_ratio']:.1%}, pipeline traffic {fmt_bytes(p['pipeline_bytes_per_step'])}/step")
    if "trainable_params" in p and "peak_memory_bytes" in p:  # --lora-rank: priced with the base frozen
        trained, base = p["trainable_params"], spec.total_params
        lines.append(f"LoRA: {trained:,} adapter parameters train ({trained / base:.2%} of the frozen base's "
                     f"{base:,}): peak memory {fmt_bytes(p['peak_memory_bytes'])}/device, data-parallel "
                     f"all-reduce {fmt_bytes(p['allreduce_bytes_per_step'])}/step")
    return "\n".join(lines)


