"""Users' own diffusers models on PULSE: spec from the config, chunks over the model's own modules.

* tiny ``UNet2DConditionModel`` (the configuration diffusers' tests use) and a
  tiny ``HunyuanDiT2DModel``: the pipelined forward over sequential, V and
  wave plans equals ``model(...)`` (fp32); the gradients of a pipelined step
  equal single-device training (fp64, as tests/test_backends.py: some
  gradients here are zero in exact arithmetic and fp32 leaves only noise in
  them);
* ``split_resnets``: each ResnetBlock2D as two layers; the same forward and gradients, fp64, and
  a pipeline cut between the halves of a block (the block's input crossing with ``y``);
* the SD v2 config on the meta device: the zoo's ``sd2-unet`` spec layer by
  layer, FLOPs as ``FlopCounterMode`` counts them on the real modules;
* weights: save_pretrained -> load -> train 2 steps -> save_pretrained ->
  plain diffusers gives the trained wrapper's outputs;
* unsupported configurations: one ``SpecError`` naming the block; exit 2 on the CLI.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from pulse.cli.common import load_model  # noqa: E402
from pulse.cli.main import main  # noqa: E402
from pulse.costs import AnalyticProfiler, CostTable  # noqa: E402
from pulse.errors import PlanError, SpecError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Chunk, Placement  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.testing.local import LocalRun, local_run  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.schedule.generators import applicable_baselines, make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse.zoo.diffusers_config import UnsupportedDiffusersModel, spec_from_config, spec_from_path  # noqa: E402
from pulse_torch.diffusers_adapter import (DiffusersAdapter, from_diffusers, load_diffusers,  # noqa: E402
                                           measured_flops)
from diffusers_helpers import single_device_reference  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.layers import make_inputs  # noqa: E402
from torch_worker_check import make_batches, max_relative_error  # noqa: E402

torch.set_num_threads(1)
P, M = 2, 4  # pipeline devices, microbatches of one sample
UNET_TINY = dict(block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8)
DIT_TINY = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=8, num_attention_heads=2,
                cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16,
                text_len=4, text_len_t5=4, activation_fn="gelu-approximate")
# stabilityai/stable-diffusion-2 unet/config.json (768 px: sample_size 96)
SD2_CONFIG = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 1024,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0,
    "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4, "sample_size": 96,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "upcast_attention": True, "use_linear_projection": True,
}
MODELS = {"unet": (diffusers.UNet2DConditionModel, UNET_TINY, {"context_len": 8}),
          "unet-split": (diffusers.UNet2DConditionModel, UNET_TINY, {"context_len": 8, "split_resnets": True}),
          # two blocks per Transformer2DModel, 1x1-conv projections (SD 1.x's), each block's halves a layer
          "unet-split-attn": (diffusers.UNet2DConditionModel, {**UNET_TINY, "transformer_layers_per_block": 2},
                              {"context_len": 8, "split_transformers": True}),
          "dit": (diffusers.HunyuanDiT2DModel, DIT_TINY, {}),
          "dit-unsplit": (diffusers.HunyuanDiT2DModel, DIT_TINY, {"split_blocks": False}),
          "dit-v1.2": (diffusers.HunyuanDiT2DModel, {**DIT_TINY, "use_style_cond_and_image_meta_size": False}, {})}


def adapt(kind: str, dtype: torch.dtype = torch.float32) -> DiffusersAdapter:
    cls, config, options = MODELS[kind]
    torch.manual_seed(0)
    return from_diffusers(cls(**config).to(dtype), **options)


def plan_for(spec: ModelSpec, placement_kind: str, schedule: str):
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    if placement_kind == "sequential":
        placement = partition("sequential", spec, costs, P)
    else:
        placement = partition("pulse", spec, costs, P, folds=2 if placement_kind == "wave" else 1)
    names = applicable_baselines(placement, M)
    program = make_schedule(schedule if schedule in names else names[0], placement, M)
    return placement, lower(program, spec, placement)


def pipeline(adapter: DiffusersAdapter, placement_kind: str, schedule: str, loss_fn=eps_loss,
             **backend_options) -> LocalRun:
    spec = adapter.spec.with_act_bytes(torch.tensor([], dtype=adapter.dtype).element_size())
    placement, program = plan_for(spec, placement_kind, schedule)
    return local_run(spec, placement, program, adapter.backend(**backend_options), make_batches(spec, 1), loss_fn)


# -- forward and gradients ---------------------------------------------------------------------------
@pytest.mark.parametrize("placement_kind,schedule", [("sequential", "1f1b"), ("v", "greedy_v_1f1b"),
                                                     ("wave", "greedy_v_1f1b")])
@pytest.mark.parametrize("kind", list(MODELS))
def test_pipelined_forward_equals_the_model_call(kind: str, placement_kind: str, schedule: str) -> None:
    adapter = adapt(kind)
    errors = []

    def loss_fn(outputs, batch):  # the last chunk's output next to model(...) on the same microbatch
        with torch.no_grad():
            errors.append(float((outputs["h"] - adapter.call_model(batch)).abs().max()))
        return eps_loss(outputs, batch)

    try:
        run = pipeline(adapter, placement_kind, schedule, loss_fn)
    except PlanError as exc:  # a 2-fold wave needs more cut points than a tiny model may have
        pytest.skip(str(exc))
    run.step()
    assert len(errors) == M and max(errors) <= 1e-5, errors


@pytest.mark.parametrize("placement_kind,schedule", [("sequential", "1f1b"), ("v", "zero_bubble_v")])
@pytest.mark.parametrize("kind", ["unet", "unet-split", "unet-split-attn", "dit"])
def test_pipelined_gradients_equal_single_device_training(kind: str, placement_kind: str, schedule: str) -> None:
    adapter = adapt(kind, torch.float64)
    ref, ref_loss = single_device_reference(adapter, M)
    run = pipeline(adapter, placement_kind, schedule)
    run.step()
    got = {n: g.numpy() for n, g in run.gradients().items()}
    err = max_relative_error(got, ref)  # names: the model's own parameter names
    assert err < 1e-5, f"{kind} {placement_kind}: gradients differ by {err:.2e} (relative)"
    assert run.loss() == pytest.approx(ref_loss, rel=1e-12)


@pytest.mark.parametrize("kind,second", [("unet-split", "down1_res0_out"), ("unet-split-attn", "down1_attn0_cross0"),
                                         ("unet-split-attn", "up0_attn1_self1")])
def test_a_cut_inside_a_block_gives_the_models_gradients(kind: str, second: str) -> None:
    """pp 2 cut inside a ResnetBlock2D with a shortcut conv (its input crosses with ``y``), or between a
    transformer block's halves or two blocks (the model's input crosses with the tokens); fp64, exact."""
    adapter = adapt(kind, torch.float64)
    ref, ref_loss = single_device_reference(adapter, M)
    spec = adapter.spec.with_act_bytes(8)
    cut = spec.index(second)  # down_blocks.1.resnets.0: 32 -> 64 channels, conv_shortcut
    assert spec.layers[cut].attrs.get("conv_shortcut", True)
    placement = Placement("sequential", 2, (Chunk(0, cut, 0), Chunk(cut, spec.num_layers, 1)), "relay", "test")
    program = lower(make_schedule("1f1b", placement, M), spec, placement)
    run = local_run(spec, placement, program, adapter.backend(), make_batches(spec, 1), eps_loss)
    run.step()
    err = max_relative_error({n: g.numpy() for n, g in run.gradients().items()}, ref)
    assert err < 1e-10, f"gradients differ by {err:.2e} (relative)"
    assert run.loss() == pytest.approx(ref_loss, rel=1e-12)


def test_lora_on_split_resnets_sits_in_each_half_and_keeps_the_models_forward() -> None:
    """peft swaps a targeted conv for its LoRA wrapper inside the block: each half holds its own wrappers
    (``add_lora`` checks every adapter is in one layer, and priced as ``pulse.zoo.lora`` says)."""
    pytest.importorskip("peft")
    from pulse_torch.diffusers_adapter.lora import LoraSettings, add_lora

    adapter = adapt("unet-split", torch.float64)
    add_lora(adapter, LoraSettings.of(2, targets="conv1,conv2,conv_shortcut"), seed=3)
    first, second = adapter.layers["down1_res0_in"], adapter.layers["down1_res0_out"]
    assert {n.split(".")[0] for n, p in first.named_parameters() if p.requires_grad} == {"conv1"}
    assert {n.split(".")[0] for n, p in second.named_parameters() if p.requires_grad} == {"conv2", "conv_shortcut"}
    _assert_adapted_layers_give_the_models_forward(adapter)


def _assert_adapted_layers_give_the_models_forward(adapter: DiffusersAdapter) -> None:
    """With every lora_B moved off zero (peft starts it there), the layered forward is ``model(...)``'s (fp64)."""
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    h, shared = make_inputs(adapter.spec, 2)
    shared = {k: v.double() if v.is_floating_point() else v for k, v in shared.items()}
    with torch.no_grad():
        got, want = adapter.layered()(h.double(), shared), adapter.call_model({"h": h.double(), **shared})
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_lora_on_split_transformers_sits_in_each_part_and_keeps_the_models_forward() -> None:
    """The first part holds proj_in's adapter and its block's attn1's, the last proj_out's and its ff's."""
    pytest.importorskip("peft")
    from pulse_torch.diffusers_adapter.lora import LoraSettings, add_lora

    adapter = adapt("unet-split-attn", torch.float64)
    add_lora(adapter, LoraSettings.of(2, targets="proj_in,proj_out,to_q,ff.net.2"), seed=3)

    def trained(layer):
        return {n.rsplit(".lora_", 1)[0] for n, p in adapter.layers[layer].named_parameters() if p.requires_grad}
    assert trained("down1_attn0_self0") == {"proj_in", "attn1.to_q"}
    assert trained("down1_attn0_cross0") == {"attn2.to_q", "ff.net.2"}
    assert trained("down1_attn0_cross1") == {"attn2.to_q", "ff.net.2", "proj_out"}
    _assert_adapted_layers_give_the_models_forward(adapter)


def test_split_layers_on_the_sd2_config_agree_with_the_zoo() -> None:
    """SD v2 with split_resnets and split_transformers: the zoo's split spec layer by layer, each half's and
    part's FLOPs as the real modules'."""
    options = {"split_resnets": True, "split_transformers": True}
    adapter, zoo = _sd2_meta(resolution=512, **options), get_spec("sd2-unet", **options)
    whole = get_spec("sd2-unet")
    # 22 ResNets in halves, 16 Transformer2DModels of one block each in two parts
    assert adapter.spec.total_params == 865_910_724 and zoo.num_layers == whole.num_layers + 22 + 16
    assert [(l.name, l.kind, l.params, l.out_bytes) for l in adapter.spec.layers] == \
        [(l.name, l.kind, l.params, l.out_bytes) for l in zoo.layers]
    assert adapter.spec.skips == zoo.skips and zoo.total_flops == whole.total_flops
    worst = _flop_agreement(adapter, zoo)
    assert {"resnet_in", "resnet_out", "transformer2d_part"} <= set(worst) and max(worst.values()) < 0.05, worst


# -- the spec against the modules ---------------------------------------------------------------------
def _output_elements(adapter: DiffusersAdapter, h, shared) -> dict[str, int]:
    """Main-path output elements per sample of every layer, from a real forward (any device)."""
    sizes = {}
    hooks = [layer.register_forward_hook(lambda m, i, out, name=name: sizes.__setitem__(name, out[0][0].numel()))
             for name, layer in adapter.layers.items()]
    with torch.no_grad():
        adapter.layered()(h, shared)
    for hook in hooks:
        hook.remove()
    return sizes


@pytest.mark.parametrize("kind", list(MODELS))
def test_spec_sizes_are_the_modules_own(kind: str) -> None:
    adapter = adapt(kind)
    spec, model = adapter.spec, adapter.model
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    h, shared = make_inputs(spec, 1)
    elements = _output_elements(adapter, h, shared)
    assert {l.name: l.out_bytes for l in spec.layers} == {n: e * spec.act_bytes for n, e in elements.items()}
    assert all(e.bytes == elements[e.src] * spec.act_bytes for e in spec.skips)
    # One chunk of every layer holds the model's parameters under the model's names (checkpoint keys).
    whole = Placement("sequential", 1, (Chunk(0, spec.num_layers, 0),), "relay", "test")
    backend = adapter.backend()
    chunk = backend.build_chunk(spec, Wiring(spec, whole).ios[0])
    assert {n: id(p) for n, p in backend.parameters(chunk).items()} == {n: id(p) for n, p in model.named_parameters()}


def _sd2_meta(**options) -> DiffusersAdapter:
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel.from_config(SD2_CONFIG)
    return from_diffusers(model, **options)


def _flop_agreement(adapter: DiffusersAdapter, zoo: ModelSpec) -> dict[str, float]:
    """Worst relative difference per layer kind: zoo FLOPs vs FlopCounterMode on the real modules (meta)."""
    h, shared = make_inputs(adapter.spec, 1)
    measured = measured_flops(adapter.spec, adapter.layers, h.to("meta"), {k: v.to("meta") for k, v in shared.items()})
    worst: dict[str, float] = defaultdict(float)
    for layer in zoo.layers:
        worst[layer.kind] = max(worst[layer.kind], abs(layer.flops - measured[layer.name]) / measured[layer.name])
    return dict(worst)


@pytest.mark.parametrize("options,zoo_name", [({}, "sd2-unet-768"), ({"resolution": 512}, "sd2-unet")])
def test_sd2_config_on_meta_agrees_with_the_zoo(options: dict, zoo_name: str) -> None:
    adapter, zoo = _sd2_meta(**options), get_spec(zoo_name)
    spec = adapter.spec
    assert spec.total_params == 865_910_724 == sum(p.numel() for p in adapter.model.parameters())
    assert spec.num_layers == zoo.num_layers == 47
    assert [(l.name, l.kind, l.params) for l in spec.layers] == [(l.name, l.kind, l.params) for l in zoo.layers]
    assert spec.skips == zoo.skips and spec.shared_inputs == zoo.shared_inputs
    assert spec.layers == zoo.layers  # flops and bytes too (attrs aside)
    worst = _flop_agreement(adapter, zoo)
    assert set(worst) == {"time_embed", "conv_in", "resnet", "transformer2d", "downsample", "upsample", "conv_out"}
    assert max(worst.values()) < 0.05, worst
    h, shared = make_inputs(spec, 1)  # skips carry what the real modules output
    elements = _output_elements(adapter, h.to("meta"), {k: v.to("meta") for k, v in shared.items()})
    assert all(e.bytes == elements[e.src] * spec.act_bytes for e in spec.skips)
    costs = AnalyticProfiler(load_hardware("ascend-910a")).profile(spec, 1)
    assert partition("pulse", spec, costs, 8).num_devices == 8  # plannable without a byte of weights


def test_hunyuan_dit_g2_config_on_meta_agrees_with_the_zoo() -> None:
    config = dict(sample_size=128, patch_size=2, in_channels=4, num_layers=40, attention_head_dim=88,
                  num_attention_heads=16, cross_attention_dim=1024, cross_attention_dim_t5=2048,
                  pooled_projection_dim=1024, hidden_size=1408, text_len=77, text_len_t5=256, mlp_ratio=4.3637)
    with torch.device("meta"):
        adapter = from_diffusers(diffusers.HunyuanDiT2DModel(**config), resolution=256)
    zoo = get_spec("hunyuan-dit", resolution=256)
    assert [(l.name, l.params) for l in adapter.spec.layers] == [(l.name, l.params) for l in zoo.layers]
    assert adapter.spec.skips == zoo.skips and adapter.spec.total_params == 1_516_534_048
    assert max(_flop_agreement(adapter, zoo).values()) < 0.05


def test_core_reads_the_config_file_alone(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps(SD2_CONFIG))
    spec = spec_from_path(tmp_path / "unet", resolution=512)
    assert spec.name == f"{tmp_path.name}-unet-512" and spec.layers == get_spec("sd2-unet").layers
    assert load_model(f"diffusers:{tmp_path / 'unet' / 'config.json'}").layers == get_spec("sd2-unet-768").layers


# -- weights ------------------------------------------------------------------------------------------
def test_trained_weights_round_trip_through_save_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**UNET_TINY).save_pretrained(tmp_path / "unet")
    adapter = load_diffusers(tmp_path / "unet", context_len=8)  # from_pretrained, local folder only
    before = {n: p.detach().clone() for n, p in adapter.model.named_parameters()}
    run = pipeline(adapter, "v", "greedy_v_1f1b", lr=1e-3)
    for _ in range(2):
        run.step(optimize=True)
    assert all(not torch.equal(before[n], p) for n, p in adapter.model.named_parameters())
    adapter.model.save_pretrained(tmp_path / "trained")
    reloaded = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "trained", local_files_only=True)
    batch = make_batches(adapter.spec, 2)(7)
    shared = {k: v for k, v in batch.items() if k not in ("h", "target")}
    with torch.no_grad():
        plain = reloaded(batch["h"], batch["timesteps"], encoder_hidden_states=batch["context"]).sample
        assert torch.equal(plain, adapter.layered()(batch["h"], shared))


# -- what is not supported ------------------------------------------------------------------------------
UNET_CONFIG = {"_class_name": "UNet2DConditionModel", **UNET_TINY}


@pytest.mark.parametrize("change,named", [
    ({"class_embed_type": "timestep"}, "class_embed_type"),
    ({"num_class_embeds": 10}, "num_class_embeds"),
    ({"addition_embed_type": "text"}, "addition_embed_type"),
    ({"mid_block_type": None}, "mid_block"),
    ({"attention_type": "gated"}, "attention_type"),
    ({"down_block_types": ("DownBlock2D", "AttnDownBlock2D")}, "down_blocks.1"),
    ({"up_block_types": ("CrossAttnUpBlock2D", "AttnUpBlock2D")}, "up_blocks.1"),
    ({"up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}, "up_blocks.0"),
    ({"transformer_layers_per_block": [[1, 2], [1, 2]]}, "transformer_layers_per_block"),  # per block
    ({"resnet_time_scale_shift": "scale_shift"}, "resnet_time_scale_shift"),
])
def test_unsupported_unet_configs_name_the_block(change: dict, named: str) -> None:
    with pytest.raises(UnsupportedDiffusersModel, match=named) as err:
        spec_from_config({**UNET_CONFIG, **change})
    assert isinstance(err.value, SpecError)


@pytest.mark.parametrize("change,named", [({"activation_fn": "geglu"}, "activation_fn"),
                                          ({"norm_type": "ada_norm"}, "norm_type"),
                                          ({"num_layers": 5}, "num_layers"),
                                          ({"hidden_size": 32}, "hidden_size")])
def test_unsupported_hunyuan_configs_name_the_field(change: dict, named: str) -> None:
    with pytest.raises(UnsupportedDiffusersModel, match=named):
        spec_from_config({**DIT_TINY, **change}, "HunyuanDiT2DModel")


def test_unsupported_models_are_refused_by_the_adapter() -> None:
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(**UNET_TINY, class_embed_type="timestep")
    with pytest.raises(UnsupportedDiffusersModel, match="class_embed_type"):
        from_diffusers(model)
    adapter = adapt("unet")
    adapter.model.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    with pytest.raises(UnsupportedDiffusersModel, match="FreeU"):
        from_diffusers(adapter.model)
    adapter.model.disable_freeu()
    adapter.model.extra = torch.nn.Linear(2, 2)  # a parameter no layer would train
    with pytest.raises(UnsupportedDiffusersModel, match="belong to no layer"):
        from_diffusers(adapter.model, context_len=8)
    with pytest.raises(UnsupportedDiffusersModel, match="not a supported"):
        from_diffusers(torch.nn.Linear(2, 2))


# -- the CLI ----------------------------------------------------------------------------------------------
def test_cli_plans_a_local_model_folder(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**UNET_TINY).save_pretrained(tmp_path / "unet")
    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", "--diffusers-config", str(tmp_path / "unet"), "--pp", "2", "--hardware", "cpu-local",
                 "--model-option", "context_len=8", "--out", str(plan_path)]) == 0
    plan, spec = load_plan(plan_path, load_model)
    assert plan.model == f"diffusers:{(tmp_path / 'unet').resolve()}" and plan.model_options == {"context_len": 8}
    assert spec.layers == load_diffusers(plan.model, **plan.model_options).spec.layers
    assert main(["train", "--diffusers-config", str(tmp_path / "unet" / "config.json"), "--plan-only",
                 "--model-option", "context_len=8", "--out-dir", str(tmp_path / "run")]) == 0
    plan, _ = load_plan(tmp_path / "run" / "plan.yaml", load_model)
    assert plan.model == f"diffusers:{(tmp_path / 'unet').resolve()}"  # the folder: config and weights
    capsys.readouterr()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**UNET_CONFIG, "addition_embed_type": "text"}))
    assert main(["plan", "--diffusers-config", str(bad), "--pp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "addition_embed_type" in err
    assert main(["plan", "--model", "tiny-unet", "--diffusers-config", str(bad)]) == 2  # argparse's code, returned
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not both" in err


def test_backend_refuses_shared_replicas_and_a_foreign_dtype() -> None:
    adapter = adapt("dit")
    spec = adapter.spec.with_act_bytes(4)
    placement, program = plan_for(spec, "sequential", "1f1b")
    with pytest.raises(PlanError, match="one pipeline replica"):
        local_run(spec, placement, program, adapter.backend(), make_batches(spec, 1), eps_loss, dp=2)
    with pytest.raises(PlanError, match="cast the model"):
        local_run(spec, placement, program, adapter.backend(dtype=torch.float64), make_batches(spec, 1), eps_loss)


def test_pulse_train_runs_the_users_model_on_two_gloo_processes(tmp_path: Path) -> None:
    """`pulse train --diffusers-config` trains the saved model itself, not a zoo copy of it."""
    import subprocess
    import sys

    diffusers.UNet2DConditionModel(**UNET_TINY).save_pretrained(tmp_path / "unet")
    out = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--diffusers-config", str(tmp_path / "unet"),
         "--pp", "2", "--dp", "1", "--steps", "2", "--microbatch-size", "1", "--out-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log["run"]["model"].startswith("diffusers:")
    assert len(log["steps"]) == 2 and all(s["loss"] > 0 for s in log["steps"])


SPLIT_KINDS = {"split_resnets": ("resnet_in", "resnet_out"), "split_transformers": ("transformer2d_part",)}


@pytest.mark.parametrize("split", ["", "split_resnets", "split_transformers"])
def test_one_process_profile_times_the_users_own_modules(tmp_path: Path, capsys, split: str) -> None:
    """``python -m pulse_torch.profile --diffusers-config``: the user's modules through the runtime, one
    row per module of the adapter's spec (not zoo layers), with the per-action figures the simulator reads
    and the bytes each layer's forward saved for its backward; with ``split_resnets`` a row per half, with
    ``split_transformers`` one per transformer part, whose saved bytes are the spec's analytic ones."""
    from pulse_torch.profiler import main as profile_main

    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**UNET_TINY).save_pretrained(tmp_path / "unet")
    out = tmp_path / "costs.yaml"
    options = ["--model-option", "context_len=8"] + (["--model-option", f"{split}=true"] if split else [])
    assert profile_main(["--diffusers-config", str(tmp_path / "unet"), *options,
                         "--microbatch-size", "1", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    costs = CostTable.load(out)
    spec = load_diffusers(f"diffusers:{(tmp_path / 'unet').resolve()}", context_len=8,
                          **({split: True} if split else {})).spec
    assert costs.layer_names == tuple(layer.name for layer in spec.layers)
    # what autograd saved in each layer's forward (fp32), not the spec's analytic saved_bytes
    assert costs.act_mem_measured and len(costs.act_mem) == spec.num_layers and all(m > 0 for m in costs.act_mem)
    halves = [(m, layer.saved_bytes * 2) for m, layer in zip(costs.act_mem, spec.layers)
              if layer.kind in SPLIT_KINDS.get(split, ())]
    assert len(halves) == {"": 0, "split_resnets": 2 * 12, "split_transformers": 2 * 6}[split]
    # fp32: twice the spec's fp16 bytes; the second half's count is an upper bound (unet_blocks.resnet_halves).
    # A transformer part's attention also saves its softmax statistics (heads x tokens floats, 1-2% here),
    # and the cross part one more C per token than the spec counts (1.049x: 1,586,176 B against 1,511,424)
    upper = {"split_resnets": 1.02, "split_transformers": 1.05}.get(split, 1.0)
    assert all(0.75 * f <= m <= upper * f for m, f in halves), halves
    assert all(f > 0 and 0 < i <= b for f, i, b in zip(costs.fwd, costs.bwd_input, costs.bwd))
    assert {k for k, _ in costs.per_action} >= {"F", "B", "Bi", "W", "O"}
    assert "cost table written" in capsys.readouterr().out
