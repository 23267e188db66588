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
        "--microbatches", "2", "--steps", "2", "--pairs", "1", "--repeats", "1", "--warmup", "0",
        "--device-timings", "synchronize"]


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
    assert {"profiles", "memory", "overhead", "time", "wall_seconds", "parameters", "precision",
            "torch"} <= data.keys()
    (profile,) = data["profiles"]
    assert profile["device_timing"] == "synchronize" and profile["optimizer_ms"] > 0
    assert profile["source"].startswith("measured:torch-cpu") and profile["layers"] > 10
    assert profile["forward_ms"] > 0 and profile["backward_ms"] > 0 and finite(profile["wall_seconds"])
    assert set(profile["one_chunk_ms"]) == {"F", "B", "Bi", "W", "O"}  # (c)'s one chunk timed whole
    assert all(t > 0 for t in profile["one_chunk_ms"].values())
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
    time = data["time"]
    assert time["measured_step_ms"] == overhead["pulse_step_ms"] and time["target_pct"] == 15.0
    (row,) = time["by_device_timing"].values()
    assert row["predicted_step_ms"] > 0 and row["miss_pct"] == pytest.approx(
        (row["predicted_step_ms"] / time["measured_step_ms"] - 1) * 100)
    assert row["from_layers_step_ms"] > 0 and row["from_layers_step_ms"] != row["predicted_step_ms"]


def test_the_predicted_step_is_the_one_chunk_plans_actions_then_its_optimizer(monkeypatch) -> None:
    """Doubling every layer's forward and backward adds M x their sums to the predicted step, and
    nothing else changes it: the step is priced from the cost table as (c)'s plan runs."""
    from dataclasses import replace

    from pulse.costs import CostTable
    from pulse.zoo.loading import load_model

    spec_ = importlib.util.spec_from_file_location("gpu_check_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, spec_.name, module)
    spec_.loader.exec_module(module)
    spec = load_model("tiny-unet", {})
    n = spec.num_layers
    costs = CostTable(spec.name, 1, tuple(l.name for l in spec.layers), tuple([1e-3] * n), tuple([2e-3] * n),
                      tuple([0] * n), "test", optimizer=tuple([1e-4] * n))
    doubled = replace(costs, fwd=tuple(2 * f for f in costs.fwd), bwd=tuple(2 * b for b in costs.bwd))
    one, two = module.predicted_step(spec, costs, 4), module.predicted_step(spec, doubled, 4)
    assert two - one == pytest.approx(4 * (sum(costs.fwd) + sum(costs.bwd)), rel=1e-6)
    assert one >= 4 * (sum(costs.fwd) + sum(costs.bwd)) + sum(costs.optimizer) * 0.999


def step_parts(monkeypatch):
    spec_ = importlib.util.spec_from_file_location("step_parts_bench", SCRIPT.parent / "step_parts.py")
    module = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, spec_.name, module)
    spec_.loader.exec_module(module)
    return module


def test_the_step_parts_benchmark_runs_on_a_cpu(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/step_parts.py's logic (the GPU run: RESULTS.md): both plans' steps and actions, the
    optimizer's pieces over every gradient of the model."""
    module = step_parts(monkeypatch)
    torch.set_num_threads(1)
    out = tmp_path / "parts.json"
    assert module.main(["--model", "tiny-unet", "--device", "cpu", "--precision", "fp32", "--microbatch-size", "1",
                        "--microbatches", "2", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["clock"] == "host"
    for plan in ("one_chunk", "fit_chunks", "per_layer"):
        row = data[plan]
        assert row["step_ms"] > 0 and row["step_without_optimizer_ms"] > 0
        assert row["actions_ms"]["F"] > 0 and row["actions_ms"]["B"] > 0
    from pulse.profiling.layers import fit_cuts

    layers = data["per_layer"]["chunks"]
    assert layers > 10 and data["fit_chunks"]["chunks"] == len(fit_cuts(layers)) - 1 < layers
    assert "synchronize" not in data  # a CPU's calls return when done: one timing
    assert all(data[plan]["host_syncs"] == {} for plan in ("one_chunk", "fit_chunks", "per_layer"))  # no CUDA
    parts = data["one_chunk"]["optimizer_parts_ms"]
    config = {k: v for k, v in module.gpu_check.TINY.items() if not k.startswith("_")}
    from diffusers import UNet2DConditionModel
    assert parts["tensors"] == len([p for p in UNet2DConditionModel(**config).parameters() if p.requires_grad])
    assert all(parts[k] > 0 for k in ("grad_square_sum", "foreach_norm", "optimizer_step"))


def test_host_syncs_counts_each_synchronizing_call_by_the_repositorys_line_under_it(monkeypatch) -> None:
    """The sync report's bookkeeping, with torch's sync debug mode stood in for: the mode is set to
    warn for the step alone and set back even when the step fails, only torch's synchronizing warnings
    count, each by the innermost line of this repository's code under it."""
    import warnings

    module = step_parts(monkeypatch)
    modes = []

    said = "called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)"

    def copy_to_device() -> None:  # torch's C++ warning stands in, raised under our frame
        warnings.warn(said)

    def read_loss() -> None:
        warnings.warn(said)

    def step() -> None:
        for _ in range(3):
            copy_to_device()
        warnings.warn("some other warning")
        read_loss()

    report = module.host_syncs(step, torch.device("cuda"), set_mode=modes.append)
    assert modes == ["warn", "default"]
    assert report["syncs"] == 4
    sites = report["sites"]
    assert list(sites.values()) == [3, 1] and all(k.startswith("tests/test_gpu_check.py:") for k in sites)
    assert ["(copy_to_device)" in k for k in sites] == [True, False] and "(read_loss)" in list(sites)[1]

    def failing() -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        module.host_syncs(failing, torch.device("cuda"), set_mode=modes.append)
    assert modes[-2:] == ["warn", "default"]
    assert module.host_syncs(step, torch.device("cpu"), set_mode=modes.append) == {} and len(modes) == 4
