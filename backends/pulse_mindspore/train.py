"""The per-worker training entry msrun launches: ``python -m pulse_mindspore.train --plan plan.yaml``.

::

    msrun --worker_num PP*DP --local_worker_num PP*DP --master_port P --log_dir DIR --join True \\
          python -m pulse_mindspore.train --plan plan.yaml --steps S
      every process: load plan ─ world size = pp x dp? ─ pp > 1 on Ascend, or CPU with torch (else one line, exit 2)
      scheduler:     init() serves the cluster until the workers leave
      every worker:  init() ─ executor for its (replica, stage)
      every step:    executor.run_step (F/B, sends/recvs: HCCL, or gloo on CPU) ─ one flat gradient all-reduce over
                     the data-parallel group, averaged ─ clip by the pipeline's norm ─ AdamW
                     ─ one all-reduce of (loss, bytes) so every worker agrees on them
      worker 0:      a progress line per step; at the end DIR/log.json and DIR/loss.png
      every worker:  DIR/weights_rank<R>.npz (reference checkpoint names: replicas must agree)

Same objective as ``pulse_torch.train``: DDPM linear betas 1e-4..0.02 over
1000 steps, epsilon-prediction MSE, synthetic smooth latents
(``pulse_mindspore.feed``), AdamW. PyNative mode, float32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mindspore as ms

from pulse.cli.common import (OneLineParser, finite_non_negative_float, fmt_bytes, int_between, learning_rate,
                              load_model, output_dir, seconds_float, seed_int)
from pulse.errors import PulseError
from pulse.plan import Plan, load_plan
from pulse.progress import Progress
from pulse.runtime.executor import StageExecutor
from pulse.schedule.passes import add_send_recv
from pulse.spec import ModelSpec
from pulse_mindspore.backend import MindSporeBackend
from pulse_mindspore.comm import MindSporeCommunicator, p2p_devices, p2p_unsupported
from pulse_mindspore.diffusion import eps_loss
from pulse_mindspore.feed import DiffusionFeed, Sampler, SyntheticLatents
from pulse_mindspore.msrun_env import SCHEDULER, MsrunEnv, check_device, check_world, set_hccl_timeouts
from pulse_mindspore.weights import export_weights
from pulse_torch.dist import Layout  # framework-free: rank = replica * pp + stage
from pulse_torch.runlog import StepRecord, write_log, write_loss_plot  # framework-free: the same log.json as torch runs

PROG = "pulse_mindspore.train"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"python -m {PROG}", description="Run one worker of a PULSE plan (launch with msrun).")
    parser.add_argument("--plan", required=True, help="plan YAML written by `pulse train` or `pulse plan`")
    parser.add_argument("--steps", type=int_between(1, 10**9), default=20)
    parser.add_argument("--out-dir", type=output_dir, default=None, help="where log.json, loss.png and weights go (default: the plan's)")
    parser.add_argument("--seed", type=seed_int, default=0, help="weights, data order, noise and timesteps")
    parser.add_argument("--lr", type=learning_rate, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--clip", type=finite_non_negative_float, default=1.0, help="global gradient-norm clip (0: off)")
    parser.add_argument("--timeout", type=seconds_float, default=300.0,
                        help="seconds any send/recv/all-reduce may wait (also HCCL's, unless exported)")
    return parser


class StepBatches:
    """The executor's ``Batches``: microbatches of one replica at the current step."""

    def __init__(self, feed: DiffusionFeed, replica: int) -> None:
        self.feed, self.replica, self.step = feed, replica, 0

    def __call__(self, microbatch: int) -> dict[str, Any]:
        return self.feed.batch(self.step, self.replica, microbatch)


@dataclass
class Rank:
    """Everything one worker needs to train its share of the plan."""

    plan: Plan
    spec: ModelSpec
    layout: Layout
    backend: MindSporeBackend
    comm: MindSporeCommunicator
    executor: StageExecutor
    batches: StepBatches
    data_name: str
    timeout: float | None


def load_and_check(args: argparse.Namespace, env: MsrunEnv) -> tuple[Plan, ModelSpec]:
    """Everything every process can check before joining the job (they all agree on it)."""
    if args.steps < 1:
        raise PulseError(f"--steps must be >= 1, got {args.steps}")
    if not args.clip >= 0:  # "not >=" also catches NaN
        raise PulseError(f"--clip must be >= 0 (0: no clipping), got {args.clip}")
    for flag, value in {"--lr": args.lr, "--timeout": args.timeout}.items():
        if not value > 0:
            raise PulseError(f"{flag} must be > 0, got {value}")
    plan, spec = load_plan(args.plan, load_model)
    assert spec is not None
    check_world(plan.pp, plan.dp, env)
    device = ms.get_context("device_target")
    check_device(plan.pp, device, p2p_devices(), p2p_unsupported(device))
    return plan, spec


def join_cluster(timeout: float | None, worker: bool = True) -> None:
    """``init()`` on the device MindSpore was built for; HCCL timeouts default to ``timeout``.

    On Ascend a worker binds its NPU first (msrun exports DEVICE_ID = its
    local rank); the scheduler holds no device (init() gives it mccl).
    """
    from mindspore.communication import init

    if worker and ms.get_context("device_target") == "Ascend":
        set_hccl_timeouts(timeout)
        ms.set_device("Ascend", int(os.environ.get("DEVICE_ID", "0")))
    init()


def setup_rank(args: argparse.Namespace, plan: Plan, spec: ModelSpec) -> Rank:
    join_cluster(args.timeout)
    comm = MindSporeCommunicator(timeout=args.timeout, p2p=plan.pp > 1)  # CPU pipelines: joins gloo
    layout = Layout(plan.pp, plan.dp, comm.rank)
    for stage in range(plan.pp):  # members create their groups (mindspore.communication.create_group)
        comm.register_group([r * plan.pp + stage for r in range(plan.dp)])
    for replica in range(plan.dp):
        comm.register_group([replica * plan.pp + s for s in range(plan.pp)])
    backend = MindSporeBackend(seed=args.seed, lr=args.lr, max_grad_norm=args.clip or None)
    source = SyntheticLatents(spec, seed=args.seed)
    sampler = Sampler(source.num_samples, plan.microbatch_size, plan.num_microbatches, plan.dp, args.seed)
    batches = StepBatches(DiffusionFeed(spec, source, sampler, args.seed), layout.replica)
    if plan.schedule is None:
        raise PulseError(f"{plan.model}: the plan has no schedule; write it with `pulse train --plan-only`")
    # Data-parallel gradients: one bucket per chunk, as the simulator prices (pulse.runtime.grad_sync).
    executor = StageExecutor(device=layout.stage, spec=spec, placement=plan.placement,
                             schedule=add_send_recv(plan.schedule, spec, plan.placement), backend=backend,
                             comm=comm, batches=batches, loss_fn=eps_loss, pipeline_ranks=layout.pp_ranks(),
                             dp_group=layout.dp_ranks(), timeout=args.timeout, overlap_dp=True)
    return Rank(plan, spec, layout, backend, comm, executor, batches, source.name, args.timeout)


def _sent(comm: MindSporeCommunicator) -> tuple[int, int]:
    return sum(comm.bytes_sent.values()), comm.allreduce_bytes


def train_step(rank: Rank, step: int) -> StepRecord:
    """One optimizer step; every worker returns the same record."""
    ex, comm = rank.executor, rank.comm
    p2p0, ar0 = _sent(comm)
    start = time.perf_counter()
    rank.batches.step = step
    stats = ex.run_step()
    comm.wait_sends(rank.timeout)
    chunks = list(ex.chunks.values())
    norm = rank.backend.step_rank(chunks, comm, rank.layout.pp_ranks())
    p2p1, ar1 = _sent(comm)
    losses = list(stats.losses.values())
    loss_sum, count, p2p, ar = comm.sum_values([sum(losses), len(losses), p2p1 - p2p0, ar1 - ar0], rank.timeout)
    seconds = time.perf_counter() - start
    return StepRecord(step, loss_sum / max(count, 1.0), seconds, rank.plan.global_batch / seconds,
                      int(p2p), int(ar), norm)


def run(args: argparse.Namespace, rank: Rank) -> list[StepRecord]:
    records = []
    with Progress(args.steps, "train", stream=sys.stdout, log_every=0.0, enabled=rank.layout.rank == 0) as bar:
        for step in range(args.steps):
            r = train_step(rank, step)
            records.append(r)
            bar.update(1, note=f"loss {r.loss:.4f} | {r.samples_per_s:7.2f} samples/s | "
                               f"p2p {fmt_bytes(r.pipeline_bytes)} | all-reduce {fmt_bytes(r.allreduce_bytes)}")
    return records


def run_info(args: argparse.Namespace, rank: Rank) -> dict:
    plan = rank.plan
    return {"plan": str(args.plan), "model": plan.model, "pp": plan.pp, "dp": plan.dp,
            "world_size": plan.world_size, "partitioner": plan.partitioner, "placement": plan.placement.kind,
            "schedule": plan.schedule.name if plan.schedule else None,
            "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
            "global_batch": plan.global_batch, "steps": args.steps, "seed": args.seed, "lr": args.lr,
            "clip": args.clip, "precision": "fp32", "beta_schedule": "linear", "data": rank.data_name,
            "framework": f"mindspore {ms.__version__}", "device": rank.comm.device_target,
            "communication": rank.comm.world_group, "predicted": dict(plan.predicted)}


def out_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.out_dir) if args.out_dir else Path(args.plan).parent


def save_weights(args: argparse.Namespace, rank: Rank) -> Path:
    """This worker's layers by reference checkpoint name; replicas of one stage must write the same."""
    cells = {name: cell for chunk in rank.executor.chunks.values() for name, cell in chunk.layers.items()}
    path = out_dir_of(args) / f"weights_rank{rank.layout.rank}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    export_weights(rank.spec, cells, path)
    return path


def write_outputs(args: argparse.Namespace, rank: Rank, records: list[StepRecord]) -> None:
    plan, out_dir = rank.plan, out_dir_of(args)
    summary = write_log(out_dir / "log.json", run_info(args, rank), [asdict(r) for r in records])
    write_loss_plot(out_dir / "loss.png", records, f"{plan.model} pp{plan.pp} x dp{plan.dp} (MindSpore), "
                    f"{plan.placement.kind} + {summary['schedule']}")
    print(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
          f"{summary['median_step_seconds'] * 1e3:.1f} ms/step, {summary['samples_per_s']:.2f} samples/s; "
          f"wrote {out_dir / 'log.json'}, {out_dir / 'loss.png'} and weights_rank*.npz", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = MsrunEnv.read()
    try:
        plan, spec = load_and_check(args, env)
    except PulseError as exc:  # identical on every process: worker 0 says it once, everybody leaves
        if env.speaks:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if env.role == SCHEDULER:
        join_cluster(args.timeout, worker=False)  # serves the cluster inside init() until the workers leave
        return 0
    try:
        rank = setup_rank(args, plan, spec)
        records = run(args, rank)
    except PulseError as exc:
        print(f"{PROG}: rank {os.environ.get('RANK_ID', '?')}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    save_weights(args, rank)
    if rank.layout.rank == 0:
        write_outputs(args, rank, records)
    rank.comm.barrier()  # nobody leaves while worker 0 still writes
    return 0


if __name__ == "__main__":
    sys.exit(main())
