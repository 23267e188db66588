"""LoRA (``--lora-rank``) as the planner and simulator price it, and what is refused before launch.

::

    pulse.zoo.lora.adapter_params(spec)  == what peft adds to each layer of the real tiny SD UNet
    make_plan(adapters=...)              optimizer state, gradients and all-reduce bytes: the adapters' only,
                                         the frozen base its weights only; far below a full fine-tune's
    pulse train --lora-rank --plan-only  prints and records them (a plan without LoRA: as before)
    --lora-rank on a Hunyuan-DiT pipeline, or with --backend mindspore: one line, exit 2, nothing launched
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pulse.cli.main import main
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.planner import PlanRequest, make_plan, memory_of
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel, model_static_bytes, static_bytes
from pulse.zoo.diffusers_config import spec_from_path
from pulse.zoo.lora import adapter_params, target_names

# every Linear and Conv2d kind of a UNet that the PULSE layers hold (conv_in and conv_out are leaf modules of
# their layers: peft would swap them outside the layer, which add_lora refuses)
WIDE = ("to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,conv2,conv_shortcut,"
        "time_emb_proj,conv,linear_1,linear_2")
DP = 2
GRAD_BYTES = 4  # the runtime all-reduces fp32 gradients (pulse.planner.predict)


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from pipeline_helpers import pipeline_fixture

    return pipeline_fixture(tmp_path_factory)


def peft_counts(pipeline: Path, rank: int, targets: str | None) -> tuple[int, ...]:
    """Adapter parameters per PULSE layer of the real UNet after peft's add_adapter."""
    from pulse_torch.diffusers_adapter import from_diffusers, load_model
    from pulse_torch.diffusers_adapter.lora import LoraSettings, add_lora

    adapter = from_diffusers(load_model(pipeline / "unet"))
    add_lora(adapter, LoraSettings.of(rank, targets=targets), 0)  # checks the spec's counts itself too
    assert sum(p.numel() for p in adapter.model.parameters() if p.requires_grad) > 0
    return tuple(sum(p.numel() for p in adapter.layers[l.name].parameters() if p.requires_grad)
                 for l in adapter.spec.layers)


@pytest.mark.parametrize("rank, targets", [(4, None), (2, WIDE)])
def test_the_spec_counts_the_adapters_peft_makes(pipeline: Path, rank: int, targets: str | None) -> None:
    spec = spec_from_path(pipeline / "unet")
    assert adapter_params(spec, rank, target_names(targets)) == peft_counts(pipeline, rank, targets)


def plan_of(pipeline: Path, adapters: tuple[int, ...] | None):
    spec = spec_from_path(pipeline / "unet").with_act_bytes(4)
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    request = PlanRequest(model=f"diffusers:{pipeline / 'unet'}", cluster="cpu-local", pp=2, dp=DP,
                          schedule="zero_bubble_v", adapters=adapters)
    plan = make_plan(spec, costs, cluster, request)
    sim = simulate(spec, plan.placement, plan.schedule, costs, cluster, memory=memory_of(plan.recompute, adapters))
    return spec, plan, sim


def test_a_lora_plan_prices_the_adapters_state_and_all_reduce(pipeline: Path) -> None:
    adapters = peft_counts(pipeline, 4, None)
    trained = sum(adapters)
    spec, lora, sim = plan_of(pipeline, adapters)
    _, full, full_sim = plan_of(pipeline, None)
    assert lora.placement == full.placement  # the same pipeline, priced for what trains
    m = MemoryModel()
    # a ring all-reduce puts 2 (D - 1) bucket sizes on the wire per pipeline position
    assert lora.predicted["allreduce_bytes_per_step"] == 2 * (DP - 1) * trained * GRAD_BYTES
    assert full.predicted["allreduce_bytes_per_step"] == 2 * (DP - 1) * spec.total_params * GRAD_BYTES
    assert lora.predicted["trainable_params"] == trained and "trainable_params" not in full.predicted
    # static bytes: the frozen base its weights only; the adapters weights, gradients and AdamW moments
    weights = static_bytes(spec, lora.placement, m.param_bytes)
    static = [b.static for b in sim.memory]
    on_device = [sum(sum(adapters[c.start:c.end]) for c in lora.placement.chunks if c.device == d) for d in range(2)]
    for d in range(2):
        assert static[d] == model_static_bytes(spec, lora.placement, memory_of((), adapters))[d]
        optimizer_and_grads = static[d] - weights[d] - on_device[d] * m.param_bytes
        assert optimizer_and_grads == on_device[d] * (m.grad_bytes + m.optimizer_bytes)
    full_state = sum(b.static for b in full_sim.memory) - sum(weights)
    assert sum(static) - sum(weights) < full_state / 20  # adapters: ~1.6% of this tiny UNet
    assert lora.predicted["peak_memory_bytes"] < full.predicted["peak_memory_bytes"]


def test_pulse_train_lora_plan_says_and_records_the_adapters(pipeline: Path, tmp_path: Path, capsys) -> None:
    flags = ["train", "--pipeline", str(pipeline), "--pp", "2", "--dp", "2", "--schedule", "zero_bubble_v",
             "--microbatch-size", "1", "--plan-only"]
    assert main([*flags, "--out-dir", str(tmp_path / "full")]) == 0
    assert main([*flags, "--out-dir", str(tmp_path / "lora"), "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    predicted = {k: yaml.safe_load((tmp_path / k / "plan.yaml").read_text())["predicted"] for k in ("full", "lora")}
    trained = predicted["lora"]["trainable_params"]
    assert trained == sum(peft_counts(pipeline, 4, None)) and "trainable_params" not in predicted["full"]
    assert predicted["lora"]["allreduce_bytes_per_step"] == 2 * trained * GRAD_BYTES
    assert f"LoRA: {trained:,} adapter parameters train" in out and out.count("LoRA:") == 1


def hunyuan_pipeline(folder: Path) -> Path:
    """A pipeline folder whose backbone is a Hunyuan-DiT (configs only: nothing before launch reads weights)."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanDiTPipeline",
                                                        "transformer": ["diffusers", "HunyuanDiT2DModel"]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": "HunyuanDiT2DModel"}))
    return folder


@pytest.mark.parametrize("backend, said", [
    ("torch", "--lora-rank 4: {} is a HunyuanDiT2DModel; LoRA trains a UNet2DConditionModel backbone"),
    ("mindspore", "--lora-rank 4 is not supported with --backend mindspore"),
])
def test_lora_that_cannot_train_is_refused_before_launch(tmp_path: Path, capsys, backend: str, said: str) -> None:
    pytest.importorskip("torch")  # the torch launcher's check needs torch installed (not imported by the check)
    folder = hunyuan_pipeline(tmp_path / "hdit")
    out = tmp_path / "run"
    assert main(["train", "--backend", backend, "--pipeline", str(folder), "--lora-rank", "4", "--plan-only",
                 "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and said.format(folder.resolve() / "transformer") in err
    assert not out.exists()  # refused before a plan or run folder was written
