"""The per-rank training entry torchrun launches: ``python -m pulse_torch.train --plan plan.yaml``.

::

    torchrun --standalone --nproc-per-node PP*DP -m pulse_torch.train --plan plan.yaml --steps S
      every rank: load plan ─ check world size ─ init_distributed ─ executor for its (replica, stage)
      every step: executor.run_step (F/B/sends/recvs, DP gradient all-reduce)
                  ─ clip by the pipeline's global norm ─ AdamW
                  ─ one all-reduce of (loss, bytes) so every rank agrees on them
      rank 0:     a progress line per step; at the end DIR/log.json and DIR/loss.png

``--emulate-bandwidth B`` wraps the communicator in ``ThrottledCommunicator``
(an asynchronous link of B bytes/s: messages arrive when such a link would deliver them). A bad plan or launch is one
line on stderr and exit code 2 (rank 0 says it once when every rank would);
a peer that died or timed out is one line per surviving rank and exit code 1.

``--checkpoint-every N`` saves DIR/checkpoints/step-<k> (``pulse_torch.checkpoint``),
keeping the newest ``--checkpoints-total-limit`` ones; ``--resume [DIR]`` continues
from the newest complete one, under this plan or another, if it is this run's
(model, options, seed, data: ``--resume-any`` to take another's); ``--save-final``
also checkpoints the last step and writes DIR/final_weights.pt (every parameter
by ``<layer>.<param>``). Rank 0 rewrites log.json after every step (a resumed
run keeps the earlier steps); a non-finite loss stops every rank (exit code 2).
A rank dies with its launcher (``PR_SET_PDEATHSIG``) and leaves quietly on SIGINT.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pulse.cli.common import (OneLineParser, finite_non_negative_float, finite_positive_float, fmt_bytes,
                              int_between, learning_rate, load_model, output_dir, output_file, positive_int,
                              seconds_float, seed_int)
from pulse.errors import PulseError
from pulse.plan import Plan, load_plan
from pulse.progress import Progress
from pulse.runtime.errors import CommTimeout
from pulse.runtime.executor import StageExecutor
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.views.trace import write_measured_trace
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse_torch import checkpoint, faults
from pulse_torch.backend import TorchBackend
from pulse_torch.comm import TorchCommunicator
from pulse_torch.data import DiffusionFeed, LatentSource, Sampler, load_source
from pulse_torch.diffusion import eps_loss, make_schedule
from pulse_torch.dist import DistContext, check_world, die_with_parent, init_distributed
from pulse_torch.runlog import StepRecord, read_history, write_log, write_loss_plot
from pulse_torch.throttle import ThrottledCommunicator

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m pulse_torch.train",
                           description="Run one rank of a PULSE plan (launch with torchrun).")
    parser.add_argument("--plan", required=True, help="plan YAML written by `pulse train` or `pulse plan`")
    parser.add_argument("--steps", type=int_between(1, 10**9), default=20)
    parser.add_argument("--data", default=None, help=".npy/.npz latents (N, C, H, W); default synthetic")
    parser.add_argument("--out-dir", type=output_dir, default=None, help="where log.json and loss.png go (default: the plan's)")
    parser.add_argument("--seed", type=seed_int, default=0, help="weights, data order, noise and timesteps")
    parser.add_argument("--lr", type=learning_rate, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--clip", type=finite_non_negative_float, default=1.0, help="global gradient-norm clip (0: off)")
    parser.add_argument("--precision", choices=tuple(AUTOCAST), default="fp32",
                        help="bf16/fp16: autocast the forward (parameters stay fp32; no loss scaling)")
    parser.add_argument("--beta-schedule", choices=("linear", "scaled_linear"), default="linear")
    parser.add_argument("--emulate-bandwidth", type=finite_positive_float, default=None, metavar="BYTES_PER_S",
                        help="emulated asynchronous link: pipeline messages arrive as a link of BYTES_PER_S "
                             "would deliver them (pulse_torch.throttle)")
    parser.add_argument("--timeout", type=seconds_float, default=300.0, help="seconds any send/recv/all-reduce may wait")
    parser.add_argument("--checkpoint-every", type=int_between(0, 10**9), default=0, metavar="N",
                        help="save a checkpoint after every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", type=output_dir, default=None, help="where step-<k>/ go (default OUT_DIR/checkpoints)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                        help="continue from the newest complete checkpoint in DIR (default: --checkpoint-dir); "
                             "without DIR, start from step 0 when there is none (but not when every one there "
                             "is broken)")
    parser.add_argument("--resume-any", action="store_true",
                        help="resume a checkpoint of another run too (other model, options, seed or data)")
    parser.add_argument("--checkpoints-total-limit", type=positive_int, default=None, metavar="N",
                        help="keep only the newest N complete checkpoints (older ones are deleted)")
    parser.add_argument("--trace", type=output_file, default=None, metavar="FILE",
                        help="Chrome-trace JSON of the last step as it ran on every rank (the measured twin "
                             "of `pulse simulate --trace`)")
    parser.add_argument("--save-final", action="store_true",
                        help="checkpoint the last step too and write OUT_DIR/final_weights.pt")
    return parser


class AutocastBackend(TorchBackend):
    """``TorchBackend`` whose chunk forwards run under ``torch.autocast`` (mixed precision).

    Parameters and optimizer state stay fp32; the backward follows the
    autocast graph without a context of its own, as autograd requires.
    """

    def __init__(self, *, autocast: torch.dtype, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.autocast = autocast

    def forward(self, chunk, inputs, grad_names):  # type: ignore[override]
        with torch.autocast(self.device.type, dtype=self.autocast):
            return super().forward(chunk, inputs, grad_names)


class StepBatches:
    """The executor's ``Batches``: microbatches of one replica at the current step.

    ``rank`` and ``middle`` place the ``die`` fault hook (``pulse_torch.faults``):
    fetching microbatch ``middle`` happens half-way through a rank's actions.
    """

    def __init__(self, feed: DiffusionFeed, replica: int, rank: int = 0, middle: int = 0) -> None:
        self.feed, self.replica, self.step = feed, replica, 0
        self.rank, self.middle = rank, middle

    def __call__(self, microbatch: int) -> dict[str, torch.Tensor]:
        if microbatch == self.middle:
            faults.maybe_fail("die", self.rank, self.step + 1)
        return self.feed.batch(self.step, self.replica, microbatch)


@dataclass
class Rank:
    """Everything one process needs to train its share of the plan."""

    plan: Plan
    spec: ModelSpec
    ctx: DistContext
    backend: TorchBackend
    comm: TorchCommunicator | ThrottledCommunicator
    executor: StageExecutor
    batches: StepBatches
    data_name: str
    timeout: float | None
    trace: list[dict] = field(default_factory=list)  # the last step's measured timeline (--trace)


def make_backend(args: argparse.Namespace, device: str, plan: Plan) -> TorchBackend:
    common = dict(device=device, seed=args.seed, lr=args.lr, max_grad_norm=args.clip or None)
    autocast = AUTOCAST[args.precision]
    if plan.model.startswith(DIFFUSERS_PREFIX):  # the user's own model: chunks wrap its modules
        if autocast is not None:
            raise PulseError("--precision fp32 only for diffusers models (cast the model or train fp32)")
        from pulse_torch.diffusers_adapter import load_diffusers

        adapter = load_diffusers(plan.model, device=device, **plan.model_options)
        return adapter.backend(lr=args.lr, max_grad_norm=args.clip or None, seed=args.seed)
    return TorchBackend(**common) if autocast is None else AutocastBackend(autocast=autocast, **common)


def setup_rank(args: argparse.Namespace, plan: Plan, spec: ModelSpec, source: LatentSource) -> Rank:
    # torch.optim.Optimizer.__init__ imports torch._dynamo on first use (2-4 s of CPU): pay it here,
    # not inside step 0's timing.
    import torch._dynamo  # noqa: F401

    ctx = init_distributed(plan.pp, plan.dp, timeout_s=args.timeout)
    torch.manual_seed(args.seed)  # nothing should draw from it; if something does, it is repeatable
    if ctx.device != "cpu":  # CPU kernels here are deterministic already; this call costs ~4 s of start-up
        torch.use_deterministic_algorithms(True, warn_only=True)
    backend = make_backend(args, ctx.device, plan)
    comm: Any = TorchCommunicator.from_context(ctx, timeout=args.timeout)
    if args.emulate_bandwidth:
        comm = ThrottledCommunicator(comm, args.emulate_bandwidth, backend.nbytes)
    sampler = Sampler(source.num_samples, plan.microbatch_size, plan.num_microbatches, plan.dp, args.seed)
    feed = DiffusionFeed(source, sampler, make_schedule(args.beta_schedule), args.seed, ctx.device)
    batches = StepBatches(feed, ctx.layout.replica, ctx.layout.rank, plan.num_microbatches // 2)
    executor = make_executor(plan, spec, ctx, backend, comm, batches, args.timeout)
    return Rank(plan, spec, ctx, backend, comm, executor, batches, source.name, args.timeout)


def make_executor(plan: Plan, spec: ModelSpec, ctx: DistContext, backend: TorchBackend, comm: Any,
                  batches: StepBatches, timeout: float | None) -> StageExecutor:
    """The rank's executor; data-parallel gradients are all-reduced one bucket per chunk,
    overlapped with the rest of the backward (``pulse.runtime.grad_sync``), as the simulator prices it."""
    if plan.schedule is None:
        raise PulseError(f"{plan.model}: the plan has no schedule; write it with `pulse train --plan-only`")
    layout = ctx.layout
    return StageExecutor(device=layout.stage, spec=spec, placement=plan.placement,
                         schedule=lower(plan.schedule, spec, plan.placement), backend=backend,
                         comm=comm, batches=batches, loss_fn=eps_loss, pipeline_ranks=layout.pp_ranks(),
                         dp_group=layout.dp_ranks(), timeout=timeout, overlap_dp=True)


def _sent(comm: Any) -> tuple[int, int]:
    return sum(comm.bytes_sent.values()), comm.allreduce_bytes


def train_step(rank: Rank, step: int, phases: list[dict] | None = None) -> StepRecord:
    """One optimizer step; every rank returns the same record.

    ``phases``: when given, the step's measured timeline goes there (``--trace``): every action
    of the executor, then the launcher's phases, in seconds from the step's start.
    """
    ex, comm = rank.executor, rank.comm
    p2p0, ar0 = _sent(comm)
    start = time.perf_counter()
    ex.timeline = [] if phases is not None else None
    marks = [("actions", start)]
    rank.batches.step = step
    stats = ex.run_step()
    marks.append(("data-parallel buckets", time.perf_counter()))
    comm.wait_sends()
    marks.append(("wait sends", time.perf_counter()))
    chunks = list(ex.chunks.values())
    norm = rank.backend.step_rank(chunks, comm, rank.ctx.layout.pp_ranks())
    marks.append(("clip + optimizer", time.perf_counter()))
    p2p1, ar1 = _sent(comm)
    losses = list(stats.losses.values())
    totals = torch.tensor([sum(losses), len(losses), p2p1 - p2p0, ar1 - ar0], dtype=torch.float64)
    try:
        dist.all_reduce(totals)  # bookkeeping: not counted in the communicator's bytes
    except RuntimeError as exc:  # a peer died between its step and this: say so in one line
        raise CommTimeout(f"rank {rank.ctx.layout.rank}: step {step + 1}'s loss all-reduce failed "
                          f"({' '.join(str(exc).split())})") from None
    seconds = time.perf_counter() - start
    if phases is not None:
        phases.extend(step_timeline(ex, start, marks, start + seconds))
        ex.timeline = None
    loss_sum, count, p2p, ar = totals.tolist()
    return StepRecord(step, loss_sum / max(count, 1.0), seconds, rank.plan.global_batch / seconds,
                      int(p2p), int(ar), norm)


def step_timeline(ex: StageExecutor, start: float, marks: list[tuple[str, float]], end: float) -> list[dict]:
    """The executor's actions, then the launcher's phases (each ends at the next mark), from ``start``."""
    spans = [{"label": a.label, "kind": a.kind, "start": a.start - start, "end": a.end - start}
             for a in ex.timeline or []]
    last = max((a.end for a in ex.timeline or []), default=start)
    ends = [last] + [t for _, t in marks[1:]] + [end]
    names = [name for name, _ in marks[1:]] + ["report all-reduce"]
    return spans + [{"label": n, "kind": "step", "start": a - start, "end": b - start}
                     for n, a, b in zip(names, ends, ends[1:])]


class NonFiniteLoss(PulseError):
    """The loss became NaN or infinite: every rank stops (they all see the same all-reduced loss)."""


def run(args: argparse.Namespace, rank: Rank, start: int = 0, history: list[dict] | None = None) -> list[StepRecord]:
    """Steps ``start .. args.steps - 1``, checkpointing as asked; rank 0 rewrites log.json after each step
    (``history``: the steps a resumed run's log already held), so a crash loses at most the step running."""
    records: list[StepRecord] = []
    lead = rank.ctx.layout.rank == 0
    with Progress(args.steps - start, "train", stream=sys.stdout, log_every=0.0, enabled=lead) as bar:
        for step in range(start, args.steps):
            traced = args.trace and step == args.steps - 1
            r = train_step(rank, step, rank.trace if traced else None)
            if not math.isfinite(r.loss):
                raise NonFiniteLoss(f"step {step + 1}: the loss is {r.loss} (non-finite); training stopped. "
                                    "Lower --lr, check the data for NaN/inf values, or try --precision fp32")
            records.append(r)
            bar.update(1, note=f"loss {r.loss:.4f} | {r.samples_per_s:7.1f} samples/s | "
                               f"p2p {fmt_bytes(r.pipeline_bytes)} | all-reduce {fmt_bytes(r.allreduce_bytes)}")
            if lead:
                write_log(out_dir_of(args) / "log.json", run_info(args, rank),
                          [*(history or []), *(asdict(x) for x in records)])
            done = step + 1
            if (args.checkpoint_every and done % args.checkpoint_every == 0) or \
                    (args.save_final and done == args.steps):
                save_checkpoint(args, rank, done)
    return records


# -- checkpoints (pulse_torch.checkpoint does the work; these say where and what) ---------------------
def out_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.out_dir) if args.out_dir else Path(args.plan).parent


def checkpoint_root(args: argparse.Namespace) -> Path:
    return Path(args.checkpoint_dir) if args.checkpoint_dir else out_dir_of(args) / "checkpoints"


def shard_of(rank: Rank) -> checkpoint.Shard:
    layout = rank.ctx.layout
    chunks = [rank.executor.chunks[c] for c in sorted(rank.executor.chunks)]
    return checkpoint.Shard(rank.backend, chunks, layout.rank, layout.pp * layout.dp, layout.replica)


def save_checkpoint(args: argparse.Namespace, rank: Rank, step: int) -> None:
    plan = rank.plan
    data = checkpoint.data_position(step, plan.global_batch, rank.batches.feed.source.num_samples)
    identity = checkpoint.run_identity(plan, rank.spec, args.seed, rank.data_name)
    info = checkpoint.manifest_info(plan, rank.spec, args.seed, data, identity)
    shard = shard_of(rank)
    root = checkpoint_root(args)
    where = checkpoint.save(root, step, shard, rank.comm, info, checkpoint.layers_by_rank(plan, rank.spec),
                            rank.timeout, lambda: faults.maybe_fail("crash-during-checkpoint", shard.rank, step))
    if shard.rank == 0:  # every rank's file is on disk (the manifest waited for them): tidy up
        checkpoint.remove_temp_files(root)
        pruned = checkpoint.prune(root, args.checkpoints_total_limit) if args.checkpoints_total_limit else []
        gone = f"; removed {', '.join(p.name for p in pruned)}" if pruned else ""
        print(f"checkpoint: wrote {where}{gone}", flush=True)


def find_resume(args: argparse.Namespace, plan: Plan, identity: dict,
                lead: bool) -> tuple[checkpoint.Found | None, str]:
    """The checkpoint to resume from (None: start from step 0) and the line that says so."""
    if args.resume is None:
        return None, ""
    root = Path(args.resume) if args.resume else checkpoint_root(args)
    if lead:  # a crash's temporary files; nobody writes here before this run does
        checkpoint.remove_temp_files(root)
    found, skipped = checkpoint.find_latest(root)
    if found is None:
        why = f" (ignored incomplete {', '.join(skipped)})" if skipped else ""
        if args.resume or skipped:  # a directory named on purpose, or every checkpoint broken: not a fresh start
            raise PulseError(f"--resume {root}: no complete checkpoint there{why}; remove the broken step "
                             "folders to start from step 0")
        return None, f"resume: no checkpoint in {root}; starting from step 0"
    mismatch = checkpoint.identity_mismatch(found, identity)
    if mismatch and not args.resume_any:
        raise PulseError(f"--resume: {found.path} is another run's checkpoint ({'; '.join(mismatch)}); resume "
                         "this run's own checkpoints, or give --resume-any to continue from it anyway")
    if found.step >= args.steps:
        raise PulseError(f"--resume: the checkpoint in {found.path} is at step {found.step} but --steps is "
                         f"{args.steps}: nothing left to train (raise --steps)")
    line = checkpoint.describe_resume(found, plan, args.seed, skipped)
    return found, line + (f"; another run's, taken on --resume-any: {'; '.join(mismatch)}" if mismatch else "")


def run_info(args: argparse.Namespace, rank: Rank) -> dict:
    plan = rank.plan
    return {"plan": str(args.plan), "model": plan.model, "pp": plan.pp, "dp": plan.dp,
            "world_size": plan.world_size, "partitioner": plan.partitioner, "placement": plan.placement.kind,
            "schedule": plan.schedule.name if plan.schedule else None,
            "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
            "global_batch": plan.global_batch, "steps": args.steps, "seed": args.seed, "lr": args.lr,
            "clip": args.clip, "precision": args.precision, "beta_schedule": args.beta_schedule,
            "data": rank.data_name, "emulate_bandwidth": args.emulate_bandwidth,
            "process_group": rank.ctx.backend, "device": rank.ctx.device,
            "threads": torch.get_num_threads(), "predicted": dict(plan.predicted)}


def load_and_check(args: argparse.Namespace) -> tuple[Plan, ModelSpec, LatentSource]:
    """Everything every rank can check before joining the job (they all agree on it)."""
    if args.steps < 1:
        raise PulseError(f"--steps must be >= 1, got {args.steps}")
    if args.checkpoint_every < 0:
        raise PulseError(f"--checkpoint-every must be >= 0 (0: never), got {args.checkpoint_every}")
    faults.planned()  # a malformed PULSE_FAULT is bad input, said before anything runs
    if not args.clip >= 0:  # "not >=" also catches NaN
        raise PulseError(f"--clip must be >= 0 (0: no clipping), got {args.clip}")
    positive = {"--lr": args.lr, "--timeout": args.timeout, "--emulate-bandwidth": args.emulate_bandwidth}
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise PulseError(f"{flag} must be > 0, got {value}")
    plan, spec = load_plan(args.plan, load_model)
    assert spec is not None
    check_world(plan.pp, plan.dp, int(os.environ.get("WORLD_SIZE", "1")))
    return plan, spec, load_source(args.data, spec, args.seed)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone (even by SIGKILL): no orphan rank trains on
    # torchrun passes a Ctrl-C on as SIGINT: leave at once and quietly (every file is written atomically)
    signal.signal(signal.SIGINT, lambda signum, _frame: os._exit(128 + signum))
    args = build_parser().parse_args(argv)
    lead = os.environ.get("RANK", "0") == "0"
    try:
        plan, spec, source = load_and_check(args)
        found, note = find_resume(args, plan, checkpoint.run_identity(plan, spec, args.seed, source.name), lead)
        history = read_history(out_dir_of(args) / "log.json", found.step) if found is not None and lead else []
    except PulseError as exc:  # identical on every rank: say it once
        if lead:
            print(f"pulse_torch.train: error: {exc}", file=sys.stderr)
        return 2
    if note and lead:
        print(note, flush=True)
    try:
        rank = setup_rank(args, plan, spec, source)
        if found is not None:
            checkpoint.load(found, shard_of(rank))
        start = found.step if found is not None else 0
        records = run(args, rank, start, history)
    except CommTimeout as exc:  # a peer died or hung: not bad input
        print(f"pulse_torch.train: rank {os.environ.get('RANK', '0')}: error: {exc}", file=sys.stderr, flush=True)
        # Leave at once: tearing down a process group with a dead peer can block, and the
        # ranks waiting on this one learn of the failure only when its sockets close.
        sys.stdout.flush()
        os._exit(1)
    except NonFiniteLoss as exc:  # the same on every rank: say it once
        if lead:
            print(f"pulse_torch.train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except PulseError as exc:
        print(f"pulse_torch.train: rank {os.environ.get('RANK', '0')}: error: {exc}", file=sys.stderr)
        return 2
    if args.trace:
        write_rank_trace(args, rank)
        rank.comm.barrier()  # every rank's part of the trace is on disk before rank 0 merges them
    if rank.ctx.layout.rank == 0:
        write_outputs(args, rank, records)
    rank.comm.barrier()  # nobody closes its sockets while rank 0 still writes or a peer still talks
    dist.destroy_process_group()
    return 0


def write_rank_trace(args: argparse.Namespace, rank: Rank) -> None:
    part = Path(f"{args.trace}.rank-{rank.ctx.layout.rank}.json")
    part.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic_bytes(part, lambda f: f.write(json.dumps(rank.trace).encode()))


def merge_trace(args: argparse.Namespace, world: int) -> Path:
    """Rank 0: every rank's part into one Chrome trace; the parts go."""
    parts = {r: Path(f"{args.trace}.rank-{r}.json") for r in range(world)}
    spans = {r: json.loads(p.read_text()) for r, p in parts.items()}
    path = write_measured_trace(spans, args.trace)
    for p in parts.values():
        p.unlink()
    return path


def write_outputs(args: argparse.Namespace, rank: Rank, records: list[StepRecord]) -> None:
    plan = rank.plan
    out_dir = out_dir_of(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.save_final:  # rank 0 wrote the last step's manifest itself: every file is on disk
        weights = checkpoint.merge_weights(checkpoint.step_dir(checkpoint_root(args), args.steps), args.steps)
        checkpoint.write_atomic_bytes(out_dir / "final_weights.pt", lambda f: torch.save(weights, f))
    if args.trace:
        print(f"trace: wrote {merge_trace(args, plan.world_size)}", flush=True)
    history = read_history(out_dir / "log.json", records[0].step) if records else []
    summary = write_log(out_dir / "log.json", run_info(args, rank), [*history, *(asdict(r) for r in records)])
    write_loss_plot(out_dir / "loss.png", records, f"{plan.model} pp{plan.pp} x dp{plan.dp}, "
                    f"{plan.placement.kind} + {summary['schedule']}")
    print(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
          f"{summary['median_step_seconds'] * 1e3:.1f} ms/step, {summary['samples_per_s']:.1f} samples/s; "
          f"wrote {out_dir / 'log.json'} and {out_dir / 'loss.png'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
