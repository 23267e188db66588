"""How rank 0 keeps log.json: every step's row appended in place, the whole file (its summary) rewritten
after the first step, then at most every interval, and whenever the loop says the records must reach
disk (a checkpoint's step, the last step, a failure)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pulse.train import loop
from pulse.train.loop import LoopHooks, NonFiniteLoss
from pulse.train.run_outputs import StepLog
from pulse.train.runlog import StepRecord

INFO = {"schedule": "1f1b", "global_batch": 4}


def record(step: int, loss: float = 1.0) -> StepRecord:
    return StepRecord(step, loss, 0.1, 40.0, 0, 0, None)


def logged(path: Path) -> list[int]:
    return [s["step"] for s in json.loads(path.read_text())["steps"]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def last_loss(path: Path) -> float:
    return json.loads(path.read_text())["summary"]["last_loss"]


def test_every_step_is_appended_and_the_summary_rewritten_once_per_interval_or_when_told(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "log.json"
    log = StepLog(path, INFO, every=10.0, clock=clock)
    records = [record(0, loss=1.0)]
    log(records)
    assert logged(path) == [0] and last_loss(path) == 1.0  # a watcher waiting for the file sees the run start
    inode = path.stat().st_ino
    for step in range(1, 5):
        clock.now += 2.0
        records.append(record(step, loss=1.0 - step / 10))
        log(records)
        assert logged(path) == list(range(step + 1))  # a kill now keeps every finished step
    assert path.stat().st_ino == inode and last_loss(path) == 1.0  # 8 s: appended in place, summary as it was
    clock.now += 2.0
    records.append(record(5, loss=0.5))
    log(records)
    assert logged(path) == [0, 1, 2, 3, 4, 5] and last_loss(path) < 1.0  # 10 s since the last rewrite
    records.append(record(6))
    log(records, True)  # a checkpoint's step: its resume reads this log
    assert logged(path) == list(range(7))


def test_a_log_replaced_behind_its_back_is_written_whole_again(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "log.json"
    log = StepLog(path, INFO, every=10.0, clock=clock)
    log([record(0)])
    path.write_text('{"steps": []}')  # not the file the log wrote: never appended to blindly
    log([record(0), record(1)])
    assert logged(path) == [0, 1]


def test_a_slow_rewrite_waits_a_hundred_times_its_own_duration(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "log.json"
    log = StepLog(path, INFO, every=1.0, clock=clock)
    log([record(0, loss=1.0)])
    log.written_at, log.write_seconds = 0.0, 0.5  # a history so long that rewriting it took 0.5 s
    clock.now = 49.0
    log([record(0, loss=1.0), record(1, loss=0.0)])
    assert logged(path) == [0, 1] and last_loss(path) == 1.0  # appended, not rewritten
    clock.now = 50.0
    log([record(0, loss=1.0), record(1, loss=0.0), record(2, loss=0.0)])
    assert logged(path) == [0, 1, 2] and last_loss(path) < 1.0


def test_a_failed_step_leaves_every_finished_step_in_the_log(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "log.json"
    log = StepLog(path, INFO, every=3600.0)
    losses = iter([1.0, 0.9, 0.8, float("nan")])
    monkeypatch.setattr(loop, "train_step", lambda job, step, trace: record(step, next(losses)))
    job = SimpleNamespace(layout=SimpleNamespace(rank=1), preemption=None)
    with pytest.raises(NonFiniteLoss):
        loop.run_steps(job, 10, hooks=LoopHooks(after_step=log))
    assert logged(path) == [0, 1, 2]


def test_the_last_step_and_checkpoint_steps_reach_the_log_before_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "log.json"
    log = StepLog(path, INFO, every=3600.0)
    monkeypatch.setattr(loop, "train_step", lambda job, step, trace: record(step))
    seen: dict[int, list[int]] = {}
    job = SimpleNamespace(layout=SimpleNamespace(rank=1), preemption=None)
    loop.run_steps(job, 5, hooks=LoopHooks(after_step=log, checkpoint=lambda done: seen.setdefault(done, logged(path)),
                                           checkpoint_every=2))
    assert seen == {2: [0, 1], 4: [0, 1, 2, 3]}
    assert logged(path) == [0, 1, 2, 3, 4]


def test_the_closing_lines_hold_the_measured_step_against_the_predicted_one() -> None:
    """Analytic costs are a datasheet's, not the host's: the line says how far off they were and how to
    measure the host; a measured table's prediction stands on its own; nothing predicted, nothing said."""
    from pulse.train.run_outputs import step_line

    summary = {"median_step_seconds": 0.7331}
    analytic = step_line(summary, {"step_seconds": 0.1793, "cost_source": "analytic:cpu-local"}, "runs/x/plan.yaml")
    assert analytic is not None and analytic.startswith(
        "step: 733.1 ms measured, 179.3 ms predicted (4.09x) from analytic:cpu-local costs; ")
    assert "`pulse profile --plan runs/x/plan.yaml`" in analytic and "--costs costs.yaml" in analytic
    measured = step_line(summary, {"step_seconds": 0.7, "cost_source": "measured:costs.yaml"})
    assert measured == "step: 733.1 ms measured, 700.0 ms predicted (1.05x) from measured:costs.yaml costs"
    assert step_line(summary, {}) is None and step_line(summary, {"step_seconds": None}) is None
