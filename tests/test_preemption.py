"""Preemption and restarts without processes: the signals' logic, the vote in the step's sum, the loop's
stop, which checkpoint a restarted group resumes, and the launch command lines.

::

    Preemption.note(signal, moment)   stop | duplicate (within DUPLICATE_S) | leave (a second signal)
    votes -> sum over ranks -> agree  every rank stops for the same signal after the same step
    run_steps                         log, the checkpoint of that step marked preempted, Preempted
    find_resume(restart=N)            this run's newest complete checkpoint, never another run's

Real processes (SIGTERM mid-run, a second one during the write, SIGKILL under --max-restarts):
tests/test_preemption_processes.py.
"""
from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from pulse.errors import PulseError
from pulse.train import checkpoints, loop
from pulse.train.loop import LoopHooks
from pulse.train.preemption import (DUPLICATE_S, Preempted, Preemption, exit_code, signal_names, signal_numbers)
from pulse.train.run_config import RunConfig
from pulse.train.runlog import StepRecord

TERM, USR1 = int(signal.SIGTERM), int(signal.SIGUSR1)


def test_signal_names_are_checked_and_kept_in_one_spelling() -> None:
    assert signal_names("TERM,USR1") == signal_names("sigterm, SIGUSR1") == ("TERM", "USR1")
    assert signal_names("none") == signal_names("") == ()
    assert signal_numbers("USR1,TERM") == (USR1, TERM)
    assert RunConfig(preempt_signals="term").preempt_signals == "TERM"
    assert RunConfig(preempt_signals="").preempt_signals == "none"
    assert RunConfig().preempt_signals == "TERM,USR1" and RunConfig().preempt_grace == 25.0
    for bad, says in (("KILL", "unknown signal 'KILL'"), ("TERM,TERM", "named twice")):
        with pytest.raises(PulseError, match=says):
            RunConfig(preempt_signals=bad)
    assert exit_code(TERM) == 143 and exit_code(USR1) == 138


def test_a_signal_stops_a_repeat_is_the_same_stop_and_a_later_one_leaves() -> None:
    stop = Preemption((TERM, USR1), grace=25.0)
    assert stop.deadline() is None
    assert stop.note(USR1, 100.0) == "stop" and stop.received == USR1 and stop.deadline() == 125.0
    assert stop.note(TERM, 100.0 + DUPLICATE_S / 2) == "duplicate"  # Slurm's copy and the launcher's
    assert stop.note(TERM, 100.0 + DUPLICATE_S) == "leave"


def test_every_rank_agrees_on_the_first_signal_any_rank_heard() -> None:
    ranks = [Preemption((TERM, USR1)) for _ in range(3)]
    ranks[2].note(USR1, 0.0)
    ranks[1].note(TERM, 0.0)
    summed = [sum(v) for v in zip(*(r.votes() for r in ranks))]  # what the step's sum_values returns
    assert summed == [1.0, 1.0]
    assert [r.agree(summed) for r in ranks] == [TERM, TERM, TERM]  # the order given, not who heard it first
    quiet = Preemption((TERM, USR1))
    assert quiet.votes() == [0.0, 0.0] and quiet.agree([0.0, 0.0]) is None


def record(step: int) -> StepRecord:
    return StepRecord(step, 1.0, 0.1, 40.0, 0, 0, None)


def run_with_stop_after(steps: int, stop_at: int, monkeypatch, checkpoint_every: int = 0):
    """run_steps over a fake step whose sum agrees on SIGTERM in step ``stop_at`` (0-based)."""
    job = SimpleNamespace(layout=SimpleNamespace(rank=0), preemption=Preemption((TERM, USR1)))

    def step(job, step, trace):
        if step == stop_at:
            job.preemption.agree([1.0, 0.0])
        return record(step)

    monkeypatch.setattr(loop, "train_step", step)
    logged, saved = [], []
    hooks = LoopHooks(after_step=lambda records, must: logged.append((len(records), must)),
                      checkpoint=lambda done, preempted=None: saved.append((done, preempted)),
                      checkpoint_every=checkpoint_every)
    return job, hooks, logged, saved


def test_the_loop_checkpoints_the_agreed_step_marked_and_stops(monkeypatch) -> None:
    job, hooks, logged, saved = run_with_stop_after(10, 3, monkeypatch, checkpoint_every=4)
    with pytest.raises(Preempted) as stopped:
        loop.run_steps(job, 10, hooks=hooks)
    assert (stopped.value.signum, stopped.value.step, stopped.value.checkpointed) == (TERM, 4, True)
    assert saved == [(4, "SIGTERM")]  # the step's checkpoint once, marked, in place of the regular one due
    assert logged[-1] == (4, True)  # every step of it on disk before the checkpoint


def test_a_stop_voted_in_the_last_step_ends_the_run_as_usual(monkeypatch) -> None:
    job, hooks, logged, saved = run_with_stop_after(5, 4, monkeypatch)
    assert len(loop.run_steps(job, 5, hooks=hooks)) == 5 and saved == []


# -- which checkpoint a restarted worker group resumes -----------------------------------------------------
IDENTITY = {"model": "tiny-unet", "seed": 0}


def fake_step(root: Path, step: int, identity: dict, preempted: str | None = None, manifest: bool = True) -> None:
    where = root / f"step-{step}"
    where.mkdir(parents=True)
    data = f"step {step}".encode()
    (where / "rank-0.pt").write_bytes(data)
    info = {"pulse_checkpoint": 1, "step": step, "identity": identity, "plan": {}, "seed": 0,
            "files": [{"name": "rank-0.pt", "rank": 0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                       "layers": []}], **({"preempted": preempted} if preempted else {})}
    if manifest:
        (where / "manifest.json").write_text(json.dumps(info))


PLAN = SimpleNamespace(pp=2, dp=1, placement=SimpleNamespace(kind="v"), global_batch=8)


def test_a_restart_resumes_this_runs_newest_complete_checkpoint_by_itself(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    fake_step(root, 2, IDENTITY)
    fake_step(root, 4, IDENTITY, preempted="SIGTERM")
    fake_step(root, 6, {**IDENTITY, "seed": 1})  # another run's, newer
    fake_step(root, 8, IDENTITY, manifest=False)  # interrupted
    config = RunConfig(steps=10, out_dir=str(tmp_path))
    found, line = checkpoints.find_resume(config, tmp_path, PLAN, IDENTITY, lead=True, restart=1)
    assert found.step == 4
    assert "written when SIGTERM stopped the run" in line and "restart 1: resumed by itself" in line
    assert "step-6: another run's" in line and "step-8: no manifest" in line
    assert checkpoints.find_resume(config, tmp_path, PLAN, IDENTITY, lead=True) == (None, "")  # no restart, no --resume


def test_a_restart_before_any_checkpoint_of_this_run_starts_as_the_first_start_did(tmp_path: Path) -> None:
    fake_step(tmp_path / "checkpoints", 6, {**IDENTITY, "seed": 1})
    config = RunConfig(steps=10, out_dir=str(tmp_path))
    found, line = checkpoints.find_resume(config, tmp_path, PLAN, IDENTITY, lead=True, restart=2)
    assert found is None and "restart 2: no checkpoint of this run yet; starting from step 0" in line
    saved = tmp_path / "saved"
    fake_step(saved, 3, {**IDENTITY, "seed": 1})
    config = RunConfig(steps=10, out_dir=str(tmp_path), resume=str(saved), resume_any=True)
    found, _ = checkpoints.find_resume(config, tmp_path, PLAN, IDENTITY, lead=True, restart=1)
    assert found.step == 3  # what --resume DIR --resume-any took at the first start


def test_a_manifest_records_the_signal_of_its_preemption() -> None:
    plan = SimpleNamespace(model="m", pp=2, dp=1, placement=SimpleNamespace(kind="v", folds=1), microbatch_size=2,
                           num_microbatches=4, global_batch=8)
    spec = SimpleNamespace(layers=[])
    assert checkpoints.manifest_info(plan, spec, 0, {}, IDENTITY, "SIGUSR1")["preempted"] == "SIGUSR1"
    assert "preempted" not in checkpoints.manifest_info(plan, spec, 0, {}, IDENTITY)


# -- the launchers ----------------------------------------------------------------------------------------
def test_the_torchrun_command_hands_the_agent_the_stop_signals_and_the_restarts(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pulse.cli.launchers import TorchrunLauncher, Where

    plan = SimpleNamespace(world_size=2)
    where = Where(max_restarts=3, preempt_signals="TERM,USR1", preempt_grace=25.0)
    command = TorchrunLauncher().command(plan, tmp_path / "plan.yaml", tmp_path / "run.yaml", where)
    split = command.index("--")
    assert command[split - 4:split] == ["--preempt-signals", "TERM,USR1", "--stop-timeout", "40"]
    assert command[command.index("--max-restarts") + 1] == "3" and command.index("--max-restarts") > split
    plain = TorchrunLauncher().command(plan, tmp_path / "plan.yaml", tmp_path / "run.yaml", Where())
    assert "--preempt-signals" not in plain and "--max-restarts" not in plain
    stopping = TorchrunLauncher().stopping(where, tmp_path / "run.yaml")
    assert stopping.preempt == (TERM, USR1) and stopping.wait_s() == 40.0 and stopping.workers == ()


def test_msrun_refuses_restarts_in_one_line() -> None:
    pytest.importorskip("mindspore")
    from pulse.cli.launchers import MsrunLauncher, Where

    with pytest.raises(PulseError, match="--max-restarts: msrun restarts no worker") as err:
        MsrunLauncher().check(RunConfig(), Where(max_restarts=1))
    assert "\n" not in str(err.value)
    workers = MsrunLauncher().stopping(Where(preempt_signals="TERM"), Path("RUN/run.yaml")).workers
    assert workers == ("-m pulse_mindspore.train", "--config RUN/run.yaml")


def test_the_agent_takes_one_stop_delivered_twice_as_one() -> None:
    pytest.importorskip("torch")
    from pulse_torch.launch import once_per_stop

    now, calls = [0.0], []
    handle = once_per_stop(lambda signum, frame: calls.append(signum), clock=lambda: now[0])
    handle(TERM, None)
    now[0] = DUPLICATE_S / 2
    handle(TERM, None)  # Slurm's copy after pulse train's
    assert calls == [TERM]
    now[0] = DUPLICATE_S
    handle(TERM, None)  # a second stop: torchrun's handler raises again, the agent leaves
    assert calls == [TERM, TERM]


def test_a_stop_reaches_msruns_workers_by_their_command_line_and_pulse_waits_for_them(tmp_path: Path) -> None:
    """msrun passes no signal on: `pulse train` signals the processes running the entry with this run's
    --config itself (msrun's children or orphans), never msrun, whose command line ends with theirs, and
    waits until they are gone."""
    import subprocess
    import sys

    from pulse.cli.stop_signals import Stopping, processes_with

    (tmp_path / "entry.py").write_text("import time\ntime.sleep(600)\n")
    config = str(tmp_path / "run.yaml")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def start(*argv: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *argv], env=env, cwd=tmp_path)

    worker = start("-m", "entry", "--plan", "plan.yaml", "--config", config)
    launcher = start(str(tmp_path / "entry.py"), "--join", "True", "python", "-m", "entry", "--config", config)
    other = start("-m", "entry", "--config", config + ".other")  # another run's worker
    try:
        words = ("-m entry", f"--config {config}")
        assert processes_with(words) == [worker.pid]
        stopping = Stopping((TERM,), 25.0, workers=words)
        stopping.forward(launcher, TERM)
        stopping.wait_for_workers()
        assert worker.wait(timeout=60) == -TERM and launcher.poll() is None and other.poll() is None
    finally:
        for process in (worker, launcher, other):
            process.kill()
            process.wait()
