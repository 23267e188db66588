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
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from pulse.cli import msrun_launch
from pulse.cli.common import (MAX_COUNT, Setup, add_model_arguments, add_pipeline_arguments, check_positive,
                              fmt_bytes, host_address, int_between, load_model, load_setup, memory_model,
                              output_dir, path_safe_name, positive_int, recompute_chunks, seconds_float)
from pulse.cli.encoders_args import pipeline_encoder_set
from pulse.cli.host_memory import host_refusal
from pulse.cli.launchers import LAUNCHERS, Where, launch
from pulse.costs import with_encoder_costs
from pulse.data.footprint import data_bytes
from pulse.encoders import MODES as ENCODER_MODES, EncoderSet
from pulse.cli.run_args import add_run_arguments, run_config_of
from pulse.errors import PlanError, PulseError
from pulse.export_folder import check_new_folder
from pulse.partition import partition, plan_symmetric
from pulse.placement import Placement
from pulse.hardware import load_cluster
from pulse.plan import Plan, load_plan
from pulse.train.checkpoints import checkpoint_root
from pulse.train.run_folder import check_no_links, lock_run_folder
from pulse.schedule.generators import BASELINES, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import validate
from pulse.sim.engine import simulate

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_model="tiny-unet")
    add_pipeline_arguments(parser)
    parser.set_defaults(cluster="cpu-local", precision="fp32", pp=2, microbatch_size=2)
    for action in parser._actions:  # here --precision is how the job trains, not only what it counts
        if action.dest == "precision":
            action.help = ("fp32, or bf16/fp16 mixed precision (autocast compute, fp32 weights and AdamW state; "
                           "fp16 with dynamic loss scaling, overflow steps skipped and counted); also the "
                           "activation bytes the plan is priced with (default fp32)")
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe"), default="pulse")
    parser.add_argument("--schedule", choices=("auto", *BASELINES), default="auto",
                        help="auto: the fastest in simulation among the baselines and the ILP-synthesized "
                             "schedule (what `pulse simulate` picks)")
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="per step and replica (default 2*pp)")
    parser.add_argument("--out-dir", type=output_dir, default=None, help="run directory (default runs/<model>-pp<P>-dp<D>)")
    parser.add_argument("--backend", choices=tuple(LAUNCHERS), default="torch")
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


def run(args: argparse.Namespace) -> int:
    launcher = LAUNCHERS[args.backend]
    where = Where(args.nnodes, args.node_rank, args.master_addr, args.master_port or 0)
    check_arguments(args)
    config = run_config_of(args).replace(precision=args.precision)
    launcher.check(config, where)
    setup, plan = given_plan(args) if args.plan else \
        (lambda st: (st, build_plan(args, st)))(backend_setup(args.backend, load_setup(args)))
    check_fits(setup, plan, args.force, data_bytes(config.data, setup.spec, config.images), args.nnodes)
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
        return launch(command, launcher.output(), launcher.env(where))


def check_arguments(args: argparse.Namespace) -> None:
    check_positive(pp=args.pp, dp=args.dp, microbatch_size=args.microbatch_size, folds=args.folds)
    if args.data is not None and not Path(args.data).exists():
        raise PulseError(f"--data: no file or folder '{args.data}' (expected .npy or .npz latents, N x C x H x W, "
                         "or a `pulse cache-latents` folder)")
    if args.export is not None:  # said now, not after the training
        check_new_folder(Path(args.export), "--export")
    if args.images is not None and not Path(args.images).is_dir():
        raise PulseError(f"--images: no folder '{args.images}' (expected images with captions: metadata.jsonl or "
                         "NAME.txt beside each image)")
    if args.pipeline and (args.images or args.sample_every):  # one line naming a missing VAE or text encoder
        from pulse.data.pipeline_folder import read_pipeline

        read_pipeline(args.pipeline, need_encoders=True)
    if args.pipeline:  # SDXL: refused in one line before launch (pulse.data.pipeline_text)
        from pulse.data.pipeline_folder import read_pipeline
        from pulse.data.pipeline_text import refuse_sdxl

        refuse_sdxl(read_pipeline(args.pipeline))
    if args.resume and not Path(args.resume).is_dir():
        raise PulseError(f"--resume: no directory '{args.resume}' (expected one holding step-<k>/ checkpoints)")
    if args.nnodes > 1 and not args.master_port:
        raise PulseError("--nnodes > 1 needs a fixed --master-port that every node uses")
    if args.node_rank >= args.nnodes:
        raise PulseError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: ranks are 0..{args.nnodes - 1}")


def check_fits(setup: Setup, plan: Plan, force: bool, data: int = 0, nnodes: int = 1) -> None:
    """Refuse a plan whose simulated peak exceeds the device's memory, or whose ranks with their
    ``data`` bytes each outgrow the host they share (``pulse.cli.host_memory``), unless ``--force``."""
    peak = plan.predicted.get("peak_memory_bytes")
    capacity = setup.cluster.hardware.memory_bytes
    if peak is None:
        return
    message = (f"the plan needs {peak / 2**30:.1f} GiB per device in simulation but a {setup.cluster.hardware.name} "
               f"device has {capacity / 2**30:.1f} GiB; raise --pp, lower --microbatch-size or the model's size, "
               "give --recompute, or --force to launch anyway") if peak > capacity else \
        host_refusal(plan, setup.cluster.hardware, data, nnodes)
    if message is None:
        return
    if not force:
        raise PulseError(message)
    print(f"pulse train: warning (--force): {message.split('; raise')[0]}", file=sys.stderr)


def choose_placement(args: argparse.Namespace, setup: Setup) -> Placement:
    if args.partitioner == "pulse":
        return plan_symmetric(setup.spec, setup.costs, args.pp, folds=args.folds, strict=args.strict,
                              cluster=link_cluster(args, setup), objective=args.partition_objective,
                              num_microbatches=args.num_microbatches or 2 * args.pp).placement
    return partition(args.partitioner, setup.spec, setup.costs, args.pp, folds=args.folds, cluster=setup.cluster)


def choose_schedule(args: argparse.Namespace, placement: Placement, num_microbatches: int,
                    setup: Setup, recompute: tuple[int, ...] = ()) -> Schedule:
    """``--schedule auto``: ``synthesize``'s pick (ILP vs every baseline, by simulation), as `pulse simulate`."""
    if args.schedule == "auto":
        from pulse.synth import synthesize

        return synthesize(setup.spec, placement, setup.costs, link_cluster(args, setup), num_microbatches,
                          time_limit=args.time_limit, memory=memory_model(recompute), progress=lambda m: print(f"  ilp: {m}", flush=True)).schedule
    schedule = make_schedule(args.schedule, placement, num_microbatches, setup.costs)
    validate(schedule, placement, num_microbatches)
    return schedule


def link_cluster(args: argparse.Namespace, setup: Setup):
    """The cluster the job will see: with --emulate-bandwidth, every link at that rate."""
    if args.emulate_bandwidth:
        return setup.cluster.with_link_bandwidth(args.emulate_bandwidth)
    return setup.cluster


def backend_setup(backend: str, setup: Setup) -> Setup:
    """The cluster and costs as the backend runs them. MindSpore: its communicator's ways
    (``msrun_launch.communicator_traits``: buckets summed after each rank's actions on CPU, a wire message per
    tensor), and its split backward doing all the work in B (``CostTable.whole_backward_in_b``;
    a table not measured by it holds PyTorch's halves: B then costs the whole backward, W nothing)."""
    if backend != "mindspore":
        return setup
    costs = setup.costs
    if not costs.whole_backward_in_b:
        costs = replace(costs, whole_backward_in_b=True, bwd_input=costs.bwd, bwd_weight=(0.0,) * len(costs.bwd))
    traits = msrun_launch.communicator_traits(msrun_launch.ascend_available())
    return replace(setup, cluster=replace(setup.cluster, **traits), costs=costs)


def predict(args: argparse.Namespace, setup: Setup, placement: Placement, schedule: Schedule,
            dp: int, recompute: tuple[int, ...] = (), encoders: EncoderSet | None = None) -> dict:
    """What the simulator says of this plan on the links the job gets (pulse.sim.step: the whole step)."""
    from pulse.cli.figures import sim_figures
    from pulse.sim.step import StepTerms, step_time

    predicted: dict = {"cost_source": setup.costs.source}
    cluster = link_cluster(args, setup)
    try:
        sim = simulate(setup.spec, placement, schedule, setup.costs, cluster, memory=memory_model(recompute),
                       encoders=encoders)
        step = step_time(setup.spec, placement, setup.costs, cluster, sim, StepTerms(dp=dp, grad_bytes=4))
        predicted.update(sim_figures(sim, step, dp), cluster=cluster.name)  # the names simulate/tune use
    except PlanError as exc:  # e.g. more pipeline devices than the cluster file has: run unpredicted
        predicted["note"] = f"not simulated: {exc}".splitlines()[0]
    return predicted


def build_plan(args: argparse.Namespace, setup: Setup) -> Plan:
    num_microbatches = args.num_microbatches or 2 * args.pp
    check_positive(num_microbatches=num_microbatches)
    placement = choose_placement(args, setup)
    recompute = backend_recompute(args.backend, recompute_chunks(args.recompute, len(placement.chunks)),
                                  len(placement.chunks))
    schedule = choose_schedule(args, placement, num_microbatches, setup, recompute)
    encoders = pipeline_encoder_set(args.pipeline, args.images, args.encoders, setup.spec)
    if encoders is not None:  # the encodes go into the chosen schedule (before it, or in its bubbles)
        from pulse.synth.encodes import ENCODE_ILP_SECONDS, place_encodes_with_ilp

        setup = replace(setup, costs=with_encoder_costs(setup.costs, encoders, setup.cluster.hardware))
        schedule = place_encodes_with_ilp(setup.spec, placement, schedule, setup.costs, link_cluster(args, setup),
                                          encoders, setup.cluster.hardware.memory_bytes, memory_model(recompute),
                                          ilp_seconds=min(ENCODE_ILP_SECONDS, args.time_limit))
    return Plan(model=args.model, cluster=args.cluster, pp=args.pp, dp=args.dp,
                microbatch_size=args.microbatch_size, num_microbatches=num_microbatches,
                partitioner=args.partitioner, placement=placement, schedule=schedule,
                model_options=setup.model_options, recompute=recompute, encoders=encoders,
                predicted=predict(args, setup, placement, schedule, args.dp, recompute, encoders))


def backend_recompute(backend: str, recompute: tuple[int, ...], num_chunks: int) -> tuple[int, ...]:
    """What the backend will run: MindSpore recomputes every chunk whatever the plan asked."""
    if backend != "mindspore" or len(recompute) == num_chunks:
        return recompute
    print("pulse train: note: the MindSpore backend recomputes every chunk's forward in its backward; "
          "the plan is priced and written with recompute on all chunks", file=sys.stderr)
    return tuple(range(num_chunks))


def given_plan(args: argparse.Namespace) -> tuple[Setup, Plan]:
    """``--plan FILE``: that plan, unchanged but for its prediction on this cluster and cost table."""
    plan, spec = load_plan(args.plan, load_model)
    if plan.schedule is None:
        raise PulseError(f"{args.plan}: the plan has no schedule; write one with `pulse simulate --plan "
                         f"{args.plan} --out FILE` or `pulse tune`")
    args.model, args.microbatch_size = plan.model, plan.microbatch_size
    args.model_option = [f"{k}={v}" for k, v in plan.model_options.items()]
    try:  # priced on the plan's own cluster when it names one this machine knows, else on --cluster
        load_cluster(plan.cluster)
        args.cluster = plan.cluster
    except PulseError:
        pass
    setup = backend_setup(args.backend, load_setup(args))
    plan = replace(plan, recompute=backend_recompute(args.backend, plan.recompute, len(plan.placement.chunks)))
    encoders = plan.encoders if plan.encoders is not None and plan.encoders.active else None
    if encoders is not None:
        setup = replace(setup, costs=with_encoder_costs(setup.costs, encoders, setup.cluster.hardware))
    return setup, replace(plan, predicted=predict(args, setup, plan.placement, plan.schedule, plan.dp,
                                                  plan.recompute, encoders))


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
    return "\n".join(lines)


