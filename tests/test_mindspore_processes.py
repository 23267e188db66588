"""The MindSpore runtime across real processes on CPU: mccl all-reduce, gloo send/recv (``pulse_mindspore.transport``).

One msrun launch of ``pulse_mindspore/worker_check.py`` with 2 workers runs
tiny-unet one step (float32, M = 2 microbatches of one sample) under the
pulse V placement (greedy_v_1f1b) and the sequential one (1f1b) on the same
processes. Per configuration the test checks every rank's gradients against
one process differentiating the whole model, its payload bytes per peer
against ``pulse.traffic`` and the simulator's link bytes exactly, and that
the V placement sent no skip tensor (the sequential one does: the check can
fail). A second job, a scheduler and two workers started by hand as msrun
starts them (msrun itself would SIGKILL the survivor within its 1 s poll),
loses rank 1 at its first send: rank 0 must report the dead peer by itself,
naming the action and the rank, long before its timeout, and exit with code 2.
Last, ``pulse train --backend mindspore --pp 2`` itself (one step, two
microbatches of one sample) must run on msrun workers here and log the
pipeline bytes ``pulse.traffic`` predicts.

Measured here (2 shared CPU cores, MindSpore launching blocking): ~50 s in all:
the worker_check launch ~19 s, the dead-peer job ~9 s, the ``pulse train``
run ~20 s. Skipped without
MindSpore, torch or msrun.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("torch")

import pulse_mindspore  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_cluster, load_hardware  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.runtime.message_order import CLASS_SPAN, sent_messages  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.sim.engine import simulate  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.traffic import transfers  # noqa: E402
from pulse_mindspore.comm import HEADER_BYTES  # noqa: E402
from pulse_mindspore.worker_check import plan_case, reference_gradients, spec_of  # noqa: E402

WORKER = Path(pulse_mindspore.__file__).resolve().parent / "worker_check.py"
MSRUN = Path(sys.executable).parent / "msrun"
MODEL, M, PP, TOL = "tiny-unet", 2, 2, 1e-4  # float32: skip and shared-input gradients summed in another order
CONFIGS = ["pulse:greedy_v_1f1b", "sequential:1f1b"]
LAUNCH_TIMEOUT = 300  # a hung job fails its test, not the suite
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_v": "3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One msrun job of 2 workers running every configuration."""
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    out = tmp_path_factory.mktemp("msrun_pp2")
    env = {**ENV, "PULSE_GLOO_PORT": str(free_port()),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [str(MSRUN), "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(free_port()),
           "--log_dir", str(out / "logs"), "--join", "True", "python", str(WORKER), "--out", str(out),
           "--microbatches", str(M), "--timeout", "120", *[a for c in CONFIGS for a in ("--config", c)]]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"msrun did not finish in {LAUNCH_TIMEOUT} s: {' '.join(cmd)}")
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("worker_*.log")))
    assert done.returncode == 0, logs
    return out


def expected_bytes(spec: ModelSpec, config: str) -> dict[int, dict[int, int]]:
    """Payload bytes rank -> peer: each Transfer per sample, activations one way and gradients back;
    the simulator's per-link bytes for the same plan must say the same."""
    placement, schedule = plan_case(spec, *config.split(":"), M)
    per_link: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):
        per_link[(tr.src_device, tr.dst_device)] += tr.total_bytes * M
        per_link[(tr.dst_device, tr.src_device)] += tr.total_bytes * M
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    simulated = simulate(spec, placement, schedule, costs, load_cluster("v100-pcie-1x8")).link_bytes
    assert {k: v for k, v in simulated.items() if v} == dict(per_link)
    out: dict[int, dict[int, int]] = defaultdict(dict)
    for (src, dst), nbytes in per_link.items():
        out[src][dst] = nbytes
    return dict(out)


@lru_cache(maxsize=None)
def reference() -> tuple[dict[str, np.ndarray], float]:
    """The whole model in this process (~25 s of PyNative here): the same for every configuration."""
    return reference_gradients(spec_of(MODEL), M)


@pytest.mark.parametrize("config", CONFIGS)
def test_msrun_step_matches_reference_and_traffic(launch: Path, config: str) -> None:
    folder = launch / config.replace(":", "-")
    records = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(PP)}
    spec = spec_of(MODEL)
    ref, ref_loss = reference()
    grads: dict[str, np.ndarray] = {}
    for r in range(PP):
        with np.load(folder / f"rank{r}.npz") as z:
            grads.update({k: z[k] for k in z.files})
    assert grads.keys() == ref.keys()
    scale = max(float(np.abs(g).max()) for g in ref.values())
    err = max(float(np.abs(grads[k] - g).max()) / max(float(np.abs(g).max()), 1e-6 * scale) for k, g in ref.items())
    assert err < TOL, f"{config}: gradients differ by {err:.2e} (relative)"
    losses = [rec["loss"] for rec in records.values() if rec["loss"] is not None]
    assert losses == [pytest.approx(ref_loss, rel=1e-6)]  # one rank holds the last chunk
    want = expected_bytes(spec, config)
    placement, program = plan_case(spec, *config.split(":"), M)
    sends = {d: sum(a.kind in ("SF", "SB") for a in program.actions[d]) for d in range(PP)}
    for rank, rec in records.items():
        assert rec["carrier"] == "gloo"
        assert {int(p): n for p, n in rec["bytes_sent"].items()} == want[rank], f"rank {rank}: bytes per peer"
        # the plan's message order given: a header for each tensor class's first message only
        classes = {(m.dst_device, key % CLASS_SPAN) for m in sent_messages(Wiring(spec, placement), program, rank)
                   for key in (t.as_int() for t in m.tags)}
        assert sum(rec["header_bytes"].values()) == len(classes) * HEADER_BYTES
        assert sum(m[2] for m in rec["messages"]) == sum(want[rank].values())
        assert len(rec["messages"]) >= sends[rank] and rec["early_left"] == 0
    skip_keys = {e.key for e in spec.skips}
    names = {m[1] for rec in records.values() for m in rec["messages"]}
    if config.startswith("pulse"):
        assert names and not names & skip_keys, f"skip tensors crossed devices: {names & skip_keys}"
    else:  # the sequential baseline relays skips: the log does see them
        assert names & skip_keys


def start_by_hand(out: Path, timeout: float) -> list[tuple[str, subprocess.Popen]]:
    """A scheduler and two workers with the environment msrun gives them (printed from a worker)."""
    base = {**ENV, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(free_port()), "MS_WORKER_NUM": "2",
            "PULSE_GLOO_PORT": str(free_port())}
    roles = [("scheduler", {"MS_ROLE": "MS_SCHED"})] + [
        (f"rank {r}", {"MS_ROLE": "MS_WORKER", "RANK_ID": str(r), "MS_NODE_ID": str(r)}) for r in range(2)]
    cmd = [sys.executable, str(WORKER), "--mode", "die", "--out", str(out), "--timeout", str(timeout)]
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
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
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
