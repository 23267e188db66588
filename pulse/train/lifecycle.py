"""One training run's lifecycle, the same for every backend; the backend fills in its hooks.

::

    check    every rank: plan, run config, data, the checkpoint --resume picks   (the entry, before joining)
    join     every rank: the process group, then its executor            BackendEntry.build
    resume   its share of the checkpoint                                 BackendEntry.resume
    run      pulse.train.loop.run_steps, log.json on rank 0 every step, checkpoints, samples, validation losses
    finish   every rank: what it leaves besides checkpoints               BackendEntry.finish
    publish  rank 0, once every rank's files are on disk: merged weights, the pipeline folder, the trace
    close    every rank leaves together                                  BackendEntry.close

A stop signal (``--preempt-signals``; the entry handles them from the moment it has read its
configuration: ``pulse.train.preemption``) ends the run after the step every rank votes on: its
checkpoint, a barrier (no rank leaves before the manifest is on disk, or a launcher seeing it go
would stop the others mid-write), close, and the exit code 128 + the signal instead of finish and publish.

``pulse_torch.train`` (torchrun) and ``pulse_mindspore.train`` (msrun) parse, check and guard;
both run ``run_training``.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pulse.plan import Plan
from pulse.spec import ModelSpec
from pulse.train.checkpoints import Found
from pulse.train.loop import LoopHooks, TrainingJob, run_steps
from pulse.train.preemption import Preempted, Preemption, exit_code
from pulse.train.run_config import RunConfig
from pulse.train.validation import validation_every
from pulse.train.run_outputs import (StepLog, finish_log, guard_samples, history_before, merge_trace, out_dir_of,
                                     run_info, write_trace_part)


@dataclass
class Inputs:
    """What every rank checks before joining the job (they all agree on it)."""

    plan: Plan
    spec: ModelSpec
    source: Any  # pulse.data.sources.LatentSource (pulse.data builds on pulse.train: not imported here)
    found: Found | None  # the checkpoint --resume picked, or None
    note: str  # what rank 0 says about it


class BackendEntry(Protocol):
    """A backend's part of the run: ``title`` ends the closing line (" (MindSpore)")."""

    title: str

    def build(self, config: RunConfig, given: Inputs) -> TrainingJob:
        """Join the process group and build this rank's job (backend, communicator, executor)."""

    def resume(self, config: RunConfig, job: TrainingJob, found: Found) -> None:
        """Load this rank's share of ``found``."""

    def describe(self, job: TrainingJob) -> dict[str, Any]:
        """log.json's run facts beyond the plan's: framework, device, process group."""

    def loop_hooks(self, config: RunConfig, out_dir: Path, job: TrainingJob, lead: bool) -> dict[str, Any]:
        """``LoopHooks`` fields beyond the log and trace (checkpoints, samples)."""

    def finish(self, config: RunConfig, out_dir: Path, job: TrainingJob) -> None:
        """Every rank, after the last step: what it writes besides checkpoints (before the barrier)."""

    def publish(self, config: RunConfig, out_dir: Path, plan: Plan) -> None:
        """Rank 0, every rank's files on disk: merged weights (--save-final), the pipeline (--export)."""

    def close(self) -> None:
        """Every rank, after the last barrier: leave the process group."""


def run_training(entry: BackendEntry, config: RunConfig, plan_path: str, given: Inputs,
                 preemption: Preemption | None = None) -> int:
    """Join, resume, run the steps, finish and publish; 0 when done, 128 + the signal when preempted
    (failures raise, ``guarded`` says them). ``preemption``: the entry's, started (None: no stop signals)."""
    plan = given.plan
    out_dir = out_dir_of(config, plan_path)
    job = entry.build(config, given)  # a stop during the join (minutes for a large model): voted on in step 1
    lead = job.layout.rank == 0
    if preemption is not None and preemption.signals:
        preemption.speaks = lead
        job.preemption = preemption.start()  # again: the join may have installed handlers of its own
    if given.note and lead:
        print(given.note, flush=True)
    if given.found is not None:
        entry.resume(config, job, given.found)
    start = given.found.step if given.found is not None else 0
    info = run_info(plan, plan_path, config, given.source.name, entry.describe(job))
    history = history_before(out_dir, start) if given.found is not None else []
    log = StepLog(out_dir / "log.json", info, history, config.report_to if lead else None)
    trace: list[dict] = []
    every = validation_every(config.validation_every, config.sample_every)  # --validation-split's cadence
    hooks = LoopHooks(after_step=log if lead else None, trace=trace if config.trace else None, freeze_gc=True,
                      validate=getattr(job, "validation", None), validate_every=every,
                      **entry.loop_hooks(config, out_dir, job, lead))
    if hooks.sample is not None:  # a failed sample: a warning and a log.json record, never the run's end
        hooks.sample = guard_samples(hooks.sample, log if lead else None)
    try:
        records = run_steps(job, config.steps, start, hooks)
    except Preempted as stop:
        return leave_preempted(entry, job, stop, lead)
    entry.finish(config, out_dir, job)
    if config.trace:
        write_trace_part(config.trace, job.layout.rank, trace)
    job.comm.barrier()  # every rank's files (and trace part) are on disk before rank 0 publishes
    if lead:
        entry.publish(config, out_dir, plan)
        if config.trace:
            print(f"trace: wrote {merge_trace(config.trace, plan.world_size)}", flush=True)
        finish_log(log, records, f"{plan.model} pp{plan.pp} x dp{plan.dp}{entry.title}")
    job.comm.barrier()  # nobody closes its sockets while rank 0 still writes or a peer still talks
    entry.close()
    return 0


def leave_preempted(entry: BackendEntry, job: TrainingJob, stop: Preempted, lead: bool) -> int:
    """After the preemption's checkpoint: every rank waits for the manifest, then leaves."""
    job.comm.barrier()
    if lead:
        kept = "the checkpoint line above says where" if stop.checkpointed else "no checkpoint hook: nothing written"
        print(f"preempted: {signal.Signals(stop.signum).name} after step {stop.step}, checkpointed ({kept}); "
              f"`--resume` continues from the newest complete checkpoint; `pulse train` exits "
              f"{exit_code(stop.signum)}", flush=True)
    entry.close()
    return exit_code(stop.signum)
