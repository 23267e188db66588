"""Each rank holds only its stage: a diffusers model built on the meta device, only the rank's layers made real.

* at pp 2 and 4 (V and sequential placements), every rank's materialized parameters are exactly its
  chunks' (``pulse.ownership.stage_layers``), on the host and the device alike, and equal the whole
  model's: from a saved folder (single file and sharded index) and from a config (seeded per layer,
  so the split does not change a run's initial weights);
* a ResnetBlock2D split across two ranks (``split_resnets``): each rank holds its half's parameters;
* LoRA adapters follow the stage and equal a single-device model's; a bf16 run holds its frozen base in bf16;
* the pipelined gradients over stage-only ranks equal single-device training of the whole model;
* a saved folder whose weights miss a key, or hold a wrong shape, is one ``SpecError``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import SpecError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.ownership import stage_layers  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Chunk, Placement  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse_torch.diffusers_adapter.lora import LoraSettings, add_lora  # noqa: E402
from pulse_torch.diffusers_adapter.stage_loading import (load_stage, materialize,  # noqa: E402
                                                         materialized_parameters, skeleton_adapter)
from pulse_torch.diffusion import eps_loss  # noqa: E402
from diffusers_helpers import single_device_reference  # noqa: E402
from test_diffusers import DIT_TINY, UNET_TINY  # noqa: E402
from torch_worker_check import make_batches, max_relative_error  # noqa: E402

torch.set_num_threads(1)
CONFIGS = {"unet": (diffusers.UNet2DConditionModel, UNET_TINY, {"context_len": 8}),
           "unet-split": (diffusers.UNet2DConditionModel, UNET_TINY, {"context_len": 8, "split_resnets": True}),
           "dit": (diffusers.HunyuanDiT2DModel, DIT_TINY, {})}


def config_folder(tmp: Path, kind: str) -> Path:
    cls, config, _ = CONFIGS[kind]
    folder = tmp / f"{kind}-config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **config}))
    return folder


def saved_folder(tmp: Path, kind: str, shard: str | None = None) -> Path:
    cls, config, _ = CONFIGS[kind]
    torch.manual_seed(3)
    folder = tmp / f"{kind}-saved-{shard or 'one'}"
    kwargs = {"max_shard_size": shard} if shard else {}
    cls(**config).save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def placement_of(spec, pp: int, kind: str) -> Placement:
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    return partition("pulse" if kind == "v" else "sequential", spec, costs, pp)


@pytest.mark.parametrize("source", ["config", "saved", "sharded"])
@pytest.mark.parametrize("kind", ["unet", "dit"])
@pytest.mark.parametrize("pp,placement_kind", [(2, "v"), (4, "sequential")])
def test_each_rank_materializes_exactly_its_stage_and_the_whole_models_weights(
        tmp_path: Path, kind: str, source: str, pp: int, placement_kind: str) -> None:
    folder = (config_folder(tmp_path, kind) if source == "config"
              else saved_folder(tmp_path, kind, "20KB" if source == "sharded" else None))
    if source == "sharded":
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    options = CONFIGS[kind][2]
    whole = load_stage(folder, seed=7, **options)
    reference = {n: p.detach() for n, p in whole.model.named_parameters()}
    assert all(p.device.type == "cpu" for p in whole.model.parameters())
    if source != "config":  # the saved weights themselves, as diffusers loads them
        loaded = dict(CONFIGS[kind][0].from_pretrained(folder).named_parameters())
        assert all(torch.equal(reference[n], p) for n, p in loaded.items())
    placement = placement_of(whole.spec, pp, placement_kind)
    seen: set[str] = set()
    for device in range(pp):
        adapter = load_stage(folder, stage_layers(whole.spec, placement, device), seed=7, **options)
        names = adapter.parameter_names()
        mine = {names[id(p)] for layer in stage_layers(whole.spec, placement, device)
                for p in adapter.layers[layer].parameters()}
        real = materialized_parameters(adapter.model)
        assert set(real) == mine, f"device {device} holds {sorted(set(real) ^ mine)[:3]} beyond/short of its stage"
        assert all(torch.equal(p, reference[n]) for n, p in real.items())
        seen |= mine
    assert seen == set(reference)  # the stages together are the model, each parameter once


def test_a_resnet_split_across_two_ranks_is_materialized_half_by_half(tmp_path: Path) -> None:
    """``split_resnets``: a cut between a ResnetBlock2D's halves gives each rank its half's parameters only,
    read by key from the saved weights."""
    folder = saved_folder(tmp_path, "unet-split")
    options = CONFIGS["unet-split"][2]
    whole = load_stage(folder, seed=7, **options)
    reference = {n: p.detach() for n, p in whole.model.named_parameters()}
    spec = whole.spec
    cut = spec.index("down1_res0_out")  # down_blocks.1.resnets.0 (32 -> 64 channels: a shortcut conv)
    placement = Placement("sequential", 2, (Chunk(0, cut, 0), Chunk(cut, spec.num_layers, 1)), "relay", "test")
    block = "down_blocks.1.resnets.0"
    halves = ({f"{block}.{m}.{w}" for m in ("norm1", "conv1", "time_emb_proj") for w in ("weight", "bias")},
              {f"{block}.{m}.{w}" for m in ("norm2", "conv2", "conv_shortcut") for w in ("weight", "bias")})
    held = []
    for device in range(2):
        adapter = load_stage(folder, stage_layers(spec, placement, device), seed=7, **options)
        real = materialized_parameters(adapter.model)
        names = adapter.parameter_names()
        assert set(real) == {names[id(p)] for layer in stage_layers(spec, placement, device)
                             for p in adapter.layers[layer].parameters()}
        assert {n for n in real if n.startswith(f"{block}.")} == halves[device]
        assert all(torch.equal(p, reference[n]) for n, p in real.items())
        held.append(set(real))
    assert held[0] | held[1] == set(reference) and not held[0] & held[1]


def test_config_weights_do_not_depend_on_the_seed_order_but_on_the_seed(tmp_path: Path) -> None:
    folder = config_folder(tmp_path, "unet")
    a, b, c = (load_stage(folder, seed=s, context_len=8) for s in (1, 1, 2))
    pa, pb, pc = (dict(x.model.named_parameters()) for x in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    moved = [n for n in pa if pa[n].numel() > 1 and not torch.equal(pa[n], pc[n])]
    assert len(moved) > len(pa) // 2  # another seed draws other weights
    # the layers are initialised as PyTorch initialises their modules: norms at one, convs bounded
    assert torch.equal(pa["conv_norm_out.weight"], torch.ones_like(pa["conv_norm_out.weight"]))
    fan_in = pa["conv_in.weight"][0].numel()
    assert float(pa["conv_in.weight"].detach().abs().max()) <= fan_in ** -0.5 + 1e-6


def test_lora_adapters_follow_the_stage_and_equal_the_single_device_ones(tmp_path: Path) -> None:
    folder = saved_folder(tmp_path, "unet")
    lora = LoraSettings.of(4)
    whole = load_stage(folder, context_len=8)
    add_lora(whole, lora, seed=5)
    reference = {n: p.detach() for n, p in whole.model.named_parameters() if p.requires_grad}
    placement = placement_of(whole.spec, 2, "v")
    for device in range(2):
        adapter = skeleton_adapter(folder, context_len=8)
        materialize(adapter, stage_layers(adapter.spec, placement, device), frozen_dtype=torch.bfloat16)
        add_lora(adapter, lora, seed=5)
        real = materialized_parameters(adapter.model)
        trained = {n: p for n, p in real.items() if p.requires_grad}
        assert trained and all(".lora_" in n for n in trained)
        assert all(torch.equal(p, reference[n]) for n, p in trained.items())
        assert all(p.dtype == torch.float32 for p in trained.values())  # adapters train in fp32
        assert {p.dtype for n, p in real.items() if not p.requires_grad} == {torch.bfloat16}
        chunks = [c for c in placement.chunks if c.device == device]
        backend = adapter.backend()
        from pulse.runtime.wiring import Wiring

        ios = Wiring(adapter.spec, placement).ios
        for c in chunks:  # the backend accepts a bf16 frozen base under fp32 adapters
            backend.build_chunk(adapter.spec, ios[placement.chunks.index(c)])


@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_pipelined_gradients_over_stage_only_ranks_equal_single_device_training(tmp_path: Path, kind: str) -> None:
    folder = config_folder(tmp_path, kind)
    options = CONFIGS[kind][2]
    whole = load_stage(folder, seed=1, **options)
    whole.model.double()
    microbatches = 4
    ref, ref_loss = single_device_reference(whole, microbatches)
    spec = whole.spec.with_act_bytes(8)
    placement = placement_of(spec, 2, "v")
    program = lower(make_schedule("greedy_v_1f1b", placement, microbatches), spec, placement)
    grads: dict = {}
    for device in range(2):  # each device's stage alone, its gradients read where it ran
        adapter = load_stage(folder, stage_layers(spec, placement, device), seed=1, **options)
        for p in materialized_parameters(adapter.model).values():
            p.data = p.data.double()
        # a one-process run needs every layer; the other device's layers come from a second stage-only model
        other = load_stage(folder, stage_layers(spec, placement, 1 - device), seed=1, **options)
        for p in materialized_parameters(other.model).values():
            p.data = p.data.double()
        mine = set(stage_layers(spec, placement, device))
        for name in adapter.layers:
            if name not in mine:
                adapter.layers[name] = other.layers[name]
        run = local_run(spec, placement, program, adapter.backend(), make_batches(spec, 1), eps_loss)
        run.step()
        names = {**other.parameter_names(), **adapter.parameter_names()}
        for layer in mine:
            for p in adapter.layers[layer].parameters():
                grads[names[id(p)]] = p.grad.detach().numpy()
        assert run.loss() == pytest.approx(ref_loss, rel=1e-12)
    assert set(grads) == set(ref)
    assert max_relative_error(grads, ref) < 1e-5


def test_saved_weights_that_do_not_match_the_config_are_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = saved_folder(tmp_path, "unet")
    path = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    tensors.pop("conv_out.bias")
    save_file(tensors, path)
    with pytest.raises(SpecError, match="no 'conv_out.bias'"):
        load_stage(folder, context_len=8)
    tensors["conv_out.bias"] = torch.zeros(5)
    save_file(tensors, path)
    with pytest.raises(SpecError, match="conv_out.bias.*in config.json"):
        load_stage(folder, context_len=8)


def test_a_frozen_base_from_a_config_is_held_in_its_dtype(tmp_path: Path) -> None:
    """Config-only weights (seeded per layer) of a LoRA run's frozen base, cast as saved ones are: every
    materialized parameter in bf16, frozen, and equal to the fp32 initialisation rounded once."""
    folder = config_folder(tmp_path, "unet")
    fp32 = load_stage(folder, seed=3, context_len=8)
    frozen = load_stage(folder, seed=3, frozen_dtype=torch.bfloat16, context_len=8)
    reference = dict(fp32.model.named_parameters())
    for name, p in materialized_parameters(frozen.model).items():
        assert p.dtype == torch.bfloat16 and not p.requires_grad, name
        assert torch.equal(p, reference[name].detach().to(torch.bfloat16)), name
    assert set(materialized_parameters(frozen.model)) == set(reference)
