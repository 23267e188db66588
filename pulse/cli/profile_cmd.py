"""`pulse profile`: measure layer costs and links where the job runs, for the simulator.

::

    pulse profile --model tiny-unet --pp 2 --microbatch-size 2 [--backend mindspore]
        │ torchrun ... -m pulse_torch.profile_job ...        (--backend torch)
        │ msrun ... python -m pulse_mindspore.profile_job ... (--backend mindspore)
        ▼     every rank at once (contention of a shared host included); both measure
              with pulse.profiling, through their own executor backend and communicator,
              one window of layers real at a time (pulse.profiling.windows: never the
              whole model, a --diffusers-config model's included)
    runs/profile-<model>-pp<P>/costs.yaml     per layer: fwd, bwd, bwd_input, optimizer, act_mem (the bytes
                                              autograd saved in its forward)
    runs/profile-<model>-pp<P>/cluster.yaml   per rank pair: bandwidth, latency, per-message costs;
                                              all-reduce seconds by size; shared cores

Every command takes them: ``--costs costs.yaml --cluster cluster.yaml``. This
module stays framework-free: it builds the launcher's command line and waits.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pulse import launch_env
from pulse.atomic_io import check_target
from pulse.args.model_args import add_diffusers_argument, option_pairs, parse_options
from pulse.args.parser import seconds_float
from pulse.backend_traits import traits_module
from pulse.cli.common import add_precision_argument, check_positive, load_model
from pulse.profiling.timing import DEVICE_TIMINGS
from pulse.errors import PulseError
from pulse.plan import load_plan


PROFILE_TIMEOUT = 1800.0  # a rank waits while the ranks of an earlier turn measure every layer: minutes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", default=None, help="profile for this plan (model, pp, dp, microbatch size)")
    parser.add_argument("--time-chunks", action="store_true",
                        help="with --plan: also time each of its chunks whole, where it runs them, and price them "
                             "so (the cost table's spans) instead of as their layers' sum less the per-action fit; "
                             "for accelerators whose chunks run well under their layers' sum (off by default: on "
                             "a CPU it predicted a one-chunk step 2-20%% fast; see docs/RESULTS.md)")
    parser.add_argument("--model", default="tiny-unet", help="zoo name or spec YAML (without --plan)")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (without --plan)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (without --plan)")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--hardware", default="cpu-local", help="figures for what is not measured")
    parser.add_argument("--repeats", type=int, default=8,
                        help="timed repetitions per layer figure (links get 4x as many)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each layer figure's repetitions")
    parser.add_argument("--timeout", type=seconds_float, default=PROFILE_TIMEOUT,
                        help="seconds any wait between ranks may take, a rank waiting its turn while others "
                             f"measure their layers included (default {PROFILE_TIMEOUT:g})")
    parser.add_argument("--out-costs", default=None, help="default runs/profile-<model>-pp<P>/costs.yaml")
    parser.add_argument("--out-cluster", default=None, help="default next to the costs: cluster.yaml")
    parser.add_argument("--images", default=None, metavar="DIR",
                        help="with --pipeline: captioned images to time the frozen encoders on, decoded as in "
                             "training (default: synthetic PNGs at the pipeline's resolution)")
    add_precision_argument(parser, "fp32", also="; the layers are timed under its autocast, as `pulse train` "
                                                 "runs them (--backend torch)")
    parser.add_argument("--device-timing", choices=DEVICE_TIMINGS, default=None,
                        help="on a GPU or Ascend NPU: wait for the device after every compute call (synchronize, "
                             "--backend torch's default), or time each action between device events while the host "
                             "queues ahead as in training (events, MindSpore's on Ascend)")
    parser.add_argument("--backend", choices=("torch", "mindspore"), default="torch",
                        help="torch (gloo / NCCL / HCCL via torch_npu under torchrun) or mindspore (HCCL on "
                             "Ascend, mccl + gloo on CPU, under msrun): profile with the backend you train with")


def job_command(args: argparse.Namespace, model: str, options: list[str], pp: int, dp: int, mbs: int,
                costs: Path, cluster: Path, cuts: list[int] | None = None) -> list[str]:
    """The launcher's command line: torchrun (``pulse_torch.profile_job``) or msrun
    (``pulse_mindspore.profile_job``), one process per rank, the same job arguments."""
    job = ["--model", model, "--pp", str(pp), "--dp", str(dp), "--microbatch-size", str(mbs), "--repeats",
           str(args.repeats), "--warmup", str(args.warmup), "--hardware", args.hardware, "--out-costs", str(costs),
           "--out-cluster", str(cluster), "--precision", args.precision, "--timeout", repr(args.timeout)]
    if args.device_timing is not None:
        if args.backend == "mindspore" and args.device_timing != "events":
            raise PulseError(f"--device-timing {args.device_timing}: the MindSpore profile times an Ascend "
                             "device's layers on its events; drop --device-timing, or use --backend torch")
        job += ["--device-timing", args.device_timing]
    for option in options:
        job += ["--model-option", option]
    if cuts:  # --plan: its chunks are timed whole too
        job += ["--plan-cuts", ",".join(map(str, cuts))]
    if args.images:
        job += ["--images", str(Path(args.images).resolve())]
    if args.backend == "mindspore":
        from pulse.cli import msrun_launch

        if args.precision != "fp32":
            raise PulseError(f"--precision {args.precision}: the MindSpore profile times float32 layers; "
                             "drop --precision, or use --backend torch")

        if args.images:
            raise PulseError("--images times a pipeline's frozen encoders, which only the PyTorch backend runs "
                             "(MindSpore trains from a `pulse cache-latents` folder): drop --images, or use "
                             "--backend torch")
        traits_module(args.backend).check_model(model)
        msrun = msrun_launch.find_msrun()
        if pp * dp > 1:
            msrun_launch.check_p2p(f"profiling {pp * dp} workers' links", "profile one worker (--pp 1 --dp 1)")
        return msrun_launch.msrun_prefix(msrun, pp * dp, launch_env.msrun_log_dir(costs)) + \
            ["python", "-m", "pulse_mindspore.profile_job", *job]
    from pulse.cli.launchers import launcher_prefix

    return launcher_prefix(pp * dp) + ["-m", "pulse_torch.profile_job", *job]


def run(args: argparse.Namespace) -> int:
    from pulse.cli.launchers import LAUNCHERS, Where, launch

    if args.plan:
        plan, _ = load_plan(args.plan, load_model)
        model, pp, dp, mbs = plan.model, plan.pp, plan.dp, plan.microbatch_size
        options = option_pairs(plan.model_options)
        cuts = [c.start for c in plan.placement.chunks] + [plan.placement.num_layers] if args.time_chunks else None
    else:
        if args.time_chunks:
            raise PulseError("--time-chunks times a plan's chunks: name the plan with --plan (pulse train --plan-only "
                             "writes one)")
        model, pp, dp, mbs, options = args.model, args.pp, args.dp, args.microbatch_size, args.model_option
        cuts = None
    check_positive(pp=pp, dp=dp, microbatch_size=mbs, repeats=args.repeats)
    if args.warmup < 0:
        raise PulseError(f"--warmup must be >= 0, got {args.warmup}")
    spec = load_model(model, parse_options(options))  # bad model: one line before anything launches
    # any set `pulse train --images` reads, its format read off it (pulse.data.image_sets); MindSpore refuses
    # --images whatever it holds, below, so its line is the one a MindSpore user sees
    if args.images and args.backend != "mindspore":
        from pulse.data.image_sets import ImageSet, check_image_set

        check_image_set(ImageSet(args.images))
    costs = Path(args.out_costs or Path("runs") / f"profile-{safe_name(spec.name)}-pp{pp}" / "costs.yaml")
    cluster = Path(args.out_cluster or costs.parent / "cluster.yaml")
    for path in (costs, cluster):
        if path.is_dir():
            raise PulseError(f"{path} is a directory; name a file for the output")
    command = job_command(args, model, options, pp, dp, mbs, costs, cluster, cuts)  # refusals before any folder
    for path, named in ((costs, args.out_costs), (cluster, args.out_cluster)):
        if named:  # a file the user named: its folder must exist (only the default runs/... one is made)
            check_target(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    print(f"launch: {shlex.join(command)}", flush=True)
    launcher = LAUNCHERS[args.backend]
    code = launch(command, launcher.output(), launcher.env(Where()), name="pulse profile")
    if code == 0:
        print(f"use them with: --costs {costs} --cluster {cluster}")
    return code


def safe_name(name: str) -> str:
    """A model name usable as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".") or "model"


if __name__ == "__main__":
    sys.exit(2)
