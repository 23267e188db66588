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

This module stays framework-free (the core's rule): it only builds a command
line and waits for the launcher, whose output streams straight to this
terminal. Its exit code is the launcher's (128 + the signal when stopped).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pulse.cli.common import (Setup, add_model_arguments, add_pipeline_arguments, check_positive,
                              finite_non_negative_float, finite_positive_float, fmt_bytes, int_between,
                              learning_rate, load_model, load_setup, output_dir, path_safe_name, positive_int,
                              seconds_float, seed_int, MAX_COUNT, host_address)
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
                ("--checkpoint-dir", "checkpoint_dir"), ("--checkpoints-total-limit", "checkpoints_total_limit"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_model="tiny-unet")
    add_pipeline_arguments(parser)
    parser.set_defaults(cluster="cpu-local", precision="fp32", pp=2, microbatch_size=2)
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument("--steps", type=int_between(1, 10**9), default=20)
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe"), default="pulse")
    parser.add_argument("--schedule", choices=("auto", *BASELINES), default="auto",
                        help="auto: the fastest in simulation among the baselines and the ILP-synthesized "
                             "schedule (what `pulse simulate` picks)")
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="per step and replica (default 2*pp)")
    parser.add_argument("--out-dir", type=output_dir, default=None, help="run directory (default runs/<model>-pp<P>-dp<D>)")
    parser.add_argument("--backend", choices=tuple(LAUNCHERS), default="torch")
    parser.add_argument("--data", default=None, help=".npy/.npz latents (N, C, H, W); default synthetic")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--lr", type=learning_rate, default=None, help="AdamW learning rate (entry default)")
    parser.add_argument("--clip", type=finite_non_negative_float, default=None, help="clip the global gradient norm")
    parser.add_argument("--beta-schedule", choices=("linear", "scaled_linear"), default=None)
    parser.add_argument("--emulate-bandwidth", type=finite_positive_float, default=None, metavar="BYTES_PER_S",
                        help="emulate a slow asynchronous link: pipeline messages arrive as a link of this "
                             "rate would deliver them (one link each way per rank); the plan is made for it")
    parser.add_argument("--timeout", type=seconds_float, default=None, help="seconds a send/recv may wait")
    parser.add_argument("--checkpoint-every", type=int_between(1, 10**9), default=None, metavar="N",
                        help="checkpoint every N steps into --checkpoint-dir")
    parser.add_argument("--checkpoint-dir", type=output_dir, default=None, help="default OUT_DIR/checkpoints")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                        help="continue from the newest complete checkpoint (in DIR, else --checkpoint-dir); "
                             "the plan may differ from the one that saved it")
    parser.add_argument("--resume-any", action="store_true",
                        help="resume even from a checkpoint of another run (other model, seed, data or plan family)")
    parser.add_argument("--checkpoints-total-limit", type=positive_int, default=None, metavar="N",
                        help="keep only the newest N complete checkpoints")
    parser.add_argument("--save-final", action="store_true",
                        help="checkpoint the last step and write OUT_DIR/final_weights.pt")
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
    check_arguments(args)
    setup, plan = given_plan(args) if args.plan else (lambda st: (st, build_plan(args, st)))(load_setup(args))
    check_fits(setup, plan, args.force)
    out_dir = Path(args.out_dir or Path("runs") / f"{path_safe_name(setup.spec.name)}-pp{plan.pp}-dp{plan.dp}")
    if plan.world_size % args.nnodes:
        raise PulseError(f"the plan's {plan.world_size} ranks do not split evenly over --nnodes {args.nnodes}")
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


def check_arguments(args: argparse.Namespace) -> None:
    """What the flags say on their own, before any planning."""
    check_positive(pp=args.pp, dp=args.dp, steps=args.steps, microbatch_size=args.microbatch_size,
                   folds=args.folds)
    if args.data is not None and not Path(args.data).is_file():
        raise PulseError(f"--data: no file '{args.data}' (expected .npy or .npz latents, N x C x H x W)")
    checkpointing = (args.checkpoint_every or args.checkpoint_dir or args.resume is not None or args.save_final
                     or args.checkpoints_total_limit or args.resume_any)
    if checkpointing and args.backend != "torch":  # only pulse_torch.train has them: never drop them silently
        raise PulseError("--checkpoint-every/--checkpoint-dir/--resume/--save-final need --backend torch")
    if args.resume and not Path(args.resume).is_dir():
        raise PulseError(f"--resume: no directory '{args.resume}' (expected one holding step-<k>/ checkpoints)")
    if args.nnodes > 1 or args.master_addr != "127.0.0.1" or args.master_port:
        if args.backend != "torch":
            raise PulseError("--nnodes/--node-rank/--master-addr/--master-port need --backend torch")
        if args.nnodes > 1 and not args.master_port:
            raise PulseError("--nnodes > 1 needs a fixed --master-port that every node uses")
    if args.node_rank >= args.nnodes:
        raise PulseError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: ranks are 0..{args.nnodes - 1}")


def check_fits(setup: Setup, plan: Plan, force: bool) -> None:
    """Refuse a plan whose simulated peak exceeds the device's memory (unless ``--force``)."""
    peak = plan.predicted.get("peak_memory_bytes")
    capacity = setup.cluster.hardware.memory_bytes
    if peak is None or peak <= capacity:
        return
    message = (f"the plan needs {peak / 2**30:.1f} GiB per device in simulation but a {setup.cluster.hardware.name} "
               f"device has {capacity / 2**30:.1f} GiB; raise --pp, lower --microbatch-size or the model's size, "
               "or give --force to launch anyway")
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
                    setup: Setup) -> Schedule:
    """``--schedule auto``: ``synthesize``'s pick (ILP vs every baseline, by simulation), as `pulse simulate`."""
    if args.schedule == "auto":
        from pulse.synth import synthesize

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
    from pulse.cli.figures import sim_figures
    from pulse.sim.step import StepTerms, step_time

    predicted: dict = {"cost_source": setup.costs.source}
    cluster = link_cluster(args, setup)
    try:
        sim = simulate(setup.spec, placement, schedule, setup.costs, cluster)
        step = step_time(setup.spec, placement, setup.costs, cluster, sim, StepTerms(dp=dp, grad_bytes=4))
        predicted.update(sim_figures(sim, step, dp), cluster=cluster.name)  # the names simulate/tune use
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


def launcher_prefix(nproc: int, master_addr: str = "127.0.0.1", master_port: int = 0, nnodes: int = 1,
                    node_rank: int = 0) -> list[str]:
    """torchrun for ``nproc`` processes on this node, its store listening on ``master_addr`` only.

    ``pulse_torch.launch`` binds the store's socket itself (torchrun's own store would listen
    on every interface); port 0 picks a free one, so single-node runs never collide.
    """
    if importlib.util.find_spec("pulse_torch") is None or importlib.util.find_spec("torch") is None:
        raise PulseError("--backend torch needs PyTorch and pulse_torch: pip install -e '.[torch]'")
    return [sys.executable, "-m", "pulse_torch.launch", "--bind", master_addr, "--port", str(master_port),
            "--node-rank", str(node_rank), "--", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]


def torchrun_command(plan: Plan, plan_path: Path, out_dir: Path, args: argparse.Namespace) -> list[str]:
    """torchrun (its store on loopback, or on --master-addr) with one process per rank of this node."""
    prefix = launcher_prefix(plan.world_size // args.nnodes, args.master_addr, args.master_port or 0, args.nnodes,
                             args.node_rank)
    command = prefix + ["-m", "pulse_torch.train",
                          "--plan", str(plan_path), "--steps", str(args.steps), "--out-dir", str(out_dir),
                          "--precision", args.precision]
    for flag, attr in _PASSTHROUGH:
        value = getattr(args, attr, None)
        if value is not None:
            command += [flag, str(value)]
    if args.resume is not None:  # bare --resume: the entry looks in its checkpoint directory
        command += ["--resume"] + ([args.resume] if args.resume else [])
    for flag, on in (("--save-final", args.save_final), ("--resume-any", args.resume_any)):
        if on:
            command.append(flag)
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
    """Run the launcher: stdout straight to this terminal, stderr through ``output`` (torchrun's filter).

    The launcher gets a process group of its own and dies with this process
    (``die_with_parent``); SIGTERM and SIGINT sent here are passed on to it, and
    it stops its ranks. Ranks die with their launcher (``pulse_torch.train``).
    """
    if env is None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the host's cores; torchrun would warn otherwise
    output = LauncherOutput() if output is None else output
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1,
                               start_new_session=True, preexec_fn=_die_with_parent)
    assert process.stderr is not None
    received: list[int] = []
    previous = {sig: signal.signal(sig, _forward_to(process, received)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for line in process.stderr:
            sys.stderr.writelines(output.feed(line))
            sys.stderr.flush()
        sys.stderr.writelines(output.flush())
        code = output.exit_code(_wait(process, received))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:  # this process is leaving for another reason: take the launcher along
            _kill_group(process, signal.SIGKILL)
    if received:
        print(f"pulse train: stopped by {signal.Signals(received[0]).name}; the launcher and its ranks have exited",
              file=sys.stderr)
        return 128 + received[0]
    if output.failed() and code != 2:  # code 2: the ranks said what was wrong in one line each already
        print(f"pulse train: the launch failed ({output.failure_note()})", file=sys.stderr)
    return code


STOP_GRACE_SECONDS = 40.0  # torchrun gives its ranks 30 s after SIGTERM before SIGKILL


def _die_with_parent() -> None:
    """In the launcher's child, before exec: SIGTERM it when ``pulse train`` dies, even by SIGKILL."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _forward_to(process: subprocess.Popen, received: list[int]):
    def forward(signum: int, _frame) -> None:
        received.append(signum)
        _kill_group(process, signum)
    return forward


def _wait(process: subprocess.Popen, received: list[int]) -> int:
    """The launcher's exit code; after a forwarded signal, SIGKILL it if it outstays the grace period."""
    while True:
        try:
            return process.wait(timeout=STOP_GRACE_SECONDS if received else None)
        except subprocess.TimeoutExpired:
            _kill_group(process, signal.SIGKILL)
