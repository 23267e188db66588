"""SDXL's UNet on PULSE: added text/time conditioning, several transformer blocks per attention.

* a tiny random SDXL ``UNet2DConditionModel`` (addition_embed_type "text_time",
  transformer_layers_per_block per level): the spec counts its parameters, the
  pipelined forward (every chunk over the fake network) is bit-equal to
  ``model(..., added_cond_kwargs)``, pipelined gradients equal single-device
  ones (fp64);
* the published SDXL base config on the meta device: diffusers' 2,567,463,684
  parameters, the zoo's ``sdxl-unet`` layer by layer, FLOPs as
  ``FlopCounterMode`` counts them; ``pulse plan --model sdxl-unet --pp 4``;
* refusals, each one line: other addition embeddings, per-block depths, the
  native layers and MindSpore; an SDXL *pipeline* folder plans its UNet (its
  encoding, training and export: tests/test_sdxl_pipeline.py).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from diffusers_helpers import single_device_reference  # noqa: E402
from pulse.cli.main import main  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import PulseError, SpecError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Chunk, Placement  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.schedule.generators import applicable_baselines, make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse.zoo.diffusers_config import UnsupportedDiffusersModel, spec_from_config  # noqa: E402
from pulse_torch.diffusers_adapter import DiffusersAdapter, from_diffusers, measured_flops  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.layers import make_inputs  # noqa: E402
from torch_worker_check import make_batches, max_relative_error  # noqa: E402

torch.set_num_threads(1)
P, M = 2, 4  # pipeline devices, microbatches of one sample
POOLED, PER_ID = 16, 8  # pooled text width, sinusoid width per time id
SDXL_TINY = dict(block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                 attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=PER_ID,
                 projection_class_embeddings_input_dim=POOLED + 6 * PER_ID)
# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the fields that differ from diffusers' defaults)
SDXL_BASE = {
    "_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "in_channels": 4,
    "layers_per_block": 2, "out_channels": 4, "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
    "transformer_layers_per_block": [1, 2, 10], "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                                                                   "UpBlock2D"],
    "use_linear_projection": True,
}
SDXL_BASE_PARAMS = 2_567_463_684  # sum(p.numel()) of diffusers' model for that config


def adapt(dtype: torch.dtype = torch.float32) -> DiffusersAdapter:
    torch.manual_seed(0)
    return from_diffusers(diffusers.UNet2DConditionModel(**SDXL_TINY).to(dtype), context_len=8)


def pipeline(adapter: DiffusersAdapter, placement_kind: str, schedule: str, loss_fn=eps_loss):
    spec = adapter.spec.with_act_bytes(torch.tensor([], dtype=adapter.dtype).element_size())
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    if placement_kind == "sequential":
        placement = partition("sequential", spec, costs, P)
    else:
        placement = partition("pulse", spec, costs, P, folds=1)
    names = applicable_baselines(placement, M)
    program = make_schedule(schedule if schedule in names else names[0], placement, M)
    return local_run(spec, placement, lower(program, spec, placement), adapter.backend(), make_batches(spec, 1),
                     loss_fn)


# -- the tiny model -----------------------------------------------------------------------------------
def test_spec_counts_the_added_embedding_and_the_deeper_attentions() -> None:
    adapter = adapt()
    spec, model = adapter.spec, adapter.model
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    time_embed = spec.layers[spec.index("time_embed")]
    added = sum(p.numel() for p in model.add_embedding.parameters())
    assert time_embed.params == added + sum(p.numel() for p in model.time_embedding.parameters())
    assert time_embed.attrs["text_embeds_dim"] == POOLED and time_embed.attrs["time_ids"] == 6
    data = [s.name for s in spec.shared_inputs if s.producer is None]
    assert data == ["timesteps", "context", "text_embeds", "time_ids"]
    depth = {l.name: l.attrs["num_layers"] for l in spec.layers if l.kind == "transformer2d"}
    assert depth == {"down1_attn0": 2, "down1_attn1": 2, "mid_attn": 2, "up0_attn0": 2, "up0_attn1": 2,
                     "up0_attn2": 2}
    h, shared = make_inputs(spec, 3)
    assert shared["text_embeds"].shape == (3, POOLED)
    assert shared["time_ids"].tolist() == [[128.0, 128.0, 0.0, 0.0, 128.0, 128.0]] * 3  # 16 latents x 8
    # One chunk of every layer holds the model's parameters under the model's names.
    whole = Placement("sequential", 1, (Chunk(0, spec.num_layers, 0),), "relay", "test")
    backend = adapter.backend()
    chunk = backend.build_chunk(spec, Wiring(spec, whole).ios[0])
    assert {n: id(p) for n, p in backend.parameters(chunk).items()} == {n: id(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement_kind,schedule", [("sequential", "1f1b"), ("v", "greedy_v_1f1b")])
def test_pipelined_forward_is_bit_equal_to_diffusers(placement_kind: str, schedule: str) -> None:
    adapter = adapt()
    errors = []

    def loss_fn(outputs, batch):  # the last chunk's output next to model(...) on the same microbatch
        with torch.no_grad():
            reference = adapter.call_model(batch)
            errors.append(float((outputs["h"] - reference).abs().max()))
        assert set(batch) >= {"text_embeds", "time_ids"}  # the added conditions travel with the batch
        return eps_loss(outputs, batch)

    pipeline(adapter, placement_kind, schedule, loss_fn).step()
    assert errors == [0.0] * M


def test_the_added_conditions_change_the_output() -> None:
    """The pipelined layers read text_embeds and time_ids (a model that ignored them would pass the above)."""
    adapter = adapt()
    h, shared = make_inputs(adapter.spec, 1)
    with torch.no_grad():
        base = adapter.layered()(h, shared)
        for name in ("text_embeds", "time_ids"):
            changed = adapter.layered()(h, {**shared, name: shared[name] + 1.0})
            assert float((changed - base).abs().max()) > 1e-4, name


@pytest.mark.parametrize("placement_kind,schedule", [("sequential", "1f1b"), ("v", "zero_bubble_v")])
def test_pipelined_gradients_equal_single_device_training(placement_kind: str, schedule: str) -> None:
    adapter = adapt(torch.float64)
    ref, ref_loss = single_device_reference(adapter, M)
    assert float(abs(ref["add_embedding.linear_1.weight"]).max()) > 0  # the added embedding is trained
    run = pipeline(adapter, placement_kind, schedule)
    run.step()
    got = {n: g.numpy() for n, g in run.gradients().items()}
    assert max_relative_error(got, ref) < 1e-10
    assert run.loss() == pytest.approx(ref_loss, rel=1e-12)


def test_pulse_train_runs_an_sdxl_unet_on_two_gloo_processes(tmp_path: Path) -> None:
    """`pulse train --diffusers-config` on a saved SDXL UNet: the time_embed chunk gets the added inputs."""
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**SDXL_TINY).save_pretrained(tmp_path / "unet")
    out = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--diffusers-config", str(tmp_path / "unet"),
         "--pp", "2", "--dp", "1", "--steps", "2", "--microbatch-size", "1", "--model-option", "context_len=8",
         "--out-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log["run"]["model"].startswith("diffusers:")
    assert len(log["steps"]) == 2 and all(s["loss"] > 0 for s in log["steps"])


# -- the published config and the zoo ---------------------------------------------------------------------
def test_sdxl_base_config_on_meta_is_the_zoo_entry() -> None:
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel.from_config(SDXL_BASE)
    adapter = from_diffusers(model)
    spec, zoo = adapter.spec, get_spec("sdxl-unet")
    assert spec.total_params == zoo.total_params == SDXL_BASE_PARAMS == sum(p.numel() for p in model.parameters())
    assert spec.layers == zoo.layers and spec.skips == zoo.skips and spec.shared_inputs == zoo.shared_inputs
    assert zoo.num_layers == 35 and zoo.meta["image_resolution"] == 1024
    h, shared = make_inputs(spec, 1)
    measured = measured_flops(spec, adapter.layers, h.to("meta"), {k: v.to("meta") for k, v in shared.items()})
    worst: dict[str, float] = defaultdict(float)
    for layer in zoo.layers:
        worst[layer.kind] = max(worst[layer.kind], abs(layer.flops - measured[layer.name]) / measured[layer.name])
    assert set(worst) == {"time_embed", "conv_in", "resnet", "transformer2d", "downsample", "upsample", "conv_out"}
    assert max(worst.values()) < 0.05, dict(worst)
    ten = [l for l in zoo.layers if l.kind == "transformer2d" and l.attrs["num_layers"] == 10]
    assert [l.name for l in ten] == ["down2_attn0", "down2_attn1", "mid_attn", "up0_attn0", "up0_attn1", "up0_attn2"]


def test_pulse_plans_sdxl_unet_on_four_devices(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "sdxl-unet", "--pp", "4", "--out", str(out)]) == 0
    assert "sdxl-unet" in out.read_text()
    assert "sdxl-unet" in capsys.readouterr().out


# -- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,named", [
    ({"addition_embed_type": "text"}, "addition_embed_type"),
    ({"projection_class_embeddings_input_dim": 6 * PER_ID}, "projection_class_embeddings_input_dim"),
    ({"transformer_layers_per_block": [[1, 2], [2, 2]]}, "transformer_layers_per_block"),
    ({"reverse_transformer_layers_per_block": [[2, 2, 2], [1, 1, 1]]}, "reverse_transformer_layers_per_block"),
])
def test_unsupported_sdxl_variants_name_the_field(change: dict, named: str) -> None:
    with pytest.raises(UnsupportedDiffusersModel, match=named) as err:
        spec_from_config({"_class_name": "UNet2DConditionModel", **SDXL_TINY, **change}, context_len=8)


def test_native_layers_and_mindspore_refuse_sdxl(tmp_path: Path) -> None:
    from pulse_mindspore.traits import check_model
    from pulse_torch.layers import build_layer

    spec = get_spec("sdxl-unet", resolution=256)
    with pytest.raises(NotImplementedError, match="text_embeds"):
        build_layer(spec.layers[0])
    with pytest.raises(PulseError, match="mindspore does not train SDXL"):
        check_model("sdxl-unet")
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **SDXL_TINY}))
    with pytest.raises(PulseError, match="addition_embed_type 'text_time'"):
        check_model(f"diffusers:{tmp_path}")


def _sdxl_pipeline_folder(root: Path) -> Path:
    """The layout of a saved StableDiffusionXLPipeline (configs only: the refusal reads no weights)."""
    index = {"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "scheduler": ["diffusers", "EulerDiscreteScheduler"]}
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps(index))
    for part in ("unet", "vae", "text_encoder", "text_encoder_2", "scheduler"):
        (root / part).mkdir()
        (root / part / "config.json").write_text(json.dumps({}))
    for part in ("tokenizer", "tokenizer_2"):
        (root / part).mkdir()
        (root / part / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    (root / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **SDXL_TINY}))
    return root


def test_an_sdxl_pipeline_folder_plans_its_unet(tmp_path: Path, capsys) -> None:
    from pulse.data.pipeline_folder import read_pipeline
    from pulse.data.pipeline_text import SDXL_RECIPE, recipe_for

    folder = _sdxl_pipeline_folder(tmp_path / "sdxl")
    assert recipe_for(read_pipeline(folder, need_encoders=True)) is SDXL_RECIPE
    assert main(["train", "--pipeline", str(folder), "--plan-only", "--pp", "2", "--out-dir",
                 str(tmp_path / "run")]) == 0
    assert f"model: diffusers:{folder.resolve() / 'unet'}" in (tmp_path / "run" / "plan.yaml").read_text()
    # Its UNet alone is a model PULSE plans.
    assert main(["plan", "--diffusers-config", str(folder / "unet"), "--pp", "2", "--hardware", "cpu-local"]) == 0
