"""Files PULSE must not clobber, runs that cannot collide (issue 32, items 1, 2, 4, 7 and 8).

* outputs are regular files only: a FIFO, a character device or a symbolic link named as ``--out``
  stays what it was (exit 2, one line); a missing folder is not created; a full disk is one line
  and the previous file stays whole;
* one ``pulse train`` per run folder: a live holder (another process) is named, a dead one's lock
  does not block; links in the run folder (``checkpoints/``, ``loss.png``, ``log.json``) are refused,
  never written through;
* ``--checkpoints-total-limit`` deletes only this run's checkpoints, never through a link;
* a truncated run.yaml is refused; ``simulate`` of an absurd microbatch count is refused at once;
  log.json holds every finished step when its process is killed with SIGKILL.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pulse.atomic_io import write_atomic
from pulse.cli.main import main
from pulse.errors import PulseError
from pulse.train import checkpoints
from pulse.train.run_config import RunConfig
from pulse.train.runlog import StepRecord, write_loss_plot

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
PLAN = ["plan", "--model", "tiny-unet", "--pp", "2"]


def one_line(capfd) -> str:
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def char_device(path: Path) -> bool:
    """A real character device (1, 3: what /dev/null is), where this user may make one."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError):
        return False
    return True


# -- 1. only regular files ----------------------------------------------------------------------------
def test_a_fifo_named_as_out_stays_a_fifo(tmp_path: Path, capfd) -> None:
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    assert main([*PLAN, "--out", str(fifo)]) == 2
    assert "named pipe, not a regular file" in one_line(capfd)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]  # no temporary left either


def test_a_character_device_named_as_out_or_trace_stays_a_device(tmp_path: Path, capfd) -> None:
    node = tmp_path / "fakenull"
    if not char_device(node):
        pytest.skip("cannot make a device node here (needs root)")
    for flag in ("--out", "--trace"):
        command = [*PLAN, flag, str(node)] if flag == "--out" else \
            ["simulate", "--model", "tiny-unet", "--pp", "2", "--schedule", "1f1b", "--trace", str(node)]
        assert main(command) == 2
        assert "character device, not a regular file" in one_line(capfd)
        mode = os.lstat(node)
        assert stat.S_ISCHR(mode.st_mode) and os.major(mode.st_rdev) == 1 and os.minor(mode.st_rdev) == 3


def test_the_writer_itself_refuses_nodes_and_links(tmp_path: Path) -> None:
    """What the command line checks, the writer checks again (a path that changed since, an internal one)."""
    fifo, target, link = tmp_path / "fifo", tmp_path / "elsewhere.txt", tmp_path / "link.yaml"
    os.mkfifo(fifo)
    target.write_text("keep me")
    link.symlink_to(target)
    for path, kind in ((fifo, "named pipe"), (link, "symbolic link"), (tmp_path, "folder")):
        with pytest.raises(PulseError, match=kind):
            write_atomic(path, "x")
    assert target.read_text() == "keep me" and link.is_symlink() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_missing_folder_is_not_created(tmp_path: Path, capfd) -> None:
    out = tmp_path / "nonexistent" / "dir" / "p.yaml"
    assert main([*PLAN, "--out", str(out)]) == 2
    assert "create it first" in one_line(capfd)
    assert not (tmp_path / "nonexistent").exists()
    with pytest.raises(PulseError, match="no folder"):
        write_atomic(out, "x")
    assert not (tmp_path / "nonexistent").exists()


def test_a_symlinked_out_is_refused_and_its_target_untouched(tmp_path: Path, capfd) -> None:
    target, link = tmp_path / "precious.yaml", tmp_path / "plan.yaml"
    target.write_text("precious\n")
    link.symlink_to(target)
    assert main([*PLAN, "--out", str(link), "--png", str(tmp_path / "p.png")]) == 2
    assert "symbolic link" in one_line(capfd)
    assert target.read_text() == "precious\n" and link.is_symlink()


def test_a_full_disk_is_one_line_and_the_previous_file_stays(tmp_path: Path, capfd, monkeypatch) -> None:
    out = tmp_path / "plan.yaml"
    assert main([*PLAN, "--out", str(out)]) == 0
    before = out.read_bytes()
    capfd.readouterr()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert main([*PLAN, "--pp", "3", "--out", str(out)]) == 2
    line = one_line(capfd)
    assert f"{out}: cannot write (No space left on device)" in line and "unchanged" in line
    with pytest.raises(PulseError, match="No space left"):  # what a rank's checkpoint or log write raises:
        write_atomic(out, "x")                                # its entry says it in one line (exit 2)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


# -- 2. one run per folder ------------------------------------------------------------------------------
HOLD = """
import sys
from pathlib import Path
from pulse.train.run_folder import lock_run_folder
lock = lock_run_folder(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def train_plan_only(out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny-unet", "--pp", "2", "--schedule", "gpipe", "--plan-only",
            "--out-dir", str(out), *extra]


def test_a_second_train_on_a_folder_in_use_is_refused_and_touches_nothing(tmp_path: Path, capfd) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=ENV, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(train_plan_only(out, "--seed", "1")) == 2
        line = one_line(capfd)
        assert f"in use by another `pulse train` (pid {holder.pid})" in line and "one run per folder" in line
        assert sorted(p.name for p in out.iterdir()) == [".pulse-train.lock"]  # no plan.yaml, no run.yaml
    finally:
        holder.kill()  # SIGKILL: the kernel drops its lock; nothing stale is left to clean
        holder.wait()
    assert main(train_plan_only(out, "--seed", "1")) == 0
    assert RunConfig.load(out / "run.yaml").seed == 1
    assert main(train_plan_only(out, "--seed", "2")) == 0  # released when the first one returned


# -- 7. links in the run folder --------------------------------------------------------------------------
def test_a_symlinked_checkpoints_folder_is_refused_before_anything_runs(tmp_path: Path, capfd) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    assert main(train_plan_only(out)) == 2
    assert "checkpoints is a symbolic link" in one_line(capfd)
    assert list(elsewhere.iterdir()) == [] and not (out / "plan.yaml").exists()


def test_loss_png_and_log_json_links_are_not_written_through(tmp_path: Path) -> None:
    from pulse.train.runlog import write_log

    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    run = tmp_path / "run"
    run.mkdir()
    (run / "loss.png").symlink_to(outside)
    (run / "log.json").symlink_to(outside)
    records = [StepRecord(0, 1.0, 0.1, 10.0, 0, 0, None)]
    with pytest.raises(PulseError, match="symbolic link"):
        write_loss_plot(run / "loss.png", records, "t")
    with pytest.raises(PulseError, match="symbolic link"):
        write_log(run / "log.json", {"schedule": "1f1b", "global_batch": 2}, [{"step": 0, "loss": 1.0,
                  "seconds": 0.1, "pipeline_bytes": 0, "allreduce_bytes": 0}])
    assert outside.read_text() == "not yours"


# -- 4. pruning only this run's checkpoints ---------------------------------------------------------------
IDENT = {"model": "tiny-unet", "model_options": {}, "architecture": "abc", "seed": 0, "data": "synthetic"}


def fake_step(root: Path, step: int, identity: dict) -> Path:
    where = root / f"step-{step}"
    where.mkdir(parents=True)
    data = f"rank 0 at step {step}".encode()
    (where / "rank-0.pt").write_bytes(data)
    files = [{"name": "rank-0.pt", "rank": 0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "layers": []}]
    (where / "manifest.json").write_text(json.dumps({"step": step, "files": files, "identity": identity}))
    return where


def test_prune_deletes_only_this_runs_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (4, 6, 8):
        fake_step(root, step, IDENT)
    fake_step(root, 2, {**IDENT, "seed": 1})  # another run's, older: not this run's to delete
    mine = root / "step-1"  # a user's folder merely named step-<k>
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    removed = checkpoints.prune(root, keep=1, identity=IDENT)
    assert sorted(p.name for p in removed) == ["step-4", "step-6"]
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-8"]
    assert (mine / "notes.txt").read_text() == "mine"


def test_prune_never_deletes_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    for step in (2, 4):
        fake_step(outside, step, IDENT)
    root = tmp_path / "checkpoints"
    root.mkdir()
    fake_step(root, 6, IDENT)
    (root / "step-3").symlink_to(outside / "step-2")  # a step link leading out of the run
    assert checkpoints.prune(root, keep=1, identity=IDENT) == []
    assert (outside / "step-2" / "rank-0.pt").is_file() and (root / "step-3").is_symlink()
    linked = tmp_path / "linked"
    linked.symlink_to(outside)  # the checkpoints folder itself a link
    assert checkpoints.prune(linked, keep=1, identity=IDENT) == []
    assert sorted(p.name for p in outside.iterdir()) == ["step-2", "step-4"]


# -- 8. smaller ones ----------------------------------------------------------------------------------------
def test_a_truncated_run_yaml_is_refused_not_defaulted(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    RunConfig(steps=7, seed=3, lr=0.01).save(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]))  # cut mid-way, as a full disk or a bad copy leaves it
    with pytest.raises(PulseError, match="incomplete run configuration, missing") as info:
        RunConfig.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_simulate_refuses_a_count_beyond_what_it_can_simulate(capfd) -> None:
    assert main(["simulate", "--model", "tiny-unet", "--pp", "2", "--num-microbatches", "100000"]) == 2
    line = one_line(capfd)
    assert "chunk passes" in line and "give at most" in line
    assert capfd.readouterr().out == ""


def test_a_named_pipe_as_model_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "model.yaml"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *PLAN[:1], "--model", str(fifo), "--pp", "2"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "not a regular file" in done.stderr


KILLED = """
import os, signal, sys
from pathlib import Path
from pulse.train.run_outputs import StepLog
from pulse.train.runlog import StepRecord
log = StepLog(Path(sys.argv[1]), {"schedule": "1f1b", "global_batch": 2}, every=3600.0)
records = []
for step in range(7):
    records.append(StepRecord(step, 1.0 / (step + 1), 0.1, 20.0, 0, 0, None))
    log(records)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_log_json_holds_every_finished_step_after_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "log.json"
    done = subprocess.run([sys.executable, "-c", KILLED, str(path)], env=ENV, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    steps = json.loads(path.read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(7))
    assert steps[-1]["loss"] == 1.0 / 7


def test_a_full_disk_while_appending_a_step_keeps_the_log_whole(tmp_path: Path, monkeypatch) -> None:
    from pulse.train.run_outputs import StepLog

    path = tmp_path / "log.json"
    log = StepLog(path, {"schedule": "1f1b", "global_batch": 2}, every=3600.0)
    records = [StepRecord(0, 1.0, 0.1, 20.0, 0, 0, None)]
    log(records)
    before = path.read_bytes()
    real = os.pwrite
    calls = []

    def full_once(fd: int, data: bytes, at: int) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            real(fd, data[:5], at)  # part of it reached the disk, then the disk was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, at)

    monkeypatch.setattr(os, "pwrite", full_once)
    records.append(StepRecord(1, 0.5, 0.1, 20.0, 0, 0, None))
    with pytest.raises(PulseError, match="No space left on device"):
        log(records)
    assert path.read_bytes() == before and json.loads(before)["steps"][0]["step"] == 0
