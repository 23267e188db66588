"""Fine-tuning an SDXL pipeline folder: two text encoders, pooled text, time ids; cache, on the fly, pp 2, export.

A tiny ``StableDiffusionXLPipeline`` built offline (``sdxl_helpers.tiny_sdxl_pipeline``; about 60 s in all):

* the cache holds prompt_embeds (both encoders' penultimate states, concatenated), text_embeds
  (text_encoder_2's pooled projection) and time_ids (original size, crop top-left, target size), each
  equal to the pipeline's own ``encode_prompt`` and ``_get_add_time_ids``, its manifest naming the model
  input each feeds; on-the-fly encoding is bit-identical, batches with caption dropout too (the empty
  prompt replaces the text, never the time ids);
* the pipelined forward on such a batch (every chunk over the fake network) is bit-equal to the
  diffusers UNet called with ``added_cond_kwargs`` from it;
* `pulse train --pipeline SDXL --data CACHE --pp 2 --export NEW` trains on two gloo processes and
  ``StableDiffusionXLPipeline.from_pretrained(NEW)`` loads the trained UNet and samples;
* encoders in the pipeline (--encoders before|bubbles --pp 2, two gloo processes): both text encoders as
  one encode task making context, text_embeds and time_ids; losses and weights equal on-the-fly encoding's;
* a refiner-style folder (text_encoder_2 only) is refused in one line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import image_folder  # noqa: E402
from sdxl_helpers import SDXL_INPUTS, SDXL_RESOLUTION, sdxl_fixture  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.data.pipeline_text import SDXL_RECIPE, pipeline_encoders, recipe_for  # noqa: E402
from pulse.data.shards import ShardLatents  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse_torch.checkpoint import merge_weights  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
sdxl = pytest.fixture(scope="session")(sdxl_fixture)
SEED = 3
TALL = (30, 18)  # (h, w) of one more image: its time ids differ from image_folder's 20 x 24 ones


@pytest.fixture(scope="module")
def sources(sdxl: Path, tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("sdxl")
    images = image_folder(root / "images", 4, size=20)
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (*TALL, 3), dtype=np.uint8)).save(images / "tall.png")
    with open(images / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "tall.png", "text": "a big green dog"}) + "\n")
    assert cache_main(["--pipeline", str(sdxl), "--images", str(images), "--out", str(root / "cache"),
                       "--random-flip", "--seed", str(SEED), "--shard-size", "2"]) == 0
    model = PREFIX + str(sdxl / "unet")
    spec = load_model(model)
    live = ImageSource(str(sdxl), str(images), spec, SEED, random_flip=True)
    return root, live, ShardLatents(root / "cache", spec, model)


def feed(source, dropout: float = 0.0) -> DiffusionFeed:
    return DiffusionFeed(source, Sampler(source.num_samples, 2, 2, 1, SEED), noise_schedule("scaled_linear"), SEED,
                         "epsilon", dropout)


def test_the_folder_is_read_as_sdxl(sdxl: Path) -> None:
    folder = read_pipeline(sdxl, need_encoders=True)
    assert [p.name for p in folder.text_encoders] == ["text_encoder", "text_encoder_2"]
    assert recipe_for(folder) is SDXL_RECIPE
    assert set(folder.identity()) == {"backbone", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}
    spec = load_model(PREFIX + str(sdxl / "unet"))
    assert [s.name for s in spec.shared_inputs if s.producer is None] == ["timesteps", *SDXL_INPUTS]


def test_the_cache_holds_what_the_pipeline_encodes(sdxl: Path, sources) -> None:
    root, _, cached = sources
    manifest = json.loads((root / "cache" / "manifest.json").read_text())
    assert manifest["arrays"] == {"latents": [4, 8, 8], "prompt_embeds": [77, 64], "text_embeds": [32],
                                  "time_ids": [6]}
    assert manifest["inputs"] == {"context": "prompt_embeds", "text_embeds": "text_embeds", "time_ids": "time_ids"}
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(sdxl, local_files_only=True)
    got = cached.conditions(np.arange(5))
    assert sorted(got) == sorted(SDXL_INPUTS)
    rows = [json.loads(line) for line in (root / "images" / "metadata.jsonl").read_text().splitlines()]
    for i, row in enumerate(sorted(rows, key=lambda r: r["file_name"])):  # the cache's order: by file name
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(row["text"], device="cpu", do_classifier_free_guidance=False)
        assert np.array_equal(got["context"][i], embeds[0].numpy())
        assert np.array_equal(got["text_embeds"][i], pooled[0].numpy())
    # original (h, w), the center crop's top-left after the shorter side went to 16 px, target (h, w)
    ids = [pipe._get_add_time_ids(original, crop, (16, 16), torch.float32, text_encoder_projection_dim=32)[0]
           for original, crop in (((20, 24), (0, 1)), (TALL, (5, 0)))]
    assert np.array_equal(got["time_ids"][0], ids[0].numpy()) and np.array_equal(got["time_ids"][4], ids[1].numpy())


def test_on_the_fly_encoding_equals_the_cache_bit_for_bit(sources) -> None:
    _, live, cached = sources
    index = np.arange(live.num_samples)
    assert np.array_equal(live.latents(index), cached.latents(index))
    a, b = live.conditions(index), cached.conditions(index)
    assert all(np.array_equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in SDXL_INPUTS)
    empty = live.empty_conditions()
    assert sorted(empty) == ["context", "text_embeds"]  # what caption dropout replaces: the text
    assert all(np.array_equal(empty[n], cached.empty_conditions()[n]) for n in empty)
    for step in range(3):  # whole microbatches, caption dropout included, over more than an epoch
        for mb in range(2):
            x, y = feed(live, 0.5).batch(step, 0, mb), feed(cached, 0.5).batch(step, 0, mb)
            assert set(x) == set(y) >= set(SDXL_INPUTS) and all(np.array_equal(x[k], y[k]) for k in x)
    dropped, kept = feed(cached, 1.0).batch(0, 0, 0), feed(cached).batch(0, 0, 0)
    assert np.array_equal(dropped["time_ids"], kept["time_ids"])
    assert np.array_equal(dropped["text_embeds"][0], empty["text_embeds"][0])


def test_the_pipelined_forward_on_a_cache_batch_is_diffusers_unet(sdxl: Path, sources) -> None:
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_hardware
    from pulse.partition import partition
    from pulse.schedule.generators import make_schedule
    from pulse.schedule.lower import lower
    from pulse.testing.local import local_run
    from pulse_torch.diffusers_adapter import load_diffusers
    from pulse_torch.diffusion import eps_loss

    _, _, cached = sources
    adapter = load_diffusers(PREFIX + str(sdxl / "unet"))
    spec = adapter.spec
    placement = partition("pulse", spec, AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1), 2, folds=1)
    errors = []

    def batches(mb: int) -> dict:
        return {k: torch.from_numpy(np.asarray(v)) for k, v in feed(cached).batch(0, 0, mb).items()}

    def loss_fn(outputs, batch):
        with torch.no_grad():
            reference = adapter.model(batch["h"], batch["timesteps"], encoder_hidden_states=batch["context"],
                                      added_cond_kwargs={"text_embeds": batch["text_embeds"],
                                                         "time_ids": batch["time_ids"]}).sample
        errors.append(float((outputs["h"] - reference).abs().max()))
        return eps_loss(outputs, batch)

    local_run(spec, placement, lower(make_schedule("greedy_v_1f1b", placement, 2), spec, placement),
              adapter.backend(), batches, loss_fn).step()
    assert errors == [0.0, 0.0]


def test_fine_tune_sdxl_from_the_cache_and_export(sdxl: Path, sources, tmp_path: Path) -> None:
    root, _, _ = sources
    run, out = tmp_path / "run", tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--pipeline", str(sdxl), "--data", str(root / "cache"),
         "--pp", "2", "--microbatch-size", "1", "--schedule", "gpipe", "--steps", "2", "--caption-dropout", "0.5",
         "--export", str(out), "--out-dir", str(run)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((run / "log.json").read_text())
    assert len(log["steps"]) == 2 and all(s["loss"] > 0 for s in log["steps"])
    exported = diffusers.StableDiffusionXLPipeline.from_pretrained(out, local_files_only=True)
    trained = merge_weights(run / "checkpoints" / "step-2", 2)
    params = dict(exported.unet.named_parameters())
    assert set(params) == set(trained) and all(torch.equal(params[n], trained[n]) for n in params)
    assert any(not torch.equal(p, params[n]) for n, p in diffusers.UNet2DConditionModel.from_pretrained(
        sdxl / "unet", local_files_only=True).named_parameters())  # two AdamW steps moved the weights
    image = exported("a red cat", num_inference_steps=2, height=SDXL_RESOLUTION, width=SDXL_RESOLUTION,
                     output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, SDXL_RESOLUTION, SDXL_RESOLUTION, 3) and np.isfinite(image).all()


def train_on_images(sdxl: Path, images: Path, run: Path, mode: str) -> Path:
    """Two steps of `pulse train --pipeline SDXL --images DIR --pp 2 --encoders MODE` on two gloo processes."""
    done = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--pipeline", str(sdxl), "--images", str(images),
         "--pp", "2", "--microbatch-size", "1", "--steps", "2", "--caption-dropout", "0.5", "--encoders", mode,
         "--save-final", "--out-dir", str(run)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def on_the_fly(sdxl: Path, sources, tmp_path_factory) -> Path:
    return train_on_images(sdxl, sources[0] / "images", tmp_path_factory.mktemp("on-the-fly") / "run", "cached")


def test_the_text_task_is_counted_from_the_folder(sdxl: Path) -> None:
    """One encode task for both text encoders: their parameters and text_encoder_2's projection, and
    an output of context + pooled text_embeds + time_ids."""
    text, vae = pipeline_encoders(read_pipeline(sdxl))
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(sdxl, local_files_only=True)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert text.params == count(pipe.text_encoder) + count(pipe.text_encoder_2)
    assert text.feeds == SDXL_INPUTS and vae.feeds == ("latent",)
    assert text.out_bytes == (77 * 64 + 32 + 6) * 2  # per sample, stated at fp16


@pytest.mark.parametrize("mode", ["bubbles", "before"])
def test_encoders_in_the_pipeline_train_as_encoding_on_the_fly(sdxl: Path, sources, on_the_fly: Path,
                                                               tmp_path: Path, mode: str) -> None:
    """--encoders before|bubbles: the text task's E actions (and the VAE's) in the plan, its output sent
    to the readers as one message; losses and trained weights equal the on-the-fly run's bit for bit."""
    run = train_on_images(sdxl, sources[0] / "images", tmp_path / "run", mode)
    plan = (run / "plan.yaml").read_text()
    assert f"mode: {mode}" in plan and "feeds: [context, text_embeds, time_ids]" in plan
    assert re.search(r"\b0E\d+\b", plan) and re.search(r"\b1E\d+\b", plan)  # both encoders' tasks
    losses = [[s["loss"] for s in json.loads((r / "log.json").read_text())["steps"]] for r in (run, on_the_fly)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    got, want = (merge_weights(r / "checkpoints" / "step-2", 2) for r in (run, on_the_fly))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_refiner_style_folder_is_refused_in_one_line(sdxl: Path, tmp_path: Path) -> None:
    refiner = tmp_path / "refiner"
    shutil.copytree(sdxl, refiner)
    index = json.loads((refiner / "model_index.json").read_text())
    (refiner / "model_index.json").write_text(json.dumps({**index, "text_encoder": [None, None],
                                                          "tokenizer": [None, None]}))
    with pytest.raises(PulseError, match="not the refiner") as err:
        recipe_for(read_pipeline(refiner))
    assert "\n" not in str(err.value)
