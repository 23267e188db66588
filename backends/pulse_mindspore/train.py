"""The per-worker training entry msrun launches: ``python -m pulse_mindspore.train --plan plan.yaml --config run.yaml``.

::

    msrun --worker_num PP*DP --local_worker_num PP*DP --master_port P --log_dir DIR --join True \\
          python -m pulse_mindspore.train --plan RUN/plan.yaml --config RUN/run.yaml
      every process: load plan + run configuration ─ world size = pp x dp? ─ pp > 1 on Ascend, or CPU with
                     torch (sends/recvs over HCCL, or gloo on CPU)   (else one line, exit 2)
      scheduler:     init() serves the cluster until the workers leave
      every worker:  init() ─ executor for its (replica, stage) ─ pulse.runtime.loop.run_steps
      worker 0:      a progress line per step, log.json after every step; at the end loss.png
      every worker:  DIR/weights_rank<R>.npz (reference checkpoint names: replicas must agree)

The step (executor, data-parallel buckets, clipping, AdamW, the report sum) is
``pulse.runtime.loop``'s, the same as PyTorch's. Same objective as
``pulse_torch.train``: DDPM linear betas, epsilon-prediction MSE, synthetic
smooth latents or ``--data`` (``pulse.data``, the same arrays as PyTorch's). PyNative mode, float32.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import mindspore as ms

from pulse.cli.run_args import rank_entry_parser, run_config_of
from pulse.data.feed import feed_for
from pulse.data.scheduler_config import noise_info
from pulse.data.sources import load_source
from pulse.errors import PulseError
from pulse.layout import Layout
from pulse.plan import Plan, load_plan
from pulse.runtime.from_plan import executor_for_rank
from pulse.runtime.loop import LoopHooks, StepBatches, StepSettings, TrainingJob, run_steps
from pulse.runtime.run_config import RunConfig
from pulse.runtime.run_outputs import StepLog, finish_log, guarded, out_dir_of, run_info
from pulse.spec import ModelSpec
from pulse.zoo.loading import load_model
from pulse_mindspore.backend import MindSporeBackend
from pulse_mindspore.comm import MindSporeCommunicator, p2p_devices, p2p_unsupported
from pulse_mindspore.diffusion import eps_loss
from pulse_mindspore.msrun_env import SCHEDULER, MsrunEnv, check_device, check_world, set_hccl_timeouts
from pulse_mindspore.weights import export_weights

PROG = "pulse_mindspore.train"


def check_inputs(args: argparse.Namespace, env: MsrunEnv) -> tuple[RunConfig, Plan, ModelSpec]:
    """Everything every process can check before joining the job (they all agree on it)."""
    from pulse.cli.msrun_launch import check_options

    config = run_config_of(args, args.config)
    check_options(config)
    plan, spec = load_plan(args.plan, load_model)
    check_world(plan.pp, plan.dp, env)
    device = ms.get_context("device_target")
    check_device(plan.pp, device, p2p_devices(), p2p_unsupported(device))
    return config, plan, spec


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


def build_job(config: RunConfig, plan: Plan, spec: ModelSpec) -> tuple[TrainingJob, str]:
    join_cluster(config.timeout)
    comm = MindSporeCommunicator(timeout=config.timeout, p2p=plan.pp > 1)  # CPU pipelines: joins gloo
    layout = Layout(plan.pp, plan.dp, comm.rank)
    for stage in range(plan.pp):  # members create their groups (mindspore.communication.create_group)
        comm.register_group(layout.stage_ranks(stage))
    for replica in range(plan.dp):
        comm.register_group(layout.replica_ranks(replica))
    backend = MindSporeBackend(seed=config.seed, lr=config.lr)
    source = load_source(config.data, spec, config.seed, plan.model)
    feed = feed_for(plan, source, config)
    batches = StepBatches(feed.batch, layout.replica, layout.rank, plan.num_microbatches // 2)
    executor = executor_for_rank(plan, spec, layout.rank, backend, comm, batches, eps_loss, config.timeout,
                                 overlap_dp=True)
    return TrainingJob(plan, spec, layout, backend, comm, executor, batches, StepSettings.of(config),
                       config.timeout), source.name


def train(config: RunConfig, plan: Plan, spec: ModelSpec, plan_path: str) -> int:
    job, data_name = build_job(config, plan, spec)
    out_dir, lead = out_dir_of(config, plan_path), job.layout.rank == 0
    info = run_info(plan, plan_path, config, data_name, {
        "framework": f"mindspore {ms.__version__}", "device": job.comm.device_target,
        "communication": job.comm.world_group,
        **noise_info(plan.model, config.beta_schedule, config.prediction_type)})
    log = StepLog(out_dir / "log.json", info, report_to=config.report_to if lead else None)
    records = run_steps(job, config.steps, hooks=LoopHooks(after_step=log if lead else None))
    save_weights(out_dir, job)
    if lead:
        finish_log(log, records, f"{plan.model} pp{plan.pp} x dp{plan.dp} (MindSpore)")
    job.comm.barrier()  # nobody leaves while worker 0 still writes
    return 0


def save_weights(out_dir: Path, job: TrainingJob) -> Path:
    """This worker's layers by reference checkpoint name; replicas of one stage must write the same."""
    cells = {name: cell for chunk in job.executor.chunks.values() for name, cell in chunk.layers.items()}
    path = out_dir / f"weights_rank{job.layout.rank}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    export_weights(job.spec, cells, path)
    return path


def build_parser():
    return rank_entry_parser(PROG, "msrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = MsrunEnv.read()
    try:
        config, plan, spec = check_inputs(args, env)
    except PulseError as exc:  # identical on every process: worker 0 says it once, everybody leaves
        if env.speaks:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if env.role == SCHEDULER:
        join_cluster(config.timeout, worker=False)  # serves the cluster inside init() until the workers leave
        return 0
    rank = os.environ.get("RANK_ID", "?")
    return guarded(PROG, rank, rank == "0", lambda: train(config, plan, spec, args.plan))


if __name__ == "__main__":
    sys.exit(main())
