"""A MindSpore worker that crashes in its teardown after the run was complete is no failed run.

MindSpore sometimes crashes (signal 11) in the garbage collection of a finishing worker, after every
output was written (twice in this suite; upstream: mindspore-ai/hyper-parallel#510). msrun reports the
first worker to fail and SIGKILLs the others unreported, so `pulse train` counts the crash as no
failure only where every worker of the node wrote its finished mark (``pulse.launch_env``), which a
worker writes after its outputs (tests/test_mindspore_msrun.py checks a real run leaves them).
"""
from __future__ import annotations

from pathlib import Path

from pulse.cli.msrun_launch import MsrunOutput
from pulse.launch_env import finished_mark, finished_marks


def msrun_failure(output: MsrunOutput, log_dir: Path, pid: int, code: int) -> None:
    """msrun's stderr when worker ``pid`` exits with ``code`` (MindSpore 2.10's wording)."""
    for line in (f"[ERROR] ME(1:2,python):2026-11-29 [_api.py:365] Worker process {pid} exit with exception. "
                 f"Error code: {code}.\n",
                 "Traceback (most recent call last):\n", '  File "msrun", line 8, in <module>\n',
                 "RuntimeError: Distributed job exited with exception. Please check logs in directory: "
                 f"{log_dir}.\n"):
        output.feed(line)
    output.flush()


def workers(log_dir: Path, *pids: int, marked: tuple[int, ...]) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank, _ in enumerate(pids):
        (log_dir / f"worker_{rank}.log").write_text("...\n")
    for pid in marked:
        finished_mark(log_dir, pid).touch()


def test_a_crash_after_every_worker_finished_is_a_note_and_exit_0(tmp_path: Path) -> None:
    workers(tmp_path, 101, 102, marked=(101, 102))
    output = MsrunOutput()
    msrun_failure(output, tmp_path, 101, -11)
    assert output.exit_code(1) == 0
    assert output.failed() == {}
    assert output.notes() == ["pulse train: note: worker pid 101 died of signal 11 after the run was complete (its "
                              "work and every output written): a crash in MindSpore's teardown, not in the run\n"]
    assert output.notes("pulse profile")[0].startswith("pulse profile: note: worker pid 101 died of signal 11")


def test_a_worker_killed_before_its_mark_keeps_the_failure(tmp_path: Path) -> None:
    """Worker 102 was still working when msrun SIGKILLed it (unreported): the run is not complete."""
    workers(tmp_path, 101, 102, marked=(101,))
    output = MsrunOutput()
    msrun_failure(output, tmp_path, 101, -11)
    assert output.exit_code(1) == 1
    assert output.failed() == {101: -11} and output.notes() == []
    assert output.failure_note() == f"worker pid 101: signal 11; worker logs in {tmp_path}"


def test_a_crash_before_the_crashed_workers_own_mark_keeps_the_failure(tmp_path: Path) -> None:
    workers(tmp_path, 101, 102, marked=(102, 103))  # 103: not this node's crashed worker
    output = MsrunOutput()
    msrun_failure(output, tmp_path, 101, -11)
    assert output.exit_code(1) == 1 and output.failed() == {101: -11}


def test_an_exit_code_is_a_failure_even_after_the_marks(tmp_path: Path) -> None:
    """A worker that returned non-zero said something went wrong: only a signal after the mark is forgiven."""
    workers(tmp_path, 101, 102, marked=(101, 102))
    output = MsrunOutput()
    msrun_failure(output, tmp_path, 101, 1)
    assert output.exit_code(1) == 1 and output.failed() == {101: 1} and output.notes() == []


def test_marks_are_read_by_pid_and_other_files_ignored(tmp_path: Path) -> None:
    finished_mark(tmp_path, 7).touch()
    (tmp_path / "finished-notapid").touch()
    (tmp_path / "worker_0.log").touch()
    assert finished_marks(tmp_path) == {7: tmp_path / "finished-7"}
