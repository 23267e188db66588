"""A ``--sample-every`` sample that fails is a warning line and a record in log.json; training goes on.

::

    LoopHooks.sample (the backend's) ─ guard_samples (run_training wraps it) ─ fails?
        stderr:   warning: samples: step k: sampling failed (Type: why); training goes on
        log.json: summary["sample_failures"] += {step, error}, written at once
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pulse.train import lifecycle
from pulse.train.run_config import RunConfig
from pulse.train.run_outputs import SampleFailed, StepLog, guard_samples
from pulse.train.runlog import StepRecord

RECORD = StepRecord(step=0, loss=1.0, seconds=0.5, samples_per_s=4.0, pipeline_bytes=0, allreduce_bytes=0,
                    grad_norm=None)
INFO = {"schedule": "1f1b", "global_batch": 2, "placement": "sequential"}


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "sampling failed" in line]


def test_a_failed_sample_is_a_warning_and_a_log_record_and_training_goes_on(tmp_path: Path, capsys) -> None:
    log = StepLog(tmp_path / "log.json", INFO)
    log([RECORD])

    def out_of_memory(step: int) -> None:
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")

    guard_samples(out_of_memory, log)(1)  # returns: the run is not ended
    err = warnings(capsys.readouterr().err)
    assert err == ["warning: samples: step 1: sampling failed (RuntimeError: CUDA out of memory. Tried to "
                   "allocate 2.00 GiB); training goes on"]
    summary = json.loads((tmp_path / "log.json").read_text())["summary"]  # on disk now, not at the next rewrite
    assert summary["sample_failures"] == [{"step": 1, "error": "RuntimeError: CUDA out of memory. Tried to "
                                                                "allocate 2.00 GiB"}]
    guard_samples(lambda step: None, log)(2)  # one that works adds nothing
    log.flush()
    assert len(json.loads((tmp_path / "log.json").read_text())["summary"]["sample_failures"]) == 1


def test_a_run_that_samples_fine_logs_no_failures(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "log.json", INFO)
    log([RECORD])
    assert json.loads((tmp_path / "log.json").read_text())["summary"]["sample_failures"] == []


class Job:
    layout = SimpleNamespace(rank=0)
    comm = SimpleNamespace(barrier=lambda: None)


class Entry:
    """A backend whose sample hook always fails, in the real lifecycle."""

    title = ""

    def build(self, config, given):
        return Job()

    def describe(self, job):
        return {}

    def loop_hooks(self, config, out_dir, job, lead):
        def sample(step: int) -> None:
            raise SampleFailed("PipelineError: no model_index.json")
        return dict(sample=sample, sample_every=1)

    def finish(self, config, out_dir, job):
        pass

    def publish(self, config, out_dir, plan):
        pass

    def close(self):
        pass


def test_the_lifecycle_guards_the_backends_sample_hook(tmp_path: Path, capsys, monkeypatch) -> None:
    def two_steps(job, steps, start, hooks):  # as the loop calls its hooks: the log, then the sample
        records = []
        for step in range(steps):
            records.append(StepRecord(**{**RECORD.__dict__, "step": step}))
            hooks.after_step(records, True)
            hooks.sample(step + 1)
        return records

    monkeypatch.setattr(lifecycle, "run_steps", two_steps)
    plan = SimpleNamespace(model="m", pp=1, dp=1, world_size=1, partitioner="p", placement=SimpleNamespace(kind="s"),
                           schedule=None, microbatch_size=1, num_microbatches=2, global_batch=2, predicted={})
    given = lifecycle.Inputs(plan, None, SimpleNamespace(name="synthetic"), None, "")
    config = RunConfig(steps=2, out_dir=str(tmp_path))
    assert lifecycle.run_training(Entry(), config, str(tmp_path / "plan.yaml"), given) == 0
    assert len(warnings(capsys.readouterr().err)) == 2
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["summary"]["sample_failures"] == [{"step": s, "error": "PipelineError: no model_index.json"}
                                                 for s in (1, 2)]
    assert [s["step"] for s in log["steps"]] == [0, 1]  # trained on past both


def test_the_torch_sampler_raises_its_failure_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pulse_torch.train import sampler_hook

    config = RunConfig(pipeline=str(tmp_path / "no-pipeline"), sample_every=1, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(SampleFailed, match=r"^PipelineError: .*no-pipeline") as failed:
        sampler_hook(config, tmp_path, "cpu")(1)
    assert "\n" not in str(failed.value) and failed.value.__context__ is None  # the pipeline's frames are gone
