"""A rank the kernel killed for memory is named in `pulse train`'s closing line.

::

    OomKills.read() before and after the launch: the memory cgroups' oom_kill counters
        (v1: memory.oom_control under this process's cgroup, its whole subtree; v2: memory.events)
    a rank dead by SIGKILL while they rose: the closing line says out of memory, with the rank's
    last logged peak (log.json) beside its predicted one (plan.predicted)

The counters and the line are checked on fake cgroup trees; one real run puts rank 1 of a
tiny job in a child memory cgroup whose limit is below what the rank needs (skipped where
this machine has no writable v1 memory controller).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pulse.cli.launchers import LauncherOutput, closing_line
from pulse.cli.oom_note import RunMemory
from pulse.host_limits import memory_cgroups
from pulse.oom_kills import OomKills, oom_kill_count
from pulse.plan import load_plan

GiB = 2**30
PULSE = Path(sys.executable).parent / "pulse"


def v1_tree(tmp_path: Path, counts: dict[str, int]) -> tuple[Path, Path]:
    """A v1 memory hierarchy holding this process at /job, with a counter in each folder named."""
    proc = tmp_path / "cgroup"
    proc.write_text("9:pids:/\n4:memory:/job\n0::/\n")
    for folder, count in counts.items():
        where = tmp_path / "fs" / "memory" / folder
        where.mkdir(parents=True, exist_ok=True)
        (where / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")
    return proc, tmp_path / "fs"


def test_v1_counters_are_read_over_the_whole_subtree_and_only_there(tmp_path: Path) -> None:
    proc, root = v1_tree(tmp_path, {"job": 0, "job/rank-1": 0, "other": 5})
    before = OomKills.read(proc, root)
    assert set(before.counts) == {str(root / "memory/job"), str(root / "memory/job/rank-1")}  # not "other"
    v1_tree(tmp_path, {"job/rank-1": 1, "other": 9, "job/made-later": 1})  # v1 counts in the victim's own folder
    assert OomKills.read(proc, root).since(before) == 2
    assert OomKills.read(proc, root).since(OomKills.read(proc, root)) == 0


def test_v2_counters_are_read_from_memory_events(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    folder = tmp_path / "fs/user.slice/job"
    folder.mkdir(parents=True)
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    before = OomKills.read(proc, tmp_path / "fs")
    assert before.counts == {str(folder): 1}
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 3\n")  # v2 counts children here
    assert OomKills.read(proc, tmp_path / "fs").since(before) == 2


def test_missing_or_old_counters_say_nothing(tmp_path: Path) -> None:
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")  # a kernel before 4.13
    assert oom_kill_count(tmp_path, 1) is None and oom_kill_count(tmp_path / "gone", 2) is None
    assert OomKills.read(tmp_path / "no-proc", tmp_path).counts == {}
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/not/mounted/here\n")
    assert OomKills.read(proc, tmp_path).counts == {}


def test_the_closing_line_names_the_kill_and_both_peaks(tmp_path: Path) -> None:
    out = LauncherOutput()
    for line in ["python -m pulse_torch.train: rank 0: error: peer rank 1 closed its connection\n",
                 "python -m pulse_torch.launch: the job failed (rank 1: signal 9, rank 0: exit code 1)\n"]:
        shown = out.feed(line)
    assert shown == [] and out.failed() == {1: -9, 0: 1}  # the launcher's line is said again, with more
    (tmp_path / "log.json").write_text(json.dumps({"steps": [
        {"step": 0, "peak_memory_bytes": [GiB, 2 * GiB]}, {"step": 1, "peak_memory_bytes": [GiB, 3 * GiB]}]}))
    memory = RunMemory(tmp_path / "log.json", pp=2, dp=1,
                       predicted={"peak_memory_bytes_per_device": [GiB, int(2.5 * GiB)]})
    line = closing_line(out, 1, 1, memory)
    assert line == ("pulse train: the launch failed (rank 0: exit code 1, rank 1: signal 9); out of memory: the "
                    "kernel's out-of-memory killer ended rank 1 (1 kill in this job's memory cgroups); rank 1: last "
                    "recorded peak 3.00 GiB at step 1, predicted 2.50 GiB (pipeline device 1)")
    assert closing_line(out, 1, 0, memory) == "pulse train: the launch failed (rank 0: exit code 1, rank 1: signal 9)"
    assert closing_line(out, 1, 0, None, "pulse profile").startswith("pulse profile: the launch failed (rank 0")
    early = RunMemory(tmp_path / "none.json", 2, 2, {"peak_memory_bytes": 4 * GiB})  # no log, no per-device list
    assert early.describe(3) == "rank 3: no step recorded, predicted 4.00 GiB (pipeline device 1)"


# -- a real out-of-memory kill ----------------------------------------------------------------------
def writable_v1_cgroup() -> Path:
    """This process's v1 memory cgroup folder, if a child can be made there; else the test skips."""
    v1 = [c for c in memory_cgroups() if c.version == 1 and c.folder.is_dir()]
    if not v1:
        pytest.skip("no cgroup v1 memory controller here (v2 would need the memory controller delegated "
                    "to a child through cgroup.subtree_control)")
    if oom_kill_count(v1[0].folder, 1) is None:
        pytest.skip(f"{v1[0].folder}/memory.oom_control has no oom_kill counter (a kernel before 4.13)")
    if not os.access(v1[0].folder, os.W_OK):
        pytest.skip(f"{v1[0].folder} is not writable: no child memory cgroup can be made")
    return v1[0].folder


# Rank 1 joins the child cgroup at its interpreter's start, before it imports anything large.
JOIN_CGROUP = """import os
if os.environ.get("RANK") == "1" and os.environ.get("PULSE_TEST_CGROUP"):
    with open(os.path.join(os.environ["PULSE_TEST_CGROUP"], "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
"""


def test_a_rank_killed_for_memory_is_named_with_its_predicted_peak(tmp_path: Path) -> None:
    parent = writable_v1_cgroup()
    child = parent / f"pulse-oom-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "memory.limit_in_bytes").write_text(str(48 * 2**20))  # far below torch's import alone
    except OSError as exc:
        pytest.skip(f"cannot make a child memory cgroup under {parent}: {exc.strerror}")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(JOIN_CGROUP)
    # ranks of their own (not forked from the launcher: pulse_torch.forked_ranks), so that rank 1 runs the hook
    env = {**os.environ, "PYTHONPATH": str(hook), "PULSE_TEST_CGROUP": str(child), "OMP_NUM_THREADS": "1",
           "PULSE_FORK_RANKS": "0"}
    out = tmp_path / "run"
    try:
        done = subprocess.run([str(PULSE), "train", "--model", "tiny-unet", "--pp", "2", "--partitioner", "sequential",
                               "--schedule", "gpipe", "--steps", "2", "--out-dir", str(out)], env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        for _ in range(50):  # the killed rank's cgroup empties once the kernel has reaped it
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    assert done.returncode != 0, done.stdout[-2000:]
    closing = done.stderr.strip().splitlines()[-1]
    predicted = load_plan(out / "plan.yaml")[0].predicted["peak_memory_bytes_per_device"][1]
    assert closing.startswith("pulse train: the launch failed (rank 1: signal 9"), done.stderr[-3000:]
    assert "out of memory: the kernel's out-of-memory killer ended rank 1" in closing, closing
    assert f"predicted {predicted / GiB:.2f} GiB (pipeline device 1)" in closing, closing
    print(closing)
