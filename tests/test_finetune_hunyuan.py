"""Fine-tuning a Hunyuan-DiT pipeline: two text encoders, masks and image sizes, cache, pp 2, export (about 20 s).

A tiny ``HunyuanDiTPipeline`` built offline (``pipeline_helpers.tiny_hunyuan_pipeline``: BERT + T5 encoder,
v-prediction): its cache holds the arrays the transformer reads (text_clip[_mask], text_t5[_mask],
image_meta_size, style), equal to the pipeline's own ``encode_prompt`` and bit-identical to on-the-fly
encoding; `pulse train --pipeline --data --pp 2 --export` gives a folder ``DiffusionPipeline`` loads, whose
transformer holds the checkpoint's weights and samples an image.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import HUNYUAN_RESOLUTION, image_folder, tiny_hunyuan_pipeline  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.shards import ShardLatents  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse_torch.checkpoint import merge_weights  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
INPUTS = ["text_clip", "text_clip_mask", "text_t5", "text_t5_mask", "image_meta_size", "style"]


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    root = tmp_path_factory.mktemp("hunyuan")
    pipe = tiny_hunyuan_pipeline(root / "pipe")
    images = image_folder(root / "images", 4, size=70)
    assert cache_main(["--pipeline", str(root / "pipe"), "--images", str(images), "--out", str(root / "cache")]) == 0
    return root, pipe


def test_the_cache_holds_what_the_pipeline_encodes_and_equals_on_the_fly(hunyuan) -> None:
    root, pipe = hunyuan
    model = PREFIX + str(root / "pipe" / "transformer")
    spec = load_model(model)
    cached = ShardLatents(root / "cache", spec, model)
    live = ImageSource(str(root / "pipe"), str(root / "images"), spec)
    index = np.arange(4)
    got = cached.conditions(index)
    assert sorted(got) == sorted(INPUTS)
    pipe.text_encoder.eval(), pipe.text_encoder_2.eval()  # as built they train: dropout on
    with torch.no_grad():  # the pipeline's own encode_prompt: CLIP 77 tokens, T5 256, masks passed
        for i, caption in enumerate(json.loads(line)["text"] for line in
                                    (root / "images" / "metadata.jsonl").read_text().splitlines()):
            for which, name in ((0, "text_clip"), (1, "text_t5")):
                embeds, _, mask, _ = pipe.encode_prompt(caption, device="cpu", dtype=torch.float32,
                                                        do_classifier_free_guidance=False, text_encoder_index=which)
                assert np.array_equal(got[name][i], embeds[0].numpy()) and np.array_equal(got[f"{name}_mask"][i],
                                                                                         mask[0].numpy())
    h, w = 70, 74  # image_folder's images: size x (size + 4); shorter side to 64 px, then center-cropped
    assert got["image_meta_size"][0].tolist() == [h, w, 64, 64, 0, (round(w * 64 / h) - 64) // 2]
    live_got = live.conditions(index)
    assert all(np.array_equal(live_got[n], got[n]) and live_got[n].dtype == got[n].dtype for n in INPUTS)
    assert np.array_equal(live.latents(index), cached.latents(index))
    feeds = [DiffusionFeed(s, Sampler(4, 2, 2, 1, 0), noise_schedule("scaled_linear"), 0, "v_prediction", 0.5)
             for s in (live, cached)]
    a, b = (f.batch(1, 0, 1) for f in feeds)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_fine_tune_hunyuan_from_the_cache_and_export(hunyuan, tmp_path: Path) -> None:
    root, _ = hunyuan
    run, out = tmp_path / "run", tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--pipeline", str(root / "pipe"), "--data",
         str(root / "cache"), "--pp", "2", "--microbatch-size", "1", "--schedule", "gpipe", "--steps", "2",
         "--caption-dropout", "0.5", "--export", str(out), "--out-dir", str(run)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "log.json").read_text())["run"]["prediction_type"] == "v_prediction"
    exported = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    trained = merge_weights(run / "checkpoints" / "step-2", 2)
    params = dict(exported.transformer.named_parameters())
    assert set(params) == set(trained) and all(torch.equal(params[n], trained[n]) for n in params)
    image = exported("a red cat", num_inference_steps=2, height=HUNYUAN_RESOLUTION, width=HUNYUAN_RESOLUTION,
                     use_resolution_binning=False, output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, HUNYUAN_RESOLUTION, HUNYUAN_RESOLUTION, 3) and np.isfinite(image).all()
