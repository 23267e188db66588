"""``pulse train --pipeline DIR --images DIR``: on-the-fly encoding, caption dropout, TensorBoard, samples, export.

* on-the-fly encoding and the cache of the same images and seed give bit-identical arrays and batches
  (the cache encodes each image alone by default, as training does);
* a batch is lazy: reading the text never loads the VAE, an epsilon target needs no latents;
* caption dropout replaces exactly the seeded rows with the empty prompt's embedding;
* one real run (pp 2, 2 steps, about 15 s): TensorBoard scalars equal log.json's, sample images are
  written from the checkpoint, and the exported pipeline holds the run's EMA weights and loads;
* bad combinations are one line and exit code 2, before anything runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

from pipeline_helpers import RESOLUTION, image_folder, pipeline_fixture  # noqa: E402
from pulse.cli.main import main as pulse_main  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.shards import ShardLatents  # noqa: E402
from pulse.data.sources import SyntheticLatents  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.train.sampler import Sampler, seeded  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse_torch.checkpoint import merge_weights  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
SEED = 3


@pytest.fixture(scope="module")
def sources(pipeline: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("onthefly")
    images = image_folder(root / "images", 5)
    assert cache_main(["--pipeline", str(pipeline), "--images", str(images), "--out", str(root / "cache"),
                       "--random-flip", "--seed", str(SEED), "--shard-size", "2"]) == 0
    spec = load_model(PREFIX + str(pipeline / "unet"))
    live = ImageSource(str(pipeline), str(images), spec, SEED, random_flip=True)
    return live, ShardLatents(root / "cache", spec, PREFIX + str(pipeline / "unet"))


def feed(source, dropout: float = 0.0) -> DiffusionFeed:
    return DiffusionFeed(source, Sampler(source.num_samples, 2, 2, 1, SEED), noise_schedule("scaled_linear"), SEED,
                         "v_prediction", dropout)


def test_on_the_fly_encoding_equals_the_cache_bit_for_bit(sources) -> None:
    live, cached = sources
    index = np.arange(live.num_samples)
    assert np.array_equal(live.latents(index), cached.latents(index))
    assert np.array_equal(live.conditions(index)["context"], cached.conditions(index)["context"])
    assert np.array_equal(live.empty_conditions()["context"], cached.empty_conditions()["context"])
    for step in range(3):  # whole microbatches, caption dropout included, over more than an epoch
        for mb in range(2):
            a, b = feed(live, 0.5).batch(step, 0, mb), feed(cached, 0.5).batch(step, 0, mb)
            assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_batch_encodes_only_what_a_rank_reads(pipeline: Path, tmp_path: Path) -> None:
    spec = load_model(PREFIX + str(pipeline / "unet"))
    live = ImageSource(str(pipeline), str(image_folder(tmp_path / "img", 2)), spec)
    epsilon = DiffusionFeed(live, Sampler(2, 1, 2, 1, 0), noise_schedule("linear"), 0, "epsilon")
    batch = epsilon.batch(0, 0, 0)
    batch["target"], batch["timesteps"]
    assert "_encoder" not in vars(live)  # the loss rank of an epsilon model encodes nothing
    batch["context"]
    assert "vae" not in vars(live.encoder) and list(live.encoder.text_encoders) == [0]
    batch["h"]
    assert "vae" in vars(live.encoder) and batch.made() == ["context", "h", "target", "timesteps"]


class _Captioned:
    """Conditions 1..n per sample, the empty prompt 0: which rows were dropped is plain to see."""
    name, num_samples, sample_shape, condition_names = "counted", 16, (1, 2, 2), ("context",)

    def latents(self, index):
        return np.zeros((len(index), 1, 2, 2), np.float32)

    def conditions(self, index):
        return {"context": (index + 1).astype(np.float32)[:, None, None] * np.ones((1, 3, 2), np.float32)}

    def has_empty_prompt(self):
        return True

    def empty_conditions(self):
        return {"context": np.zeros((1, 3, 2), np.float32)}


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_caption_dropout_swaps_in_the_empty_prompt_for_the_seeded_rows(p: float) -> None:
    source = _Captioned()
    sampler = Sampler(16, 8, 1, 1, 0)
    batch = DiffusionFeed(source, sampler, noise_schedule("linear"), 7, "epsilon", p).batch(4, 0, 0)
    index = sampler.indices(4, 0, 0)
    dropped = seeded(7, "caption-dropout", 4, 0, 0).random(8) < p
    want = np.where(dropped, 0.0, index + 1.0)
    assert np.array_equal(batch["context"][:, 0, 0], want)
    assert dropped.sum() == 0 if p == 0 else dropped.sum() == 8 if p == 1 else 0 < dropped.sum() < 8


def test_caption_dropout_needs_an_empty_prompt(pipeline: Path) -> None:
    spec = load_model("tiny-unet")
    with pytest.raises(PulseError, match="empty prompt"):
        DiffusionFeed(SyntheticLatents(spec, 8), Sampler(8, 1, 1, 1, 0), noise_schedule("linear"), 0, "epsilon", 0.1)


@pytest.mark.parametrize("extra, says", [
    (["--images", "IMAGES"], "--images needs --pipeline"),
    (["--pipeline", "PIPE", "--images", "IMAGES", "--data", "IMAGES"], "not both"),
    (["--pipeline", "NOVAE", "--images", "IMAGES"], "no vae/"),
    (["--pipeline", "PIPE", "--images", "NOWHERE"], "--images: no folder"),
    (["--model", "tiny-unet", "--export", "OUT"], "--export needs --pipeline"),
    (["--pipeline", "PIPE", "--images", "IMAGES", "--export", "IMAGES"], "exists: choose a new folder"),
])
def test_bad_fine_tuning_flags_are_one_line(pipeline: Path, tmp_path: Path, capfd, extra, says) -> None:
    novae = tmp_path / "novae"
    shutil.copytree(pipeline, novae)
    shutil.rmtree(novae / "vae")
    names = {"PIPE": str(pipeline), "NOVAE": str(novae), "IMAGES": str(image_folder(tmp_path / "img", 1)),
             "NOWHERE": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}
    code = pulse_main(["train", "--plan-only", "--out-dir", str(tmp_path / "run"), *[names.get(w, w) for w in extra]])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()  # nothing written


def test_fine_tune_from_images_reports_samples_and_exports(pipeline: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, out = tmp_path / "run", tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--pipeline", str(pipeline), "--images",
         str(image_folder(tmp_path / "img", 4)), "--pp", "2", "--microbatch-size", "1", "--schedule", "gpipe",
         "--steps", "2", "--ema", "0.9", "--caption-dropout", "0.5", "--report-to", "tensorboard",
         "--sample-every", "2", "--sample-steps", "2", "--sample-prompt", "a red cat", "--export", str(out),
         "--out-dir", str(run)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((run / "log.json").read_text())
    assert "on the fly: 4 images at 16 px" in log["run"]["data"]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in log["steps"]]
    from PIL import Image

    samples = sorted((run / "samples").glob("step-2-*.png"))
    assert len(samples) == 2 and all(Image.open(p).size == (RESOLUTION, RESOLUTION) for p in samples)
    exported = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    ema = merge_weights(run / "checkpoints" / "step-2", 2, ema=True)
    raw = merge_weights(run / "checkpoints" / "step-2", 2)
    params = dict(exported.unet.named_parameters())
    assert set(params) == set(ema) and all(torch.equal(params[n], ema[n]) for n in params)
    assert any(not torch.equal(ema[n], raw[n]) for n in ema)  # the EMA weights, not the raw ones
    image = exported("a red cat", num_inference_steps=2, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, RESOLUTION, RESOLUTION, 3) and np.isfinite(image).all()
