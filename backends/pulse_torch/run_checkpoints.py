"""The torchrun job's checkpoint hook for the loop (which one to resume: ``pulse.train.checkpoints.find_resume``)."""
from __future__ import annotations

import sys
from pathlib import Path

from pulse.train import checkpoints
from pulse.train.checkpoint_space import agree_on_space
from pulse.train.checkpoints import checkpoint_root
from pulse.train.loop import TrainingJob
from pulse.train.run_config import RunConfig
from pulse_torch import checkpoint


def shard_of(job: TrainingJob) -> checkpoint.Shard:
    layout = job.layout
    chunks = [job.executor.chunks[c] for c in sorted(job.executor.chunks)]
    return checkpoint.Shard(job.backend, chunks, layout.rank, layout.pp * layout.dp, layout.replica)


def saver(config: RunConfig, out_dir: Path, job: TrainingJob, data_name: str, num_samples: int):
    """The loop's checkpoint hook: every rank writes its shard, rank 0 the manifest, then tidies up; a step
    whose files would not fit on the filesystem is skipped whole, on every rank (``checkpoint_space``)."""
    def save(step: int, preempted: str | None = None) -> None:  # preempted: the stop signal's name
        plan = job.plan
        data = checkpoints.data_position(step, plan.global_batch, num_samples)
        identity = checkpoints.run_identity(plan, job.spec, config.seed, data_name)
        info = checkpoints.manifest_info(plan, job.spec, config.seed, data, identity, preempted, config.optimizer)
        shard = shard_of(job)
        root = checkpoint_root(config, out_dir)
        need = checkpoint.payload_bytes(checkpoint.rank_payload(shard, step, data))
        space = agree_on_space(job.comm, shard.rank, shard.world_size, need, root, job.timeout)
        if not space.fits:  # every rank took the same verdict: no rank writes, no partial step
            if shard.rank == 0:
                print(space.warning(step, root), file=sys.stderr, flush=True)
            return
        where = checkpoint.save(root, step, shard, job.comm, info, checkpoints.layers_by_rank(plan, job.spec),
                                job.timeout)
        if shard.rank == 0:  # every rank's file is on disk (the manifest waited for them): tidy up
            checkpoints.remove_temp_files(root)
            pruned = checkpoints.prune(root, config.checkpoints_total_limit, identity) if config.checkpoints_total_limit else []
            gone = f"; removed {', '.join(p.name for p in pruned)}" if pruned else ""
            print(f"checkpoint: wrote {where}{gone}", flush=True)
    return save
