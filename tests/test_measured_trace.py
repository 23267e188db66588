"""``pulse_torch.train --trace``: the measured twin of the simulated timeline, from real gloo processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse.cli.launchers import launcher_prefix  # noqa: E402
from pulse.cli.main import main  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_cluster, load_hardware  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.cli.common import load_model  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402


def test_trace_holds_every_action_of_every_rank_then_the_step_phases(tmp_path: Path) -> None:
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--dp", "1", "--steps", "2", "--plan-only",
                 "--out-dir", str(tmp_path)]) == 0
    trace = tmp_path / "trace.json"
    done = subprocess.run([*launcher_prefix(2), "-m", "pulse_torch.train",
                           "--plan", str(tmp_path / "plan.yaml"), "--steps", "2", "--out-dir", str(tmp_path),
                           "--trace", str(trace)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    plan, spec = load_plan(tmp_path / "plan.yaml", load_model)
    program = lower(plan.schedule, spec, plan.placement)
    for rank in range(2):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        actions = [e["name"] for e in mine if e["cat"] != "step"]
        # every action in list order, the bucket launches (AR) included; FREE is not drawn
        assert actions == [str(a) for a in program.actions[rank] if a.kind != "FREE"]
        assert sum(a.startswith(("0AR", "1AR", "2AR", "3AR")) for a in actions) == 2
        phases = [e["name"] for e in mine if e["cat"] == "step"]
        assert phases == ["data-parallel buckets", "wait sends", "gradient norm all-reduce", "clip", "optimizer",
                          "report all-reduce"]
        for a, b in zip(mine, mine[1:]):  # one thread: spans never overlap
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
        for a in mine:  # an action's processor time: at most its wall time (waits and preemption are not in it)
            if a["cat"] != "step":
                assert 0 <= a["args"]["cpu_ms"] <= a["dur"] / 1e3 + 0.05
    assert not list(tmp_path.glob("trace.json.rank-*")), "the per-rank parts are merged and removed"
    check_trace_beside_the_simulated_step(tmp_path, plan, spec, program)


def check_trace_beside_the_simulated_step(run: Path, plan, spec, program) -> None:
    """benchmarks/trace_vs_sim.py pairs every traced compute action with its simulated twin."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from trace_vs_sim import compare
    finally:
        sys.path.pop(0)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, plan.microbatch_size)
    report = compare(run, costs, load_cluster("v100-pcie-1x8"))
    compute = [(d, str(a)) for d, row in program.actions.items() for a in row if a.is_compute]
    assert sorted((r["device"], r["action"]) for r in report["rows"]) == sorted(compute)
    for device in range(plan.pp):
        mine = [r for r in report["rows"] if r["device"] == device]
        assert [r["measured_start_ms"] for r in mine] == sorted(r["measured_start_ms"] for r in mine)
        assert all(r["lag_ms"] == r["measured_start_ms"] - r["simulated_start_ms"] for r in mine)
    assert report["rows"][0]["measured_start_ms"] == 0.0 and report["simulated_makespan_ms"] > 0
