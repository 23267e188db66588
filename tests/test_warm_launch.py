"""``PULSE_LAUNCH_WRAPPER``, and the suite's warm launcher behind it (``tests/warm_launch.py``): a launch
through it ends as the same launch in a fresh interpreter (output, exit code, death by signal), and
what only a fresh interpreter runs faithfully is left to one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import warm_launch
from pulse.cli.launchers import LAUNCH_WRAPPER, TorchrunLauncher, Where, launcher_prefix

pytest.importorskip("torch")
FAULTS = Path(__file__).resolve().parent / "fault_injection"
RANK = """\
import os, sys, time
if __name__ == "__main__":  # the launcher imports it before forking its ranks
    # one write of the whole line: print's text and newline are two writes when unbuffered, which interleave
    os.write(1, f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: launcher {os.getppid()}\\n".encode())
    if os.environ.get("HOLD"):
        time.sleep(60)
    # no rank ends before both have spoken: a rank ending 3 gets the other stopped by the launcher
    open(os.path.join(os.environ["MET"], os.environ["RANK"]), "w").close()
    while len(os.listdir(os.environ["MET"])) < 2:
        time.sleep(0.01)
    sys.exit(int(os.environ.get("CODE", "0")))
"""


def test_the_wrapper_goes_before_the_launcher(monkeypatch) -> None:
    monkeypatch.setenv(LAUNCH_WRAPPER, "numactl --interleave=all --")
    prefix = launcher_prefix(2)
    assert prefix[:4] == ["numactl", "--interleave=all", "--", sys.executable]
    assert prefix[4:6] == ["-m", "pulse_torch.launch"]
    plan, where = SimpleNamespace(world_size=2), Where(preempt_signals="TERM", preempt_grace=5.0)
    command = TorchrunLauncher().command(plan, Path("plan.yaml"), Path("run.yaml"), where)
    # the launcher's own flags before its "--", the wrapper's "--" left alone
    assert command[:6] == prefix[:6] and command[command.index("--stop-timeout") + 2] == "--"
    assert command.index("--preempt-signals") > command.index("pulse_torch.launch")
    monkeypatch.delenv(LAUNCH_WRAPPER)
    assert launcher_prefix(2)[:3] == [sys.executable, "-m", "pulse_torch.launch"]


def test_only_a_launch_a_fresh_interpreter_would_start_alike_is_served(monkeypatch) -> None:
    env = {warm_launch.SOCKET_VAR: "/nowhere.sock", warm_launch.PYTHON_VAR: sys.executable}
    launch = [sys.executable, "-m", "pulse_torch.launch", "--bind", "127.0.0.1"]
    assert warm_launch.warm_request(launch, env)["args"] == launch[3:]
    assert warm_launch.warm_request(launch, {**env, "PYTHONPATH": str(FAULTS)}) is None  # its sitecustomize
    assert warm_launch.warm_request([sys.executable, "-m", "pulse_torch.train"], env) is None
    assert warm_launch.warm_request(["/usr/bin/python3", *launch[1:]], env) is None
    assert warm_launch.warm_request(launch, {}) is None  # no server
    fixed = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "LD_PRELOAD": "libx.so"}
    taken_later = {"PYTHONPATH": "x", "PYTHONUNBUFFERED": "1", "LD_LIBRARY_PATH": "/opt", "HOME": "/"}
    assert warm_launch.start_up_env({**fixed, **taken_later}) == fixed


@pytest.fixture(scope="module")
def served():
    address = os.environ.get(warm_launch.SOCKET_VAR)
    if not address or not warm_launch.listening(address):
        pytest.skip("no warm launcher in this session")
    return {k: os.environ[k] for k in ("PULSE_LAUNCH_WRAPPER", warm_launch.SOCKET_VAR, warm_launch.PYTHON_VAR)}


def _launch(tmp_path: Path, warm: dict | None, **extra: str) -> subprocess.Popen:
    (tmp_path / "rank_says.py").write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("PULSE_LAUNCH_WRAPPER", warm_launch.SOCKET_VAR)}
    env.update(warm or {}, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path), **extra)
    prefix = launcher_prefix(2)
    launcher = prefix[prefix.index("pulse_torch.launch") - 2:]  # without the session's wrapper
    command = [*env.get("PULSE_LAUNCH_WRAPPER", "").split(), *launcher, "-m", "rank_says"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("code", [0, 3])
def test_a_warm_launch_ends_as_a_fresh_one(served, tmp_path: Path, code: int) -> None:
    ended = {}
    for name, warm in (("fresh", None), ("warm", served)):
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}-tmp").mkdir()
        proc = _launch(tmp_path, warm, CODE=str(code), MET=str(tmp_path / name), TMPDIR=str(tmp_path / f"{name}-tmp"))
        out, err = proc.communicate(timeout=120)
        # torchrun's log folder goes with the job (torch's own caches, torchinductor_<user>, may stay)
        assert [p.name for p in (tmp_path / f"{name}-tmp").glob("torchelastic_*")] == []
        launchers = {line.split("launcher ")[-1] for line in out.splitlines()}
        assert len(launchers) == 1, out + err
        # fresh: the launcher is the process started (python exec'd); warm: one forked from the server
        assert (launchers == {str(proc.pid)}) == (name == "fresh"), (name, launchers, proc.pid)
        ended[name] = (proc.returncode, sorted(line.split(": launcher")[0] for line in out.splitlines()),
                       "the job failed" in err)
    assert ended["warm"] == ended["fresh"]
    assert ended["warm"][0] == code and ended["warm"][1] == ["rank 0 of 2", "rank 1 of 2"]


def test_a_signal_reaches_the_warm_launcher_and_its_ranks(served, tmp_path: Path) -> None:
    (tmp_path / "met").mkdir()  # the ranks hold before the meeting; a folder of its own all the same
    proc = _launch(tmp_path, served, HOLD="1", MET=str(tmp_path / "met"))
    lines = []
    while len(lines) < 2:
        lines.append(proc.stdout.readline())
        assert lines[-1], proc.stderr.read()
    os.killpg(proc.pid, signal.SIGTERM)  # as pulse train stops its launcher (kill_group)
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()  # torchrun's agent: stopped by SIGTERM
    launcher = int(lines[0].split("launcher ")[1])
    with pytest.raises(ProcessLookupError):
        os.kill(launcher, 0)
