"""MindSpore fine-tunes a diffusers pipeline's UNet, in one process (the msrun run: test_mindspore_msrun.py).

The tiny offline pipeline of ``pipeline_helpers`` (UNet 32/64 channels, SD 1.x's 1x1-conv attention
projections, DDPM scaled-linear betas):

* MindSpore cells built from the plan's spec and loaded from ``unet/diffusion_pytorch_model.safetensors``
  by diffusers name compute diffusers' own forward (torch) on the same inputs: measured 1.0e-6 of the
  output's largest value in fp32, asserted below 1e-5 (MindSpore's CPU kernels sum in another order);
* a pp 2 pipeline (fake network; each chunk loads only its layers' tensors) of those cells trains one
  step on the pipeline scheduler's noise with a learning-rate schedule and EMA; the EMA weights exported into a pipeline folder load with
  ``DiffusionPipeline.from_pretrained`` bit for bit, the other parts unchanged;
* what MindSpore cannot train is one line: another model class, pickled weights, a file whose names
  differ from the cells', on-the-fly images, an export over an existing folder.

Skipped without MindSpore or diffusers.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_helpers import pipeline_fixture  # noqa: E402
from pulse_mindspore.traits import check_model, check_options  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.data.backbone_weights import WEIGHTS, WeightsError  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.data.scheduler_config import noise_settings  # noqa: E402
from pulse.data.sources import SyntheticLatents  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import StepSettings, optimizer_update  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX, spec_from_path  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402
from pulse_mindspore.diffusers_weights import check_trainable, weights_loader  # noqa: E402
from pulse_mindspore.diffusion import eps_loss  # noqa: E402
from pulse_mindspore.export import write_pipeline  # noqa: E402
from pulse_mindspore.model import build_model  # noqa: E402
from pulse_mindspore.train import ema_state  # noqa: E402
from pulse_mindspore.weights import state_dict  # noqa: E402

pipeline = pytest.fixture(scope="session")(pipeline_fixture)
PARITY_TOL = 1e-5  # of the output's largest value, fp32; measured 1.0e-6


def model_of(pipe: Path) -> str:
    return PREFIX + str(pipe / "unet")


def file_state(pipe: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(pipe / "unet" / WEIGHTS))


def test_cells_loaded_by_diffusers_names_compute_the_diffusers_forward(pipeline: Path) -> None:
    from diffusers import UNet2DConditionModel

    spec = spec_from_path(pipeline / "unet")
    assert check_trainable(spec, model_of(pipeline)).startswith("weights from")
    net = build_model(spec, seed=0)
    weights_loader(model_of(pipeline))(spec, net.layers)
    state = file_state(pipeline)
    assert {k: v.tobytes() for k, v in state_dict(spec, net.layers).items()} == \
        {k: v.tobytes() for k, v in state.items()}  # every tensor of the file, and only those
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    t = np.array([10, 700], dtype=np.int64)
    context = rng.standard_normal((2, 77, 32)).astype(np.float32)
    got = net.forward_reference({"h": x, "timesteps": t, "context": context}).asnumpy()
    unet = UNet2DConditionModel.from_pretrained(str(pipeline / "unet"), local_files_only=True)
    with torch.no_grad():
        want = unet(torch.from_numpy(x), torch.from_numpy(t), encoder_hidden_states=torch.from_numpy(context)).sample
    want = want.numpy()
    assert np.abs(got - want).max() <= PARITY_TOL * np.abs(want).max()


def test_a_pipelined_fine_tune_exports_ema_weights_diffusers_loads_bitwise(pipeline: Path, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    model = model_of(pipeline)
    spec = spec_from_path(pipeline / "unet").with_act_bytes(4)
    noise = noise_settings(model, None, None)
    assert noise.beta_schedule == "scaled_linear"  # the pipeline's scheduler, not DDPM's linear default
    source = SyntheticLatents(spec, num_samples=8)
    feed = DiffusionFeed(source, Sampler(8, 1, 1, 1, 0), noise.schedule(), 0, noise.prediction_type)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    placement = partition("sequential", spec, costs, 2)
    backend = MindSporeBackend(lr=1e-3, load_weights=weights_loader(model))
    run = local_run(spec, placement, lower(make_schedule("1f1b", placement, 1), spec, placement), backend,
                    lambda mb: feed.batch(0, 0, mb), eps_loss)
    chunks = [c for ex in run.executors for c in ex.chunks.values()]
    cells = {name: cell for c in chunks for name, cell in c.layers.items()}
    initial = state_dict(spec, cells)
    assert {k: v.tobytes() for k, v in initial.items()} == {k: v.tobytes() for k, v in file_state(pipeline).items()}
    # One step (MindSpore's PyNative CPU steps take seconds), as the EMA's 10th update (its warm-up's
    # decay min(0.9, 10 / 19)): the EMA is then a mix of w0 and w1, neither.
    run.step()
    backend.ema_steps = 9
    optimizer_update(backend, chunks, 0, StepSettings(lr=1e-3, lr_schedule="linear", total_steps=2, ema=0.9))
    ema = ema_state(spec, cells, backend.ema)
    trained = state_dict(spec, cells)
    assert sum(not np.array_equal(ema[k], initial[k]) for k in ema) > len(ema) // 2  # the weights moved
    assert any(not np.array_equal(ema[k], trained[k]) for k in ema)  # and the average is not the weights
    out = tmp_path / "exported"
    write_pipeline(read_pipeline(pipeline), ema, out)
    assert (out / "unet" / "config.json").read_bytes() == (pipeline / "unet" / "config.json").read_bytes()
    loaded = DiffusionPipeline.from_pretrained(str(out), local_files_only=True)
    unet = {k: v.numpy() for k, v in loaded.unet.state_dict().items()}
    assert unet.keys() == ema.keys() and all(np.array_equal(unet[k], ema[k]) for k in ema)
    original = DiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(loaded.vae.state_dict().values(), original.vae.state_dict().values()))
    with pytest.raises(PulseError, match="exists: choose a new folder"):
        write_pipeline(read_pipeline(pipeline), ema, out)
    with pytest.raises(PulseError, match="has shape"):
        write_pipeline(read_pipeline(pipeline), {**ema, "conv_in.bias": ema["conv_in.bias"][:-1]}, tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


def test_what_mindspore_cannot_train_is_one_line(pipeline: Path, tmp_path: Path) -> None:
    with pytest.raises(PulseError, match="on-the-fly encoding is PyTorch only: cache first with `pulse cache-latents`"):
        check_options(RunConfig(images=str(tmp_path), pipeline=str(pipeline)))
    with pytest.raises(PulseError, match="--sample-every 5 is not supported with --backend mindspore"):
        check_options(RunConfig(sample_every=5, pipeline=str(pipeline)))
    check_options(RunConfig(ema=0.9, save_final=True, export=str(tmp_path / "o"), pipeline=str(pipeline)))
    dit = tmp_path / "dit"
    dit.mkdir()
    (dit / "config.json").write_text(json.dumps({"_class_name": "HunyuanDiT2DModel"}))
    with pytest.raises(PulseError, match="UNet2DConditionModel backbones only, not HunyuanDiT2DModel"):
        check_model(PREFIX + str(dit))
    unet = tmp_path / "unet"
    unet.mkdir()
    shutil.copy(pipeline / "unet" / "config.json", unet / "config.json")
    (unet / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(WeightsError, match="PyTorch pickle.*safe_serialization=True"):
        check_model(PREFIX + str(unet))
    from safetensors.numpy import save_file

    (unet / "diffusion_pytorch_model.bin").unlink()
    state = file_state(pipeline)
    state["extra.weight"] = state.pop("conv_in.weight")
    save_file(state, str(unet / WEIGHTS))
    with pytest.raises(PulseError, match="1 parameter\\(s\\) missing, 1 unknown: the file lacks 'conv_in.weight'"):
        check_trainable(spec_from_path(unet), PREFIX + str(unet))


def test_the_torch_zoo_layer_runs_the_conv_projection_as_diffusers(pipeline: Path) -> None:
    """SD 1.x's 1x1-conv projections: the recipe is shared, so the torch zoo layer must match too."""
    from diffusers import UNet2DConditionModel
    from pulse_torch.layers import build_layer as build_torch_layer

    spec = spec_from_path(pipeline / "unet")
    layer = spec.layers[spec.index("down1_attn0")]
    assert layer.attrs["linear_projection"] is False
    unet = UNet2DConditionModel.from_pretrained(str(pipeline / "unet"), local_files_only=True)
    reference = unet.down_blocks[1].attentions[0]
    mine = build_torch_layer(layer)
    mine.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(0)
    h, context = torch.randn(2, 64, 4, 4, generator=g), torch.randn(2, 77, 32, generator=g)
    with torch.no_grad():
        got, _ = mine(h, {"context": context}, [])
        want = reference(h, encoder_hidden_states=context).sample
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
