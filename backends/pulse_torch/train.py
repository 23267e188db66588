"""The per-rank training entry torchrun launches: ``python -m pulse_torch.train --plan plan.yaml --config run.yaml``.

::

    torchrun --standalone --nproc-per-node PP*DP -m pulse_torch.train --plan RUN/plan.yaml --config RUN/run.yaml
      every rank: load plan + run configuration ─ check world size ─ then pulse.train.lifecycle with
                  TorchEntry's hooks: join the process group ─ pulse_torch.job.build_job ─ resume?
                  ─ pulse.train.loop.run_steps
      rank 0:     a progress line per step, log.json after every step; at the end loss.png
                  (and final_weights.pt with --save-final, the merged Chrome trace with --trace)

The step itself (executor, data-parallel buckets, clipping, optimizer, the
report all-reduce) is ``pulse.train.loop``'s, the same for MindSpore. Flags
given here override ``--config``. A bad plan or launch is one line on stderr and
exit code 2; a peer that died or timed out is one line per surviving rank and
exit code 1 (``pulse.train.run_outputs.guarded``). A rank dies with its
launcher (``PR_SET_PDEATHSIG``) and leaves quietly on SIGINT. On a stop signal
(``--preempt-signals``, SIGTERM and SIGUSR1 by default) every rank finishes the step,
checkpoints it and exits 128 + the signal (``pulse.train.preemption``). A worker group
torchrun restarted (``--max-restarts``) resumes from this run's newest complete checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pulse.args.run_args import rank_entry_parser, run_config_of
from pulse.errors import PulseError
from pulse.export_folder import check_new_folder
from pulse.plan import Plan, load_plan
from pulse.data.scheduler_config import noise_info
from pulse.data.sources import LatentSource, load_source
from pulse.train.checkpoints import Found, checkpoint_root, find_resume, run_identity, step_dir
from pulse.atomic_io import write_atomic_bytes
from pulse.train.lifecycle import Inputs, run_training
from pulse.train.loop import TrainingJob
from pulse.train.preemption import Preemption
from pulse.train.run_config import RunConfig
from pulse.train.run_outputs import SampleFailed, guarded, out_dir_of
from pulse.train.out_of_memory import reporter
from pulse.train.validation import split_source
from pulse.train.validation_prompts import read_prompt_file, validation_prompts
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.zoo.loading import load_model
from pulse_torch import checkpoint
from pulse_torch.dist import check_world, die_with_parent, local_device
from pulse_torch.job import build_job
from pulse_torch.run_checkpoints import saver, shard_of
from pulse_torch.step_weights import step_weights
from pulse_torch.traits import TRAITS

PROG = "pulse_torch.train"


def check_inputs(config: RunConfig, plan_path: str, lead: bool) -> Inputs:
    """Every rank, before joining; ``TORCHELASTIC_RESTART_COUNT`` > 0: torchrun restarted the group."""
    plan, spec = load_plan(plan_path, load_model)
    check_world(plan.pp, plan.dp, int(os.environ.get("WORLD_SIZE", "1")))
    if config.export is not None:  # said now, not after the training
        check_new_folder(Path(config.export), "--export")
    if config.sample_prompts is not None:  # a bad prompt file: said now, not at the first sample
        read_prompt_file(config.sample_prompts)
    source = data_source(config, spec, plan.model)
    split_source(source, config.validation_split, config.seed)  # a split that cannot be: said now, by rank 0
    identity = run_identity(plan, spec, config.seed, source.name)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return Inputs(plan, spec, source, *find_resume(config, out_dir_of(config, plan_path), plan, identity, lead,
                                                   restart))


def data_source(config: RunConfig, spec: ModelSpec, model: str) -> LatentSource:
    """``--images``: encoded on the fly by the pipeline's encoders (on this rank's device); else ``--data``."""
    if config.images is None:
        return load_source(config.data, spec, config.seed, model)
    from pulse.data.image_sets import image_set_of
    from pulse_torch.pipeline.onthefly import ImageSource

    return ImageSource(config.pipeline, image_set_of(config), spec, config.seed, config.random_flip, local_device(),
                       config.precision, config.bad_samples, config.skipped_samples, buckets=config)


def sampler_hook(config: RunConfig, out_dir: Path, device: str):
    """Rank 0's ``--sample-every`` hook: images from the checkpoint just written, their paths (for
    TensorBoard). The prompt file, read here, was checked by `pulse train` and ``check_inputs``. A failure is
    ``SampleFailed``, raised once the failed pipeline is gone from the device; the loop's guard says it
    and records it in log.json, and training goes on (``pulse.train.run_outputs.guard_samples``)."""
    from pulse_torch.diffusers_adapter.lora import lora_of
    from pulse_torch.pipeline.samples import release_device_cache, write_samples

    prompts = validation_prompts(config.sample_prompt, config.sample_prompts, config.validation_negative_prompt,
                                 guidance_scale=config.guidance_scale, seed=config.validation_seed)

    def sample(step: int) -> list[Path]:
        failure = None
        try:
            paths = write_samples(config.pipeline, step_dir(checkpoint_root(config, out_dir), step), step, out_dir,
                                  prompts, config.sample_steps, config.seed, device, bool(config.ema), lora_of(config))
        except Exception as exc:  # noqa: BLE001 - a failed preview must not end hours of training
            failure = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if failure is not None:  # outside the handler: its traceback, which held the pipeline, is gone
            release_device_cache(device)
            raise SampleFailed(failure)
        print(f"samples: wrote {', '.join(str(p) for p in paths)}", flush=True)
        return paths
    return sample


def publish(config: RunConfig, out_dir: Path) -> None:
    """Rank 0, after the last checkpoint: final_weights.pt (--save-final), the pipeline folder (--export)."""
    root = checkpoint_root(config, out_dir)
    if config.save_final:
        for ema, name in ((False, "final_weights.pt"), (True, "final_weights_ema.pt"))[:1 + bool(config.ema)]:
            # views of the mapped rank files, not clones: torch.save writes each where it lies
            weights = dict(step_weights(step_dir(root, config.steps), config.steps, ema=ema))
            write_atomic_bytes(out_dir / name, lambda f: torch.save(weights, f))
            del weights
    if config.export and config.lora_rank is not None:  # the adapters, as diffusers' LoRA scripts write them
        from pulse_torch.diffusers_adapter.lora import export_lora, lora_of

        where = step_dir(root, config.steps)
        weights = checkpoint.merge_weights(where, config.steps, ema=bool(config.ema))
        said = export_lora(config.pipeline, weights, lora_of(config), Path(config.export), str(where), config.fuse)
        print(f"export: {said}", flush=True)
    elif config.export:
        from pulse.data.pipeline_folder import read_pipeline
        from pulse_torch.export import export_step

        said = export_step(read_pipeline(config.pipeline), config.steps, step_dir(root, config.steps),
                           Path(config.export), ema=bool(config.ema))
        print(f"export: {said}", flush=True)


class TorchEntry:
    """PyTorch's hooks in the run's lifecycle (``pulse.train.lifecycle``)."""

    title = ""

    def build(self, config: RunConfig, given: Inputs) -> TrainingJob:
        self.config, self.source = config, given.source
        first = given.found.step if given.found is not None else 0  # --resume's step: the first this run takes
        job, self.ctx = build_job(config, given.plan, given.spec, given.source, first)
        return job

    def resume(self, config: RunConfig, job: TrainingJob, found: Found) -> None:
        checkpoint.load(found, shard_of(job))

    def describe(self, job: TrainingJob) -> dict:
        return {"process_group": self.ctx.backend, "device": self.ctx.device, "threads": torch.get_num_threads(),
                "framework": f"torch {torch.__version__}",
                **noise_info(job.plan.model, self.config.beta_schedule, self.config.prediction_type)}

    def loop_hooks(self, config: RunConfig, out_dir: Path, job: TrainingJob, lead: bool) -> dict:
        return dict(checkpoint=saver(config, out_dir, job, self.source.name, self.source.num_samples),
                    checkpoint_every=config.checkpoint_every,
                    checkpoint_last=config.save_final or config.export is not None,
                    sample=sampler_hook(config, out_dir, self.ctx.device) if lead and config.sample_every else None,
                    sample_every=config.sample_every)

    def finish(self, config: RunConfig, out_dir: Path, job: TrainingJob) -> None:
        """Nothing: the checkpoints hold every rank's weights (rank 0 wrote the last manifest itself)."""

    def publish(self, config: RunConfig, out_dir: Path, plan: Plan) -> None:
        publish(config, out_dir)

    def close(self) -> None:
        dist.destroy_process_group()


def build_parser():
    return rank_entry_parser(PROG, "torchrun")


def preload(argv: list[str]) -> None:
    """What every rank of this run imports before its first step, imported once in a launcher that forks
    the ranks (``pulse_torch.forked_ranks``, which ignores its failures: the ranks say what is wrong): a
    diffusers model's libraries (~5 s of CPU a rank)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)  # --plan only: the ranks' parser refuses what is wrong
    parser.add_argument("--plan")
    path = parser.parse_known_args(argv)[0].plan
    if path is None:
        return
    plan, _ = load_plan(path)
    if plan.model.startswith(DIFFUSERS_PREFIX):
        from pulse_torch.diffusers_adapter.stage_loading import import_libraries

        import_libraries(plan.model)


LEAD_SPEAKS_S = 10.0  # a rank other than the lead waits this long on bad input (seen: rank 2 first, no line)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone (even by SIGKILL): no orphan rank trains on
    # torchrun passes a Ctrl-C on as SIGINT: leave at once and quietly (every file is written atomically)
    signal.signal(signal.SIGINT, lambda signum, _frame: os._exit(128 + signum))
    args = build_parser().parse_args(argv)
    lead = os.environ.get("RANK", "0") == "0"
    try:  # identical on every rank: said once
        config = run_config_of(args, args.config)
        preemption = Preemption.for_run(config).start()  # from here on a stop signal waits for a checkpoint
        given = check_inputs(config, args.plan, lead)
    except PulseError as exc:
        if lead:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank once the first leaves: leaving first would silence the lead's line
            time.sleep(LEAD_SPEAKS_S)
        return 2
    rank = os.environ.get("RANK", "0")
    return guarded(PROG, rank, lead, lambda: run_training(TorchEntry(), config, args.plan, given, preemption),
                   reporter(TRAITS, args.plan, rank))


if __name__ == "__main__":
    sys.exit(main())
