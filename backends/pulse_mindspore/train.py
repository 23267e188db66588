"""The per-worker training entry msrun launches: ``python -m pulse_mindspore.train --plan plan.yaml --config run.yaml``.

::

    msrun --worker_num PP*DP --local_worker_num PP*DP --master_port P --log_dir DIR --join True \\
          python -m pulse_mindspore.train --plan RUN/plan.yaml --config RUN/run.yaml
      every process: load plan + run configuration ─ world size = pp x dp? ─ pp > 1 on Ascend, or CPU with
                     torch (sends/recvs over HCCL, or gloo on CPU)   (else one line, exit 2)
      scheduler:     init() serves the cluster until the workers leave
      every worker:  resume? (the checkpoint --resume names, or none) ─ init() ─ executor for its
                     (replica, stage) ─ its share of the checkpoint ─ pulse.train.loop.run_steps
      every worker:  every --checkpoint-every steps RUN/checkpoints/step-<k>/rank-<R>.npz, worker 0 the
                     manifest (pulse_mindspore.checkpoint; found, checked, pruned as PyTorch's)
      worker 0:      a progress line per step, log.json after every step; at the end loss.png
      every worker:  a stop signal (--preempt-signals): the step, its checkpoint, exit 0 (msrun passes no code
                     on; `pulse train` exits 128 + the signal); the scheduler lets those signals pass
      every worker:  DIR/weights_rank<R>.npz (and ema_rank<R>.npz with --ema), reference checkpoint
                     names (replicas must agree) ─ barrier ─ worker 0 merges them: DIR/final_weights.npz
                     [final_weights_ema.npz] with --save-final, the pipeline folder with --export

The step (executor, data-parallel buckets, clipping, learning-rate schedule,
AdamW, EMA, the report sum) is ``pulse.train.loop``'s, the same as
PyTorch's, on the same data (``pulse.data``: synthetic latents, ``--data``
arrays or a ``pulse cache-latents`` folder, with the pipeline scheduler's betas
and prediction type). A ``diffusers:`` plan (``--pipeline DIR``) builds the
UNet's layers as MindSpore cells and loads the pipeline's weights into them by
diffusers name (``pulse_mindspore.diffusers_weights``). PyNative mode, float32.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping

import mindspore as ms
import numpy as np

from pulse import launch_env
from pulse.atomic_io import write_atomic_bytes
from pulse.args.run_args import rank_entry_parser, run_config_of
from pulse.cores import pin_process
from pulse.host_heap import keep_freed_memory
from pulse.data.feed import feed_for
from pulse.data.held_out import split_source, validation_for
from pulse.data.scheduler_config import noise_info
from pulse.data.sources import LatentSource, load_source
from pulse.errors import PulseError
from pulse.export_folder import check_new_folder
from pulse.layout import Layout
from pulse.train.resident import ResidentPeak
from pulse.plan import Plan, load_plan
from pulse.train.checkpoints import Found, find_resume
from pulse.layers.chunk_layout import param_name, reference_key
from pulse.runtime.from_plan import executor_for_rank
from pulse.train.schedules import DynamicLossScale
from pulse.train.lifecycle import Inputs, run_training
from pulse.train.loop import ScaledLoss, StepBatches, StepSettings, TrainingJob
from pulse.train.preemption import Preemption, exit_code, ignore_signals
from pulse.train.run_config import RunConfig
from pulse.train.out_of_memory import reporter
from pulse.train.run_outputs import guarded, out_dir_of
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.zoo.loading import load_model
from pulse_mindspore import checkpoint
from pulse_mindspore.backend import MindSporeBackend
from pulse_mindspore.comm import MindSporeCommunicator, p2p_devices, p2p_unsupported
from pulse_mindspore.diffusers_weights import check_trainable, weights_loader
from pulse_mindspore.diffusion import eps_loss
from pulse_mindspore.export import SHARE, ShareArrays, export_weights, merge_shares
from pulse_mindspore.traits import traits
from pulse_mindspore.msrun_env import (SCHEDULER, MsrunEnv, check_device, check_world, local_worker,
                                       mark_finished, set_hccl_timeouts)
from pulse_mindspore.weights import reference_parameters

PROG = "pulse_mindspore.train"
# --precision: the cells' compute dtype over float32 parameters (bf16 on Ascend only: the launcher says so)
COMPUTE_DTYPES = {"fp32": None, "fp16": ms.float16, "bf16": ms.bfloat16}


def check_inputs(args: argparse.Namespace, env: MsrunEnv) -> tuple[RunConfig, Plan, ModelSpec]:
    """Everything every process can check before joining the job (they all agree on it)."""
    from pulse_mindspore.traits import check_model, check_options

    config = run_config_of(args, args.config)
    check_options(config)
    plan, spec = load_plan(args.plan, load_model)
    check_model(plan.model)
    if plan.model.startswith(DIFFUSERS_PREFIX):
        check_trainable(spec, plan.model)
    elif config.export:
        raise PulseError(f"--export writes a diffusers pipeline: the plan's model '{plan.model}' is not one "
                         "(train it with --pipeline DIR)")
    if config.export:
        check_new_folder(Path(config.export), "--export")
    check_world(plan.pp, plan.dp, env)
    device = ms.get_context("device_target")
    check_device(plan.pp, device, p2p_devices(), p2p_unsupported(device))
    return config, plan, spec


def worker_inputs(config: RunConfig, plan: Plan, spec: ModelSpec, plan_path: str, lead: bool) -> Inputs:
    """The data, and the checkpoint ``--resume`` picks: refused before ``init()`` (another run's, none
    complete, nothing left to train) with one line, as PyTorch's ranks do (``pulse.train.checkpoints``)."""
    source = load_source(config.data, spec, config.seed, plan.model)
    split_source(source, config.validation_split, config.seed)  # a split that cannot be: refused before init()
    identity = checkpoint.run_identity(plan, spec, config.seed, source.name)
    return Inputs(plan, spec, source, *find_resume(config, out_dir_of(config, plan_path), plan, identity, lead))


def join_cluster(timeout: float | None, worker: bool = True) -> None:
    """``init()`` on the device MindSpore was built for; HCCL timeouts default to ``timeout``.

    On Ascend a worker binds its NPU first (msrun exports DEVICE_ID = its
    local rank); the scheduler holds no device (init() gives it mccl). On a CPU
    a worker pins itself to its cores first, as torchrun's ranks do
    (``pulse.cores.pin_process``), so ``pulse profile`` measures as training runs.
    """
    from mindspore.communication import init

    device = ms.get_context("device_target")
    if worker and device == "Ascend":
        set_hccl_timeouts(timeout)
        ms.set_device("Ascend", int(os.environ.get("DEVICE_ID", "0")))
    elif worker and device == "CPU":
        pin_process(*local_worker())
        keep_freed_memory()  # as torchrun's CPU ranks (pulse.host_heap)
    init()


def build_job(config: RunConfig, plan: Plan, spec: ModelSpec, source: LatentSource) -> TrainingJob:
    join_cluster(config.timeout)
    comm = MindSporeCommunicator(timeout=config.timeout, p2p=plan.pp > 1)  # CPU pipelines: joins gloo
    layout = Layout(plan.pp, plan.dp, comm.rank)
    for stage in range(plan.pp):  # every rank, every group, one order (register_group)
        comm.register_group(layout.stage_ranks(stage))
    for replica in range(plan.dp):
        comm.register_group(layout.replica_ranks(replica))
    loader = weights_loader(plan.model) if plan.model.startswith(DIFFUSERS_PREFIX) else None
    # its CPU runtime reserves a memory pool from malloc: the resident peak alone
    resident = ResidentPeak.start(tensors_from_malloc=False) if ms.get_context("device_target") == "CPU" else None
    backend = MindSporeBackend(seed=config.seed, lr=config.lr, load_weights=loader,
                               compute_dtype=COMPUTE_DTYPES[config.precision],
                               betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay,
                               eps=config.adam_epsilon, optimizer=config.optimizer)
    source, held = split_source(source, config.validation_split, config.seed)  # --validation-split
    feed = feed_for(plan, source, config)
    batches = StepBatches(feed.batch, layout.replica, shapes=feed.shapes_key)
    scaler = DynamicLossScale() if config.precision == "fp16" else None  # the loop unscales, skips overflows
    loss = eps_loss if scaler is None else ScaledLoss(eps_loss, backend, scaler)
    executor = executor_for_rank(plan, spec, layout.rank, backend, comm, batches, loss, config.timeout,
                                 overlap_dp=True, bucket_cap=config.bucket_bytes)
    job = TrainingJob(plan, spec, layout, backend, comm, executor, batches, StepSettings.of(config),
                      config.timeout, scaler, resident)
    job.validation = validation_for(job, held, config)
    return job


class MindSporeEntry:
    """MindSpore's hooks in the run's lifecycle (``pulse.train.lifecycle``)."""

    title = " (MindSpore)"

    def build(self, config: RunConfig, given: Inputs) -> TrainingJob:
        self.config, self.source = config, given.source
        return build_job(config, given.plan, given.spec, given.source)

    def resume(self, config: RunConfig, job: TrainingJob, found: Found) -> None:
        checkpoint.load(found, checkpoint.shard_of(job))
        if config.ema is None:
            job.backend.ema.clear()  # the saved run's average: this one keeps none
            job.backend.ema_steps = 0

    def describe(self, job: TrainingJob) -> dict:
        return {"framework": f"mindspore {ms.__version__}", "device": job.comm.device_target,
                "communication": job.comm.world_group,
                **noise_info(job.plan.model, self.config.beta_schedule, self.config.prediction_type)}

    def loop_hooks(self, config: RunConfig, out_dir: Path, job: TrainingJob, lead: bool) -> dict:
        return dict(checkpoint=checkpoint.saver(config, out_dir, job, self.source.name, self.source.num_samples),
                    checkpoint_every=config.checkpoint_every)

    def finish(self, config: RunConfig, out_dir: Path, job: TrainingJob) -> None:
        save_shares(out_dir, job)  # worker 0 merges them after the barrier

    def publish(self, config: RunConfig, out_dir: Path, plan: Plan) -> None:
        publish(config, out_dir, plan.world_size)

    def close(self) -> None:
        """Nothing: msrun's workers leave the cluster when their process ends."""


def save_shares(out_dir: Path, job: TrainingJob) -> None:
    """This worker's weights (and EMA) by reference checkpoint name; replicas of one stage write the same."""
    cells = {name: cell for chunk in job.executor.chunks.values() for name, cell in chunk.layers.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = job.layout.rank
    # each parameter's array made as it is written (reference_parameters: the tensors, not their arrays)
    savez_atomic(out_dir / f"{SHARE[False]}{rank}.npz",
                 {k: p.asnumpy for k, p in reference_parameters(job.spec, cells).items()})
    if job.backend.ema:
        savez_atomic(out_dir / f"{SHARE[True]}{rank}.npz",
                     {k: t.asnumpy for k, t in ema_tensors(job.spec, cells, job.backend.ema).items()})


def savez_atomic(path: Path, arrays: Mapping[str, checkpoint.ArraySource]) -> None:
    """``np.savez``'s layout never half-written (a reader, worker 0's merge or an export, sees the old file or
    the new), streamed array by array into the temporary file the atomic writer renames: no archive in memory."""
    write_atomic_bytes(path, lambda f: checkpoint.write_npz(f, arrays))


def ema_tensors(spec: ModelSpec, cells: dict, ema: dict[str, ms.Tensor]) -> dict[str, ms.Tensor]:
    """The backend's EMA (keyed "<layer>.<path>", float32 on the device) by reference checkpoint name."""
    return {reference_key(spec.layers[spec.index(layer)], path): ema[param_name(layer, path)]
            for layer, cell in cells.items() for path, _ in cell.parameters_and_names()}


def ema_state(spec: ModelSpec, cells: dict, ema: dict[str, ms.Tensor]) -> dict[str, np.ndarray]:
    """``ema_tensors`` as numpy, as the weights: copied to the host here, when it is asked for, and only here."""
    return {k: t.asnumpy() for k, t in ema_tensors(spec, cells, ema).items()}


def publish(config: RunConfig, out_dir: Path, world_size: int) -> None:
    """Worker 0, after every share is written: the merged weights (--save-final), the pipeline (--export)."""
    def merged(ema: bool) -> ShareArrays:  # read array by array as they are written: never all at once
        return merge_shares([out_dir / f"{SHARE[ema]}{r}.npz" for r in range(world_size)])

    with_ema = config.ema is not None
    if config.save_final:
        for ema, name in ((False, "final_weights.npz"), (True, "final_weights_ema.npz"))[:1 + with_ema]:
            savez_atomic(out_dir / name, merged(ema))
            print(f"saved {out_dir / name}", flush=True)
    if config.export:  # --ema exports the moving averages, as the PyTorch backend does
        what = f"the last step's {'EMA weights' if with_ema else 'weights'}"
        print(f"export: {export_weights(config.pipeline, merged(with_ema), Path(config.export), what)}", flush=True)


def build_parser():
    return rank_entry_parser(PROG, "msrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = MsrunEnv.read()
    scheduler = env.role == SCHEDULER
    try:
        config, plan, spec = check_inputs(args, env)
        # The scheduler checks a resume too: refused by the workers alone, it would wait in init() for
        # them until its cluster timeout (msrun waits for it). It reads the data only then, to drop it.
        given = worker_inputs(config, plan, spec, args.plan, env.speaks) \
            if not scheduler or config.resume is not None else None
    except PulseError as exc:  # identical on every process: worker 0 says it once, everybody leaves
        if env.speaks:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if scheduler:
        del given
        ignore_signals(config.preempt_signals)  # the workers' preemption checkpoint needs the cluster served
        try:
            join_cluster(config.timeout, worker=False)  # serves the cluster inside init() until the workers leave
        except RuntimeError as exc:  # a worker left the cluster: it said why; this says which, in one line
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            print(f"{PROG}: scheduler: error: {first}", file=sys.stderr, flush=True)
            return 1
        return 0
    rank = os.environ.get("RANK_ID", "?")
    preemption = Preemption.for_run(config).start()  # a stop signal: this step, its checkpoint, then leave
    code = guarded(PROG, rank, rank == "0",
                   lambda: run_training(MindSporeEntry(), config, args.plan, given, preemption),
                   reporter(traits(), args.plan, rank))
    # msrun passes no worker's exit code on, and a worker leaving non-zero has msrun SIGKILL the others (mid-exit:
    # the scheduler then reports them lost). After a preemption's checkpoint every worker leaves with 0;
    # `pulse train` exits 128 + the signal it passed on.
    code = 0 if preemption.agreed is not None and code == exit_code(preemption.agreed) else code
    if code == 0 and args.config is not None:
        mark_finished(launch_env.msrun_log_dir(args.config))
    return code


if __name__ == "__main__":
    sys.exit(main())
