"""`pulse train` with real processes: where the job listens, and what a signal leaves behind.

::

    pulse train ─▶ python -m pulse_torch.launch (own process group; dies with pulse: PDEATHSIG)
                      └─ torchrun agent in that process: store on 127.0.0.1 only
                           ├─ rank 0 (dies with the agent: PDEATHSIG)
                           └─ rank 1

Each test starts a long run, waits until rank 0 has logged a step (log.json exists), and
reads the process tree and the kernel's socket table from /proc.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
PULSE = Path(sys.executable).parent / "pulse"
# the launcher a fresh child of `pulse train` (no PULSE_LAUNCH_WRAPPER: tests/warm_launch.py): these tests walk
# the process tree from pulse down to the ranks
ENV = {**{k: v for k, v in os.environ.items() if k != "PULSE_LAUNCH_WRAPPER"}, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    from pulse.cli.main import main

    out = tmp_path_factory.mktemp("plan")
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--schedule", "gpipe", "--plan-only",
                 "--out-dir", str(out)]) == 0
    return out / "plan.yaml"


def start(plan: Path, out: Path) -> subprocess.Popen:
    """A run long enough to be interrupted; returns once rank 0 has logged its first step."""
    process = subprocess.Popen([str(PULSE), "train", "--plan", str(plan), "--steps", "100000", "--out-dir", str(out)],
                               env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (out / "log.json").exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the run never logged a step"
        time.sleep(0.2)
    return process


def children() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            table.setdefault(ppid, []).append(int(entry.name))
    return table


def tree(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    table, out, todo = children(), {pid}, [pid]
    while todo:
        for child in table.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def launcher_of(pulse: int) -> int:
    """`pulse train`'s child running pulse_torch.launch (its ranks, forked from it, show its command line too)."""
    return next(p for p in children().get(pulse, []) if "pulse_torch.launch" in Path(f"/proc/{p}/cmdline").read_text())


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes hold, from /proc/net/tcp{,6}."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                out.append((decode(address), int(port, 16)))
    return out


def decode(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]  # /proc prints each 32-bit word in host order
    return ":".join(b"".join(words)[i:i + 2].hex() for i in range(0, 16, 2))


LOOPBACK = {"127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001"}


def test_store_and_ranks_listen_on_loopback_only_and_sigterm_stops_them(plan: Path, tmp_path: Path) -> None:
    process = start(plan, tmp_path / "run")
    pids = tree(process.pid)
    sockets = listening(pids)
    print(f"{len(pids)} processes; listening on {sockets}")
    launcher = launcher_of(process.pid)
    assert listening({launcher}), "the launcher holds the rendezvous store"
    assert sockets and all(address in LOOPBACK for address, _ in sockets), sockets
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    left = wait_gone(pids - {process.pid}, 10)
    print(f"SIGTERM: pulse exited {code} after {time.monotonic() - started:.1f} s")
    assert code == 128 + signal.SIGTERM and not left
    err = process.stderr.read()
    assert err.strip().splitlines()[-1].startswith("pulse train: stopped by SIGTERM") and "Traceback" not in err, err


def test_sigkill_to_pulse_takes_launcher_and_ranks_along(plan: Path, tmp_path: Path) -> None:
    process = start(plan, tmp_path / "run")
    pids = tree(process.pid)
    assert len(pids) >= 4  # pulse, launcher, two ranks
    process.kill()
    process.wait(timeout=10)
    left = wait_gone(pids - {process.pid}, 45)
    assert not left, f"still running after pulse was killed: {left}"


def test_sigkill_to_the_launcher_leaves_no_orphan_rank(plan: Path, tmp_path: Path) -> None:
    process = start(plan, tmp_path / "run")
    pids = tree(process.pid)
    launcher = launcher_of(process.pid)
    ranks = tree(launcher) - {launcher}
    assert len(ranks) == 2
    os.kill(launcher, signal.SIGKILL)
    left = wait_gone(ranks, 10)
    assert not left, f"orphaned ranks still running: {left}"
    assert process.wait(timeout=30) != 0


def test_sigint_is_forwarded(plan: Path, tmp_path: Path) -> None:
    process = start(plan, tmp_path / "run")
    pids = tree(process.pid)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 128 + signal.SIGINT
    assert not wait_gone(pids - {process.pid}, 10)
    err = process.stderr.read()
    assert "stopped by SIGINT" in err and "Traceback" not in err, err


def test_wrong_world_size_under_the_launcher_is_one_line_exit_2(plan: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pulse_torch.launch", "--", "--nproc-per-node", "3",
                           "-m", "pulse_torch.train", "--plan", str(plan), "--steps", "2", "--out-dir", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "pulse_torch.train: error: the plan needs pp x dp = 2 x 1 = 2 processes but 3 were started; launch with "
        "--nproc-per-node 2 (or re-plan for 3)"]


def test_master_addr_must_be_one_interface(capsys) -> None:
    from pulse.cli.main import main

    for bad in ("0.0.0.0", "::", "example.org"):
        assert main(["train", "--master-addr", bad, "--plan-only"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--master-addr" in err


def test_two_nodes_meet_at_the_named_address_and_port(plan: Path, tmp_path: Path) -> None:
    """Two `pulse train` processes as two nodes of one job: node 0's store on --master-addr:--master-port."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    nodes = [subprocess.Popen([str(PULSE), "train", "--plan", str(plan), "--steps", "3", "--nnodes", "2",
                               "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port,
                               "--out-dir", str(tmp_path / f"node{r}")], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert "done: loss" in outs[0][0]  # rank 0 lives on node 0
    steps = json.loads((tmp_path / "node0" / "log.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
