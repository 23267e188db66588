"""The MindSpore runtime alone across real processes on CPU: a dead peer, and ``pulse train`` on msrun.

A scheduler and two workers started by hand as msrun starts them (msrun
itself would SIGKILL the survivor within its 1 s poll) lose rank 1 at its
first send: rank 0 must report the dead peer by itself, naming the action and
the rank, long before its timeout, and exit with code 2. Then
``pulse train --backend mindspore --pp 2`` itself (one step, two microbatches
of one sample) must run on msrun workers here and log the pipeline bytes
``pulse.traffic`` predicts. The pipeline step across processes, checked for
both backends, is in ``tests/test_backend_processes.py``.

Measured here (2 shared CPU cores, MindSpore launching blocking): the
dead-peer job ~9 s, the ``pulse train`` run ~20 s. Skipped without
MindSpore, torch or msrun.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("torch")

from mindspore_worker_check import spec_of  # noqa: E402
from process_rigs import MODEL, MS_ENV, MS_TIMEOUT, MS_WORKER, MSRUN, free_port  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.traffic import transfers  # noqa: E402


def start_by_hand(out: Path, timeout: float) -> list[tuple[str, subprocess.Popen]]:
    """A scheduler and two workers with the environment msrun gives them (printed from a worker)."""
    base = {**MS_ENV, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(free_port()), "MS_WORKER_NUM": "2",
            "PULSE_GLOO_PORT": str(free_port())}
    roles = [("scheduler", {"MS_ROLE": "MS_SCHED"})] + [
        (f"rank {r}", {"MS_ROLE": "MS_WORKER", "RANK_ID": str(r), "MS_NODE_ID": str(r)}) for r in range(2)]
    cmd = [sys.executable, str(MS_WORKER), "--mode", "die", "--out", str(out), "--timeout", str(timeout)]
    return [(name, subprocess.Popen(cmd, env={**base, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)) for name, extra in roles]


def test_a_dead_peer_ends_the_survivor_quickly(tmp_path: Path) -> None:
    timeout = 30.0  # the survivor must notice through gloo, not by waiting this out
    procs = start_by_hand(tmp_path, timeout)
    lines: list[tuple[float, str, str]] = []
    for name, p in procs:
        threading.Thread(target=lambda n=name, q=p: lines.extend((time.time(), n, x.rstrip()) for x in q.stdout),
                         daemon=True).start()
    start, ended = time.time(), {}
    try:
        while time.time() - start < 150 and not {"rank 0", "rank 1"} <= ended.keys():
            ended.update({n: (p.returncode, time.time()) for n, p in procs if p.poll() is not None and n not in ended})
            time.sleep(0.1)
    finally:
        for _, p in procs:  # the scheduler waits for the dead node's heartbeat; msrun would kill it
            if p.poll() is None:
                os.killpg(p.pid, 9)
    shown = "\n".join(x for _, _, x in lines if "INFO" not in x and "WARN" not in x)[-3000:]
    died = [float(m.group(1)) for _, n, x in lines if n == "rank 1"
            and (m := re.search(r"pulse fault injection: rank 1 exits hard .*t=([\d.]+)", x))]
    said = [(float(m.group(2)), m.group(1)) for _, n, x in lines if n == "rank 0"
            and (m := re.search(r"^worker_check: rank 0: error: (.*) \(t=([\d.]+)\)$", x))]
    assert len(died) == 1 and len(said) == 1, shown
    noticed, error = said[0][0] - died[0], said[0][1]
    # it notices while receiving from rank 1 or while sending to it, whichever it was doing
    assert re.search(r"action #\d+ \S+ of schedule 'greedy_v_1f1b'", error) and \
        re.search(r"(from|to) rank 1\b", error), error
    assert "timed out" not in error, error  # noticed through gloo (the peer's sockets closed), not --timeout
    code, exited = ended["rank 0"]
    assert code == 2, (code, exited - died[0])
    assert ended["rank 1"][0] == 1
    print(f"\nrank 0 reported {noticed:.3f} s after rank 1 died and exited {exited - died[0]:.1f} s after; "
          f"{error[:160]}")


def test_pulse_train_runs_a_pp2_plan_on_msrun_workers(tmp_path: Path) -> None:
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--backend", "mindspore", "--model", MODEL, "--pp", "2",
           "--steps", "1", "--num-microbatches", "2", "--microbatch-size", "1", "--timeout", "120",
           "--out-dir", str(tmp_path), "--trace", str(tmp_path / "trace.json")]
    done = subprocess.run(cmd, env=MS_ENV, capture_output=True, text=True, timeout=MS_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan, _ = load_plan(tmp_path / "plan.yaml", None)
    # the measured twin of `pulse simulate --trace`: every rank's actions of the step, as scheduled
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in range(2):
        traced = [e["name"] for e in sorted((e for e in events if e.get("ph") == "X" and e["pid"] == rank
                                             and e["cat"] in ("F", "B", "W")), key=lambda e: e["ts"])]
        scheduled = [f"{a.chunk}{a.kind}{a.microbatch}" for a in plan.schedule.actions[rank]
                     if a.kind in ("F", "B", "W")]
        assert scheduled and traced == scheduled
    assert not list(tmp_path.glob("trace.json.rank-*"))  # the parts were merged away
    spec = spec_of(MODEL)  # MindSpore trains float32
    per_step = (sum(tr.total_bytes for tr in transfers(spec, plan.placement)) * 2 * plan.num_microbatches
                * plan.microbatch_size)
    log = json.loads((tmp_path / "log.json").read_text())
    assert [s["pipeline_bytes"] for s in log["steps"]] == [per_step]  # both directions, every rank
    assert log["run"]["pp"] == 2 and log["run"]["placement"] == plan.placement.kind
    assert all((tmp_path / f"weights_rank{r}.npz").exists() for r in range(2))
    assert "1/1" in done.stdout and "done: loss" in done.stdout
