"""``--optimizer``: each optimizer's state as the memory model counts it against the library's own after a
step, exact resumes through a checkpoint, one optimizer per chunk against one over the model, and the
one-line refusals (another backend, Prodigy at pp > 1, a resume with another optimizer)."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pulse.backend_traits import load_traits  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.optimizers import (NAMES, OPTIMIZERS, check_backend, check_pipeline, shared_state_bytes,  # noqa: E402
                              state_bytes)
from pulse.partition import partition  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.sim.memory import run_memory  # noqa: E402
from pulse.train import checkpoints  # noqa: E402
from pulse.train.run_config import RunConfig, default_learning_rate  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402

from pipeline_helpers import TableComm  # noqa: E402

SPEC = get_spec("tiny-unet")
COSTS = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2)
LR = {"prodigy": 1.0}  # its authors' rate; the others a fine-tune's
STEPS = 4


def plan_for(kind: str, pp: int) -> Plan:
    placement = partition("sequential" if kind == "sequential" else "pulse", SPEC, COSTS, pp, folds=1)
    return Plan("tiny-unet", "cpu-local", pp, 1, 2, 4, "pulse", placement)


def ranks(plan: Plan, optimizer: str, seed: int = 0, one_backend: bool = False) -> list[checkpoint.Shard]:
    """Every rank's chunks of ``plan``, each rank with its own backend as on a real job (``one_backend``:
    one backend holding every chunk, as one device holding the whole pipeline)."""
    wiring = Wiring(SPEC, plan.placement)
    shared = TorchBackend(seed=seed, lr=LR.get(optimizer, 1e-3), optimizer=optimizer, weight_decay=1e-2)
    out = []
    for rank in range(plan.pp):
        backend = shared if one_backend else TorchBackend(seed=seed, lr=LR.get(optimizer, 1e-3), optimizer=optimizer,
                                                          weight_decay=1e-2)
        chunks = [backend.build_chunk(SPEC, wiring.ios[c]) for c in plan.placement.chunks_of(rank)]
        out.append(checkpoint.Shard(backend, chunks, rank, plan.pp, 0))
    return out


def step_all(shards: list[checkpoint.Shard], step: int) -> None:
    """One optimizer step on every rank with gradients seeded by (step, parameter name): the same gradient
    reaches a parameter under every placement, as a pipeline's equal single-device ones. A steady direction
    per parameter plus noise per step, as a loss descending: Prodigy's step size d then grows from d0."""
    for shard in shards:
        for chunk in shard.chunks:
            for name, p in shard.backend.parameters(chunk).items():
                steady = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                noise = torch.Generator().manual_seed(step * 100003 + zlib.crc32(name.encode()))
                p.grad = torch.randn(p.shape, generator=steady) + 0.3 * torch.randn(p.shape, generator=noise)
    for shard in shards:
        for chunk in shard.chunks:
            shard.backend.optimizer_step(chunk)


def weights(shards: list[checkpoint.Shard]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for s in shards for n, p in s.parameters().items()}


def save_all(root: Path, plan: Plan, shards: list[checkpoint.Shard], step: int, optimizer: str) -> None:
    comm = TableComm()
    info = checkpoints.manifest_info(plan, SPEC, 0, checkpoints.data_position(step, 8, 1024), optimizer=optimizer)
    for shard in sorted(shards, key=lambda s: -s.rank):  # rank 0 last: it writes the manifest
        checkpoint.save(root, step, shard, comm, info, checkpoints.layers_by_rank(plan, SPEC))


def pipeline_of(optimizer: str) -> Plan:
    """A pp 2 V for the element-wise optimizers; Prodigy trains at pp 1 (``check_pipeline``)."""
    return plan_for("v", 2) if OPTIMIZERS[optimizer].elementwise else plan_for("sequential", 1)


@pytest.mark.parametrize("optimizer", NAMES)
def test_state_bytes_equal_the_librarys_state_after_a_step(optimizer: str) -> None:
    """Every byte of ``optimizer.state`` (each storage once: bitsandbytes' quantization maps are shared)
    after one step of tiny-unet's real parameters (convolutions, linears, norms, zero-initialised ones)."""
    (shard,) = ranks(plan_for("sequential", 1), optimizer)
    params = [p for c in shard.chunks for p in c.parameters()]
    zeros = [not p.detach().any() for p in params]  # Prodigy keeps one number as p0 for these
    step_all([shard], 1)
    storages = {}
    for chunk in shard.chunks:
        for state in chunk.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    counted = sum(state_bytes(optimizer, p.shape, z) for p, z in zip(params, zeros)) + shared_state_bytes(optimizer)
    assert sum(storages.values()) == counted
    n = sum(p.numel() for p in params)
    print(f"{optimizer}: {counted / n:.3f} B/param on tiny-unet, the planner's {OPTIMIZERS[optimizer].bytes_per_param}")


def test_the_planners_figures_hold_on_the_sd2_unet() -> None:
    """The per-parameter figures the planner prices (it knows counts, not shapes) against the exact state of
    the SD v2 UNet's shapes (diffusers' model on the meta device): within 0.5%; element-wise ones exactly
    but for AdamW's 4-byte step per tensor."""
    pytest.importorskip("diffusers")
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    config = json.loads((Path(__file__).parents[1] / "benchmarks" / "sd2_unet_config.json").read_text())
    with init_empty_weights():
        shapes = [tuple(p.shape) for p in UNet2DConditionModel.from_config(config).parameters()]
    n = sum(torch.Size(s).numel() for s in shapes)
    for name, kind in OPTIMIZERS.items():
        exact = (sum(state_bytes(name, s) for s in shapes) + shared_state_bytes(name)) / n
        assert kind.bytes_per_param == pytest.approx(exact, rel=5e-3), name


@pytest.mark.parametrize("optimizer", NAMES)
def test_a_resumed_run_equals_the_uninterrupted_one(optimizer: str, tmp_path: Path) -> None:
    plan = pipeline_of(optimizer)
    straight = ranks(plan, optimizer)
    for step in range(1, STEPS + 1):
        step_all(straight, step)
    first = ranks(plan, optimizer)
    for step in range(1, STEPS // 2 + 1):
        step_all(first, step)
    save_all(tmp_path, plan, first, STEPS // 2, optimizer)
    found, _ = checkpoints.find_latest(tmp_path)
    resumed = ranks(plan, optimizer, seed=7)  # other initial weights: everything must come from the files
    for shard in resumed:
        checkpoint.load(found, shard)
    for step in range(STEPS // 2 + 1, STEPS + 1):
        step_all(resumed, step)
    want, got = weights(straight), weights(resumed)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want), optimizer
    assert not all(torch.equal(want[n], w) for n, w in weights(ranks(plan, optimizer)).items())  # it trained


@pytest.mark.parametrize("optimizer", NAMES)
def test_chunks_of_one_device_step_as_one_optimizer_over_the_model(optimizer: str) -> None:
    """Two chunks on one device (a pp 2 pipeline's layers, one backend) against the whole model as one chunk:
    equal weights after a few steps, Prodigy included (its chunks share one optimizer)."""
    whole, split = ranks(plan_for("sequential", 1), optimizer), ranks(plan_for("sequential", 2), optimizer,
                                                                       one_backend=True)
    for step in range(1, STEPS + 1):
        step_all(whole, step)
        step_all(split, step)
    want, got = weights(whole), weights(split)
    assert all(torch.equal(want[n], got[n]) for n in want), optimizer


def test_prodigy_per_stage_would_differ_from_one_over_the_model() -> None:
    """Why pp > 1 is refused: each stage's own Prodigy estimates its own step size."""
    whole, stages = ranks(plan_for("sequential", 1), "prodigy"), ranks(plan_for("sequential", 2), "prodigy")
    for step in range(1, STEPS + 1):
        step_all(whole, step)
        step_all(stages, step)
    want, got = weights(whole), weights(stages)
    assert not all(torch.equal(want[n], got[n]) for n in want)
    d_whole = whole[0].chunks[0].optimizer.param_groups[0]["d"]
    assert d_whole > 1e-6  # it left d0: the step size was estimated, from every parameter
    assert all(s.chunks[0].optimizer.param_groups[0]["d"] != d_whole for s in stages)
    with pytest.raises(PulseError, match="needs pp 1") as info:
        check_pipeline("prodigy", 2)
    assert "\n" not in str(info.value)
    check_pipeline("prodigy", 1)
    check_pipeline("lion", 4)


def test_resuming_with_another_optimizer_is_refused_in_one_line(tmp_path: Path) -> None:
    plan = plan_for("sequential", 1)
    shards = ranks(plan, "adamw")
    step_all(shards, 1)
    save_all(tmp_path, plan, shards, 1, "adamw")
    config = RunConfig(steps=4, resume=str(tmp_path), optimizer="lion")
    with pytest.raises(PulseError, match="holds --optimizer adamw's state") as info:
        checkpoints.find_resume(config, tmp_path, plan, {}, lead=False)
    assert "\n" not in str(info.value) and "--optimizer lion" in str(info.value)
    found, line = checkpoints.find_resume(config.replace(optimizer="adamw"), tmp_path, plan, {}, lead=False)
    assert found is not None and found.step == 1


def test_memory_model_prices_each_optimizers_state() -> None:
    """The predicted peak of one plan moves by the state bytes of the parameters on each device, no more."""
    from pulse.hardware import load_cluster
    from pulse.planner import PlanRequest, make_plan, predict

    cluster = load_cluster("cpu-local")
    adamw = load_traits("torch").memory()
    plan = make_plan(SPEC, COSTS, cluster, PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2,
                                                       schedule="greedy_v_1f1b", memory=adamw))
    on_device = [sum(SPEC.layers[i].params for ch in plan.placement.chunks if ch.device == d
                     for i in range(ch.start, ch.end)) for d in range(2)]
    base = predict(SPEC, COSTS, cluster, plan, memory=adamw)["peak_memory_bytes_per_device"]
    for name, kind in OPTIMIZERS.items():
        memory = load_traits("torch").memory(optimizer=name)
        assert memory == run_memory(optimizer=name) and memory.optimizer_bytes == kind.bytes_per_param
        peaks = predict(SPEC, COSTS, cluster, plan, memory=memory)["peak_memory_bytes_per_device"]
        for d in range(2):  # rounded per chunk: a byte each at most
            assert abs(peaks[d] - base[d] - on_device[d] * (kind.bytes_per_param - 8)) <= len(plan.placement.chunks)


def test_refusals_and_the_default_learning_rate() -> None:
    with pytest.raises(PulseError, match="not available with --backend mindspore") as info:
        check_backend("prodigy", "mindspore")
    assert "\n" not in str(info.value)
    check_backend("adamw", "mindspore")
    check_backend("adafactor", "mindspore")  # mindspore.nn.AdaFactor
    with pytest.raises(PulseError, match="not available with --backend mindspore"):
        load_traits("mindspore").memory(optimizer="lion")
    with pytest.raises(PulseError, match="'optimizer' must be one of"):
        RunConfig(optimizer="sgd")
    assert default_learning_rate(False, "prodigy")[0] == 1.0
    assert default_learning_rate(True, "adamw8bit") == default_learning_rate(True)


def test_pulse_train_records_the_optimizer_and_refuses_what_cannot_run(tmp_path: Path, capsys) -> None:
    from pulse.cli.main import main

    flags = ["train", "--model", "tiny-unet", "--schedule", "gpipe", "--plan-only", "--time-limit", "1"]
    assert main([*flags, "--pp", "1", "--optimizer", "prodigy", "--out-dir", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "learning rate 1 (--optimizer prodigy's own default" in out
    config = RunConfig.load(tmp_path / "p" / "run.yaml")
    assert (config.optimizer, config.lr) == ("prodigy", 1.0)
    assert main([*flags, "--pp", "2", "--optimizer", "prodigy", "--out-dir", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs pp 1" in err and len(err.splitlines()) == 1
    assert main([*flags, "--pp", "2", "--backend", "mindspore", "--optimizer", "lion",
                 "--out-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--optimizer lion is not available with --backend mindspore" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists() and not (tmp_path / "m").exists()  # refused before anything was written


def test_pulse_tune_prices_the_optimizer_it_is_given() -> None:
    """`pulse tune --optimizer NAME`: the request's memory model holds NAME's state, with a backend's accounting
    (fp32 weights, gradients) or the planners' mixed-precision one (fp32 master weights + state)."""
    import argparse

    from pulse.cli.tune_cmd import held_memory
    from pulse.sim.memory import MemoryModel

    def asked(**flags):
        return held_memory(argparse.Namespace(**{"backend": None, "ema": False, "precision": "fp16", **flags}))

    assert asked(optimizer="adamw") == {}  # the defaults: mixed-precision Adam, 2 + 2 + 12
    for name, kind in OPTIMIZERS.items():
        mixed = asked(optimizer=name)["memory"] if name != "adamw" else MemoryModel()
        assert mixed.optimizer_bytes == 4 + kind.bytes_per_param
        torch_run = asked(optimizer=name, backend="torch", precision="fp32")["memory"]
        assert torch_run.per_param == 4 + 4 + kind.bytes_per_param + 8  # + the dp > 1 bucket the tuner prices
    with pytest.raises(PulseError, match="not available with --backend mindspore"):
        asked(optimizer="adamw8bit", backend="mindspore")
