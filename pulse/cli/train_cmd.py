"""`pulse train`: plan a pipeline, write the plan, launch one process per rank.

::

    pulse train --model tiny-unet --pp 2 --dp 2 --steps 20
        │ partition (cpu-local analytic costs, or --costs) + schedule + simulate
        ▼
    runs/tiny-unet-pp2-dp2/plan.yaml
        │ torchrun --standalone --nproc-per-node 4 -m pulse_torch.train --plan ... --steps 20
        ▼
    runs/tiny-unet-pp2-dp2/log.json, loss.png

    pulse train --backend mindspore --model tiny-unet --pp 1 --dp 2 --steps 20
        msrun --worker_num 2 --local_worker_num 2 --master_port <free> --log_dir RUN/msrun_logs
              --join True python -m pulse_mindspore.train --plan ... (see pulse.cli.msrun_launch)

This module stays framework-free (the core's rule): it only builds a command
line and waits for the launcher, whose output streams straight to this
terminal. Its exit code is the launcher's.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pulse.cli.common import (Setup, add_model_arguments, add_pipeline_arguments, check_positive, fmt_bytes,
                              load_model, load_setup)
from pulse.cli.msrun_launch import MsrunOutput, msrun_command, msrun_env
from pulse.errors import PlanError, PulseError
from pulse.partition import partition, plan_symmetric
from pulse.placement import Placement
from pulse.hardware import load_cluster
from pulse.plan import Plan, load_plan
from pulse.schedule.generators import BASELINES, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import validate
from pulse.sim.engine import simulate

# Options passed through to the per-rank entry as they are: (flag, attribute).
_PASSTHROUGH = (("--data", "data"), ("--seed", "seed"), ("--lr", "lr"), ("--clip", "clip"),
                ("--beta-schedule", "beta_schedule"), ("--emulate-bandwidth", "emulate_bandwidth"),
                ("--timeout", "timeout"), ("--checkpoint-every", "checkpoint_every"),
                ("--checkpoint-dir", "checkpoint_dir"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_model="tiny-unet")
    add_pipeline_arguments(parser)
    parser.set_defaults(cluster="cpu-local", precision="fp32", pp=2, microbatch_size=2)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe"), default="pulse")
    parser.add_argument("--schedule", choices=("auto", *BASELINES), default="auto",
                        help="auto: the fastest in simulation among the baselines and the ILP-synthesized "
                             "schedule (what `pulse simulate` picks)")
    parser.add_argument("--num-microbatches", type=int, default=None, help="per step and replica (default 2*pp)")
    parser.add_argument("--out-dir", default=None, help="run directory (default runs/<model>-pp<P>-dp<D>)")
    parser.add_argument("--backend", choices=tuple(LAUNCHERS), default="torch")
    parser.add_argument("--data", default=None, help=".npy/.npz latents (N, C, H, W); default synthetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (entry default)")
    parser.add_argument("--clip", type=float, default=None, help="clip the global gradient norm")
    parser.add_argument("--beta-schedule", choices=("linear", "scaled_linear"), default=None)
    parser.add_argument("--emulate-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                        help="emulate a slow asynchronous link: pipeline messages arrive as a link of this "
                             "rate would deliver them (one link each way per rank); the plan is made for it")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a send/recv may wait")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="checkpoint every N steps into --checkpoint-dir")
    parser.add_argument("--checkpoint-dir", default=None, help="default OUT_DIR/checkpoints")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                        help="continue from the newest complete checkpoint (in DIR, else --checkpoint-dir); "
                             "the plan may differ from the one that saved it")
    parser.add_argument("--save-final", action="store_true",
                        help="checkpoint the last step and write OUT_DIR/final_weights.pt")
    parser.add_argument("--plan-only", action="store_true", help="write the plan, print the command, stop")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="train exactly this plan (from `pulse tune`, `pulse simulate --out` or --plan-only); "
                             "the model and pipeline flags are then ignored")
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds of ILP synthesis for --schedule auto (as `pulse simulate`)")


def run(args: argparse.Namespace) -> int:
    check_positive(pp=args.pp, dp=args.dp, steps=args.steps, microbatch_size=args.microbatch_size,
                   folds=args.folds)
    if args.data is not None and not Path(args.data).is_file():
        raise PulseError(f"--data: no file '{args.data}' (expected .npy or .npz latents, N x C x H x W)")
    if args.checkpoint_every is not None:
        check_positive(checkpoint_every=args.checkpoint_every)
    checkpointing = args.checkpoint_every or args.checkpoint_dir or args.resume is not None or args.save_final
    if checkpointing and args.backend != "torch":  # only pulse_torch.train has them: never drop them silently
        raise PulseError("--checkpoint-every/--checkpoint-dir/--resume/--save-final need --backend torch")
    if args.resume and not Path(args.resume).is_dir():
        raise PulseError(f"--resume: no directory '{args.resume}' (expected one holding step-<k>/ checkpoints)")
    setup, plan = given_plan(args) if args.plan else (lambda st: (st, build_plan(args, st)))(load_setup(args))
    out_dir = Path(args.out_dir or Path("runs") / f"{setup.spec.name}-pp{plan.pp}-dp{plan.dp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "plan.yaml"
    plan.save(plan_path, setup.spec)
    print(describe(setup, plan))
    command = LAUNCHERS[args.backend](plan, plan_path, out_dir, args)
    print(f"plan written to {plan_path}\nlaunch: {shlex.join(command)}", flush=True)
    if args.plan_only:
        return 0
    if args.backend == "mindspore":
        return launch(command, MsrunOutput(), msrun_env())
    return launch(command)


def choose_placement(args: argparse.Namespace, setup: Setup) -> Placement:
    if args.partitioner == "pulse":
        return plan_symmetric(setup.spec, setup.costs, args.pp, folds=args.folds, strict=args.strict,
                              cluster=link_cluster(args, setup), objective=args.partition_objective,
                              num_microbatches=args.num_microbatches or 2 * args.pp).placement
    return partition(args.partitioner, setup.spec, setup.costs, args.pp, folds=args.folds, cluster=setup.cluster)


def choose_schedule(args: argparse.Namespace, placement: Placement, num_microbatches: int,
                    setup: Setup) -> Schedule:
    """``--schedule auto``: ``synthesize``'s pick (ILP vs every baseline, by simulation), as `pulse simulate`."""
    if args.schedule == "auto":
        from pulse.schedule.synth import synthesize

        return synthesize(setup.spec, placement, setup.costs, link_cluster(args, setup), num_microbatches,
                          time_limit=args.time_limit, progress=lambda m: print(f"  ilp: {m}", flush=True)).schedule
    schedule = make_schedule(args.schedule, placement, num_microbatches, setup.costs)
    validate(schedule, placement, num_microbatches)
    return schedule


def link_cluster(args: argparse.Namespace, setup: Setup):
    """The cluster the job will see: with --emulate-bandwidth, every link at that rate."""
    if args.emulate_bandwidth:
        return setup.cluster.with_link_bandwidth(args.emulate_bandwidth)
    return setup.cluster


def predict(args: argparse.Namespace, setup: Setup, placement: Placement, schedule: Schedule,
            dp: int) -> dict:
    """What the simulator says of this plan on the links the job gets (pulse.sim.step: the whole step)."""
    from pulse.sim.step import StepTerms, step_time

    predicted: dict = {"cost_source": setup.costs.source}
    cluster = link_cluster(args, setup)
    try:
        sim = simulate(setup.spec, placement, schedule, setup.costs, cluster)
        step = step_time(setup.spec, placement, setup.costs, cluster, sim, StepTerms(dp=dp, grad_bytes=4))
        predicted.update(step_seconds=step.total, bubble_ratio=sim.bubble_ratio,
                         pipeline_bytes_per_step=sim.total_link_bytes * dp, cluster=cluster.name)
    except PlanError as exc:  # e.g. more pipeline devices than the cluster file has: run unpredicted
        predicted["note"] = f"not simulated: {exc}".splitlines()[0]
    return predicted


def build_plan(args: argparse.Namespace, setup: Setup) -> Plan:
    num_microbatches = args.num_microbatches or 2 * args.pp
    check_positive(num_microbatches=num_microbatches)
    placement = choose_placement(args, setup)
    schedule = choose_schedule(args, placement, num_microbatches, setup)
    return Plan(model=args.model, cluster=args.cluster, pp=args.pp, dp=args.dp,
                microbatch_size=args.microbatch_size, num_microbatches=num_microbatches,
                partitioner=args.partitioner, placement=placement, schedule=schedule,
                model_options=setup.model_options, predicted=predict(args, setup, placement, schedule, args.dp))


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
    setup = load_setup(args)
    return setup, replace(plan, predicted=predict(args, setup, plan.placement, plan.schedule, plan.dp))


def describe(setup: Setup, plan: Plan) -> str:
    spec, placement = setup.spec, plan.placement
    chunks = " | ".join(f"dev{c.device}: {spec.layers[c.start].name}..{spec.layers[c.end - 1].name}"
                        for c in placement.chunks)
    head = (f"{spec.name}: {plan.partitioner} {placement.kind} placement, schedule "
            f"{plan.schedule.name if plan.schedule else '-'}, pp {plan.pp} x dp {plan.dp}, "
            f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch {plan.global_batch})")
    lines = [head, f"chunks: {chunks}"]
    p = plan.predicted
    if "step_seconds" in p:
        lines.append(f"predicted ({p['cost_source']}): {p['step_seconds'] * 1e3:.1f} ms/step, bubble "
                     f"{p['bubble_ratio']:.1%}, pipeline traffic {fmt_bytes(p['pipeline_bytes_per_step'])}/step")
    return "\n".join(lines)


def launcher_prefix(nproc: int) -> list[str]:
    """``torchrun --standalone`` (a free local port, so runs never collide) for ``nproc`` processes."""
    if importlib.util.find_spec("pulse_torch") is None or importlib.util.find_spec("torch") is None:
        raise PulseError("--backend torch needs PyTorch and pulse_torch: pip install -e '.[torch]'")
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", "--nproc-per-node", str(nproc)]


def torchrun_command(plan: Plan, plan_path: Path, out_dir: Path, args: argparse.Namespace) -> list[str]:
    """``torchrun --standalone`` (a free local port, so runs never collide) with one process per rank."""
    command = launcher_prefix(plan.world_size) + ["-m", "pulse_torch.train",
                          "--plan", str(plan_path), "--steps", str(args.steps), "--out-dir", str(out_dir),
                          "--precision", args.precision]
    for flag, attr in _PASSTHROUGH:
        value = getattr(args, attr, None)
        if value is not None:
            command += [flag, str(value)]
    if args.resume is not None:  # bare --resume: the entry looks in its checkpoint directory
        command += ["--resume"] + ([args.resume] if args.resume else [])
    if args.save_final:
        command.append("--save-final")
    return command


# backend name -> (plan, plan path, run dir, args) -> launch command
LAUNCHERS = {"torch": torchrun_command, "mindspore": msrun_command}


class LauncherOutput:
    """Filters torchrun's stderr: the ranks' own lines pass, torchrun's echo of their failure does not.

    When a rank fails, torchrun adds a Python traceback of itself and a
    ChildFailedError summary, and exits 1 whatever the rank's code. A rank
    that failed on bad input has printed its one line already: this keeps that
    line, drops torchrun's block (remembering each rank's exit code from it)
    and lets every other line, a rank's own traceback included, through.
    """

    _RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
    _CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
    _AGENT = re.compile(r"^[EW]\d{4} .*torch/distributed/elastic/.*\] (failed \(exitcode|Sending process)")

    def __init__(self) -> None:
        self.exit_codes: dict[int, int] = {}
        self._held: list[str] = []  # a traceback, until its exception line says whose it is
        self._summary = False
        self._rank: int | None = None

    def feed(self, line: str) -> list[str]:
        """The lines to show now."""
        if self._summary:
            self._parse_summary(line)
            return []
        if line.startswith("Traceback (most recent call last):"):
            out, self._held = self._held, [line]
            return out
        if self._held:
            self._held.append(line)
            if line[:1] in (" ", "\t"):
                return []
            held, self._held = self._held, []
            if "ChildFailedError" in line:
                self._summary = True
                return []
            return held
        return [] if self._AGENT.match(line) else [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return held

    def _parse_summary(self, line: str) -> None:
        if match := self._RANK.match(line):
            self._rank = int(match.group(1))
        elif (match := self._CODE.match(line)) and self._rank is not None:
            self.exit_codes[self._rank] = int(match.group(1))

    def failed(self) -> dict[int, int]:
        """Ranks that failed by themselves: SIGTERM (-15) is torchrun stopping the rest after one failed."""
        return {r: c for r, c in self.exit_codes.items() if c not in (0, -15)}

    def exit_code(self, launcher_code: int) -> int:
        """The failed ranks' exit code when they agree on a positive one (2: bad input), else the launcher's."""
        codes = set(self.failed().values())
        return codes.pop() if len(codes) == 1 and min(codes) > 0 and launcher_code != 0 else launcher_code

    def failure_note(self) -> str:
        how = {r: f"exit code {c}" if c >= 0 else f"signal {-c}" for r, c in sorted(self.failed().items())}
        return ", ".join(f"rank {r}: {h}" for r, h in how.items())


def launch(command: list[str], output: LauncherOutput | MsrunOutput | None = None,
           env: dict[str, str] | None = None) -> int:
    """Run the launcher: stdout straight to this terminal, stderr through ``output`` (torchrun's filter)."""
    if env is None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the host's cores; torchrun would warn otherwise
    output = LauncherOutput() if output is None else output
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert process.stderr is not None
    try:
        for line in process.stderr:
            sys.stderr.writelines(output.feed(line))
            sys.stderr.flush()
        sys.stderr.writelines(output.flush())
        code = output.exit_code(process.wait())
    except KeyboardInterrupt:  # the ranks got the same Ctrl-C; let them finish writing
        process.wait()
        raise
    if output.failed() and code != 2:  # code 2: the ranks said what was wrong in one line each already
        print(f"pulse train: the launch failed ({output.failure_note()})", file=sys.stderr)
    return code
