"""benchmarks/gpu_check.py's logic on a CPU with a tiny UNet: every part runs and its JSON holds the
figures a GPU run reports (the GPU run itself needs a GPU: see the README)."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
TINY = ["--model", "tiny-unet", "--device", "cpu", "--precision", "fp32", "--microbatch-size", "1",
        "--microbatches", "2", "--steps", "2", "--pairs", "1", "--repeats", "1", "--warmup", "0"]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_the_device_check_runs_on_a_cpu_and_writes_every_figure(tmp_path: Path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the profile's rank: one thread, as the test's own
    torch.set_num_threads(1)
    out = tmp_path / "gpu_check.json"
    assert module.main([*TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"].startswith("cpu") and data["device_type"] == "cpu" and data["model"] == "tiny-unet"
    assert {"profile", "memory", "overhead", "wall_seconds", "parameters", "precision", "torch"} <= data.keys()
    profile = data["profile"]
    assert profile["source"].startswith("measured:torch-cpu") and profile["layers"] > 10
    assert profile["forward_ms"] > 0 and profile["backward_ms"] > 0 and finite(profile["wall_seconds"])
    memory = data["memory"]
    assert memory["pp"] == 2 and memory["schedule"] == "greedy_v_1f1b" and len(memory["losses"]) == 2
    assert all(finite(x) and x > 0 for x in memory["losses"] + memory["step_seconds"])
    assert [d["device"] for d in memory["devices"]] == [0, 1]
    layers = sorted(tuple(c) for d in memory["devices"] for c in d["layers"])
    assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in zip(layers, layers[1:]))  # the chunks tile the model
    for d in memory["devices"]:
        assert isinstance(d["predicted_peak_bytes"], int) and d["predicted_peak_bytes"] > 0
        assert d["peak_bytes"] is None  # a CPU: no allocator counts it (the GPU run fills it in)
    assert memory["process_peak_bytes"] is None
    overhead = data["overhead"]
    assert overhead["pairs"] == 1 and overhead["target_pct"] == 5.0
    assert overhead["pulse_step_ms"] > 0 and overhead["plain_step_ms"] > 0 and finite(overhead["overhead_pct"])
