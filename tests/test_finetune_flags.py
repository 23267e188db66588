"""The small fine-tuning settings a diffusers user expects, each checked against what diffusers computes.

::

    --snr-gamma        min-SNR weights == train_text_to_image.py's (compute_snr), epsilon and v;
                       the weighted loss and its gradient == F.mse_loss(reduction="none") + autograd
                       (PyTorch and MindSpore loss functions alike)
    --noise-offset     eps + offset * N(0, 1) per sample and channel, in x_t and the target; 0: no draw
    --weight-decay, --adam-beta1/2   reach run.yaml and both backends' AdamW
    --sample-prompt    repeats (action="append"); an old run.yaml's single text still loads
    text length        the UNet's context length from the pipeline's tokenizer, in planning and on the rank
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from pipeline_helpers import image_folder, pipeline_fixture  # noqa: E402

from pulse.cli.main import main as pulse_main  # noqa: E402
from pulse.data.feed import LOSS_WEIGHT, TARGET, DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.sources import SyntheticLatents  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.runtime.wiring import MAIN  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse.zoo.diffusers_config import spec_from_path  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)


# -- min-SNR weighting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_train_text_to_images(prediction_type: str) -> None:
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    t = np.array([0, 1, 10, 100, 400, 700, 999], dtype=np.int64)
    snr = compute_snr(scheduler, torch.from_numpy(t))
    if prediction_type == "v_prediction":  # the script's own lines
        snr = snr + 1
    gamma = 5.0
    theirs = torch.stack([snr, gamma * torch.ones_like(torch.from_numpy(t))], dim=1).min(dim=1)[0] / snr
    ours = noise_schedule("scaled_linear").min_snr_weights(t, gamma, prediction_type)
    assert ours.dtype == np.float32 and ours.shape == (7,)
    # diffusers' alphas_cumprod is a float32 cumprod (PULSE's, float64, is what x_t is noised with): 3e-5 apart
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-4)
    assert ours[0] < 0.01 and ours[-1] == 1.0  # clean timesteps weigh gamma / SNR, noisy ones (SNR < gamma) 1


def test_the_weighted_loss_and_its_gradient_are_diffusers() -> None:
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    w = torch.tensor([0.2, 1.0, 0.05])
    leaf = pred.clone().requires_grad_()
    loss = torch.nn.functional.mse_loss(leaf, target, reduction="none")
    want = (loss.mean(dim=[1, 2, 3]) * w).mean()  # train_text_to_image.py with --snr_gamma
    want.backward()
    got, grads = eps_loss({MAIN: pred}, {TARGET: target, LOSS_WEIGHT: w})
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(grads[MAIN], leaf.grad, rtol=1e-6, atol=1e-9)
    plain, _ = eps_loss({MAIN: pred}, {TARGET: target})
    assert float(plain) == pytest.approx(float(torch.nn.functional.mse_loss(pred, target)), rel=1e-6)

    ms = pytest.importorskip("mindspore")
    from pulse_mindspore.diffusion import eps_loss as ms_loss

    ms_got, ms_grads = ms_loss({MAIN: ms.Tensor(pred.numpy())}, {TARGET: target.numpy(), LOSS_WEIGHT: w.numpy()})
    assert ms_got == pytest.approx(float(want), rel=1e-6)
    np.testing.assert_allclose(ms_grads[MAIN].asnumpy(), leaf.grad.numpy(), rtol=1e-5, atol=1e-9)


def feed(noise_offset: float = 0.0, snr_gamma: float | None = None) -> DiffusionFeed:
    spec = get_spec("tiny-unet")
    return DiffusionFeed(SyntheticLatents(spec, num_samples=8), Sampler(8, 4, 2, 1, 0), noise_schedule("linear"), 0,
                         noise_offset=noise_offset, snr_gamma=snr_gamma)


def test_noise_offset_shifts_each_sample_and_channel_of_the_noise() -> None:
    plain, offset = feed().batch(1, 0, 1), feed(noise_offset=0.1).batch(1, 0, 1)
    assert LOSS_WEIGHT not in plain and LOSS_WEIGHT not in offset
    shift = offset[TARGET] - plain[TARGET]
    per_channel = shift[:, :, :1, :1]
    np.testing.assert_allclose(shift, np.broadcast_to(per_channel, shift.shape), atol=1e-6)  # constant over H, W
    assert shift.shape[:2] == (4, 4) and 0.01 < float(np.abs(per_channel).mean()) < 0.3
    assert np.array_equal(offset["timesteps"], plain["timesteps"])
    x0 = feed().source.latents(feed().sampler.indices(1, 0, 1))
    np.testing.assert_allclose(offset[MAIN], noise_schedule("linear").add_noise(x0, offset[TARGET], offset["timesteps"]),
                               atol=1e-6)  # x_t is noised with the offset noise, as the script's add_noise
    # no offset: no extra draw, the batches of runs without the flag are unchanged
    assert np.array_equal(feed(noise_offset=0.0).batch(1, 0, 1)[TARGET], plain[TARGET])


def test_snr_gamma_puts_per_sample_weights_in_the_batch() -> None:
    batch = feed(snr_gamma=5.0).batch(0, 0, 0)
    want = noise_schedule("linear").min_snr_weights(batch["timesteps"], 5.0, "epsilon")
    assert np.array_equal(batch[LOSS_WEIGHT], want) and want.shape == (4,)


# -- optimizer settings, prompts: flags -> run.yaml -> backends ---------------------------------------------
@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """`pulse train --plan-only` with every new flag: RUN/plan.yaml and RUN/run.yaml."""
    run = tmp_path_factory.mktemp("flags") / "run"
    assert pulse_main(["train", "--model", "tiny-unet", "--pp", "2", "--steps", "3", "--weight-decay", "0.01",
                       "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--snr-gamma", "5", "--noise-offset", "0.05",
                       "--ema", "0.99", "--ema-power", "0.75", "--ema-inv-gamma", "2",
                       "--sample-prompt", "a red cat", "--sample-prompt", "a blue dog", "--out-dir", str(run),
                       "--plan-only"]) == 0
    return run


def test_the_new_flags_reach_run_yaml_and_the_torch_adamw(planned: Path) -> None:
    from pulse.plan import load_plan
    from pulse.train.loop import StepSettings
    from pulse.runtime.wiring import Wiring
    from pulse.zoo.loading import load_model
    from pulse_torch.checkpoint import ensure_optimizer
    from pulse_torch.job import make_backend

    saved = yaml.safe_load((planned / "run.yaml").read_text())
    assert {k: saved[k] for k in ("weight_decay", "adam_beta1", "adam_beta2", "snr_gamma", "noise_offset",
                                  "ema", "ema_power", "ema_inv_gamma", "sample_prompt")} == {
        "weight_decay": 0.01, "adam_beta1": 0.8, "adam_beta2": 0.95, "snr_gamma": 5.0, "noise_offset": 0.05,
        "ema": 0.99, "ema_power": 0.75, "ema_inv_gamma": 2.0, "sample_prompt": ["a red cat", "a blue dog"]}
    config = RunConfig.load(planned / "run.yaml")
    plan, spec = load_plan(planned / "plan.yaml", load_model)
    backend = make_backend(config, "cpu", plan)
    chunk = backend.build_chunk(spec, Wiring(spec, plan.placement).ios[0])
    group = ensure_optimizer(backend, chunk).param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.95), 0.01)
    assert StepSettings.of(config).ema_at(3) == min(0.99, 1 - (1 + 2 / 2) ** -0.75)  # update 3: t = 2


def test_mindspore_workers_build_their_adamw_from_run_yaml(planned: Path, monkeypatch) -> None:
    pytest.importorskip("mindspore")
    from pulse.plan import load_plan
    from pulse.zoo.loading import load_model
    from pulse_mindspore import train as ms_train

    from pulse.runtime.protocols import CommunicatorDefaults

    class FirstWorker(CommunicatorDefaults):  # build_job's view of the communicator: worker 0, nothing to join
        rank = 0

        def register_group(self, ranks) -> None:
            pass

    monkeypatch.setattr(ms_train, "join_cluster", lambda timeout: None)
    monkeypatch.setattr(ms_train, "MindSporeCommunicator", lambda **kwargs: FirstWorker())
    plan, spec = load_plan(planned / "plan.yaml", load_model)
    job = ms_train.build_job(RunConfig.load(planned / "run.yaml"), plan, spec, SyntheticLatents(spec, num_samples=4))
    assert (job.backend.betas, job.backend.weight_decay) == ((0.8, 0.95), 0.01)
    assert job.settings.ema_power == 0.75 and job.settings.ema_inv_gamma == 2.0


def test_several_sample_prompts_and_an_old_single_one(tmp_path: Path) -> None:
    from pulse.args.run_args import rank_entry_parser, run_config_of

    args = rank_entry_parser("x", "torchrun").parse_args(["--plan", "p", "--sample-prompt", "a", "--sample-prompt",
                                                          "b c"])
    assert run_config_of(args).sample_prompt == ["a", "b c"]
    assert RunConfig().sample_prompt == ["a photo"]
    path = tmp_path / "run.yaml"
    RunConfig().save(path)
    old = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**old, "sample_prompt": "a red cat"}))  # written before prompts repeated
    assert RunConfig.load(path).sample_prompt == ["a red cat"]


def test_samples_are_written_for_every_prompt(pipeline: Path, tmp_path: Path, monkeypatch) -> None:
    from pulse_torch.pipeline import samples

    unet = diffusers.UNet2DConditionModel.from_pretrained(str(pipeline / "unet"), local_files_only=True)
    monkeypatch.setattr(samples, "trained_weights", lambda where, step, ema: dict(unet.named_parameters()))
    paths = samples.write_samples(str(pipeline), tmp_path / "step-3", 3, tmp_path, ["a red cat", "a blue dog"], 1, 0)
    assert [p.name for p in paths] == [f"step-3-{i}.png" for i in range(4)]
    from PIL import Image

    pixels = [np.asarray(Image.open(p)) for p in paths]
    assert not np.array_equal(pixels[0], pixels[2])  # the second prompt's images are its own


# -- the text length a pipeline's tokenizer pads to ------------------------------------------------------------
def pipeline_copy(pipeline: Path, where: Path, tokens: object, positions: int = 77) -> Path:
    """The tiny pipeline with its tokenizer padding to ``tokens`` and its text encoder holding ``positions``."""
    shutil.copytree(pipeline, where)
    config = where / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": tokens}))
    text = where / "text_encoder" / "config.json"
    text.write_text(json.dumps({**json.loads(text.read_text()), "max_position_embeddings": positions}))
    return where


def context_len(spec) -> int:
    lengths = {int(layer.attrs["context_len"]) for layer in spec.layers if "context_len" in layer.attrs}
    assert len(lengths) == 1
    return lengths.pop()


def test_the_unets_text_length_is_the_pipelines_tokenizers(pipeline: Path, tmp_path: Path) -> None:
    short = pipeline_copy(pipeline, tmp_path / "short", 16)
    assert context_len(spec_from_path(short / "unet")) == 16
    assert context_len(spec_from_path(short / "unet", context_len=12)) == 12  # the option overrides
    unset = pipeline_copy(pipeline, tmp_path / "unset", int(1e30), positions=24)  # a tokenizer with no limit
    assert context_len(spec_from_path(unset / "unet")) == 24  # the text encoder's positions
    alone = tmp_path / "alone" / "unet"
    shutil.copytree(pipeline / "unet", alone)
    assert context_len(spec_from_path(alone)) == 77  # no pipeline around it: CLIP's
    from pulse_torch.diffusers_adapter import load_diffusers

    adapter = load_diffusers(f"diffusers:{short / 'unet'}")  # what a rank builds agrees with the plan
    assert context_len(adapter.spec) == 16
    # on-the-fly encoding of such a pipeline was refused after launch ("plan with --model-option context_len=16")
    from pulse_torch.pipeline.onthefly import ImageSource

    source = ImageSource(str(short), str(image_folder(tmp_path / "img", 2)), spec_from_path(short / "unet"))
    assert source.num_samples == 2
