"""`pulse cache-latents --buckets`: shards per bucket holding the pipeline's own VAE latents of each image
resized and cropped into its bucket; training reads the buckets back and draws each step from one."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from PIL import Image  # noqa: E402

from pipeline_helpers import RESOLUTION, pipeline_fixture  # noqa: E402
from pulse.data.buckets import BucketSettings, bucket_resolutions, fit_image  # noqa: E402
from pulse.data.feed import sampler_for  # noqa: E402
from pulse.data.sources import load_source  # noqa: E402
from pulse.train.bucket_sampler import BucketSampler  # noqa: E402
from pulse.zoo.diffusers_config import spec_from_path  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse_torch.pipeline.bucket_images import load_into_bucket  # noqa: E402
from pulse_torch.pipeline.images import list_images  # noqa: E402

pipeline = pytest.fixture(scope="session")(pipeline_fixture)
SIZES = [(40, 12), (12, 40), (20, 20), (30, 11), (22, 19), (10, 33), (41, 13)]  # (width, height)
# the tiny pipeline trains at 16 px (VAE factor 2): buckets of 8..32 px sides in steps of 8 at a 16x16 area
FLAGS = ["--buckets", "--resolution", str(RESOLUTION), "--min-bucket-reso", "8", "--max-bucket-reso", "32",
         "--bucket-reso-steps", "8"]
SETTINGS = BucketSettings(RESOLUTION, 8, 32, 8)


def images(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i, (w, h) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        rows.append(json.dumps({"file_name": f"img{i}.png", "text": f"a photo {i}"}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def test_a_bucketed_cache_holds_each_image_in_its_bucket(pipeline: Path, tmp_path: Path) -> None:
    folder, out = images(tmp_path / "img"), tmp_path / "cache"
    assert cache_main(["--pipeline", str(pipeline), "--images", str(folder), "--out", str(out),
                       "--shard-size", "2", "--batch-size", "2", *FLAGS]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    fits = [fit_image(size, SETTINGS) for size in SIZES]
    assert manifest["buckets"]["sizes"] == [list(s) for s in sorted({f.bucket for f in fits})]
    assert all(tuple(s) in bucket_resolutions(SETTINGS) for s in manifest["buckets"]["sizes"])
    assert all(len(shard["members"]) <= 2 for shard in manifest["shards"])

    spec = spec_from_path(pipeline / "unet")
    source = load_source(str(out), spec, 0, f"diffusers:{pipeline / 'unet'}")
    assert source.num_samples == len(SIZES)
    assert f"in {len(manifest['buckets']['sizes'])} buckets" in source.name  # the run's identity: its bucketing
    vae = diffusers.AutoencoderKL.from_pretrained(pipeline / "vae", local_files_only=True)
    items = list_images(folder)
    for i, fit in enumerate(fits):  # the VAE's own latents of the image in its bucket, in file order
        pixels = torch.from_numpy(load_into_bucket(items[i], fit)[None])
        with torch.no_grad():
            want = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
        index = np.array([i])
        assert source.shape_of(index) == (4, fit.bucket[1] // 2, fit.bucket[0] // 2)
        np.testing.assert_allclose(source.latents(index), want.numpy(), rtol=1e-5, atol=1e-6)
    sampler = sampler_for(source, 1, 2, 1, seed=0)
    assert isinstance(sampler, BucketSampler)
    for step in range(sampler.batches_per_epoch):
        batch = np.concatenate([sampler.indices(step, 0, m) for m in range(2)])
        assert len({fits[i].bucket for i in batch}) == 1  # one bucket a step
        assert source.latents(batch).shape[2:] == source.shape_of(batch)[1:]


def test_bucket_flags_without_buckets_or_that_make_no_buckets_are_one_line(pipeline, tmp_path, capfd) -> None:
    folder = images(tmp_path / "img")
    base = ["--pipeline", str(pipeline), "--images", str(folder), "--out", str(tmp_path / "c")]
    assert cache_main([*base, "--min-bucket-reso", "64"]) == 2
    assert "--min-bucket-reso applies to aspect-ratio buckets: add --buckets" in capfd.readouterr().err
    assert cache_main([*base, *FLAGS[:3], "--min-bucket-reso", "24", "--max-bucket-reso", "16"]) == 2
    err = capfd.readouterr().err
    assert "--min-bucket-reso 24 is above --max-bucket-reso 16" in err and len(err.strip().splitlines()) == 1
    assert cache_main([*base, *FLAGS[:3], "--bucket-reso-steps", "12"]) == 2
    assert "multiple of the VAE's 8" in capfd.readouterr().err
    assert not (tmp_path / "c").exists()


def test_buckets_a_backbone_cannot_take_are_refused(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pulse.errors import PulseError
    from pulse.data.buckets import check_backbone

    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({"block_out_channels": [320, 640, 1280, 1280]}))
    sd = SimpleNamespace(root=tmp_path, backbone=unet, backbone_name="unet")
    check_backbone(sd, BucketSettings(512, step=64), 8)  # SD: 8 x 2^3 = 64 px
    with pytest.raises(PulseError, match="multiple of 64 pixels"):
        check_backbone(sd, BucketSettings(512, step=32), 8)
    dit = SimpleNamespace(root=tmp_path, backbone=unet, backbone_name="transformer")
    with pytest.raises(PulseError, match="train UNet pipelines"):
        check_backbone(dit, BucketSettings(512), 8)


def test_on_the_fly_buckets_equal_the_cache(pipeline: Path, tmp_path: Path) -> None:
    """`pulse train --images --buckets` encodes what `pulse cache-latents --buckets` stored: the same buckets,
    crops (random ones seeded per image alike), latents and conditions, sample by sample."""
    from pulse.train.run_config import RunConfig
    from pulse_torch.pipeline.onthefly import ImageSource

    folder, out = images(tmp_path / "img"), tmp_path / "cache"
    assert cache_main(["--pipeline", str(pipeline), "--images", str(folder), "--out", str(out), "--seed", "3",
                       "--random-crop", "--random-flip", *FLAGS]) == 0
    spec = spec_from_path(pipeline / "unet")
    cached = load_source(str(out), spec, 0, f"diffusers:{pipeline / 'unet'}")
    config = RunConfig(buckets=True, min_bucket_reso=8, max_bucket_reso=32, bucket_reso_steps=8, random_crop=True)
    live = ImageSource(str(pipeline), str(folder), spec, seed=3, random_flip=True, buckets=config)
    np.testing.assert_array_equal(live.buckets, cached.buckets)
    for k in np.unique(cached.buckets):
        index = np.flatnonzero(cached.buckets == k)
        assert live.shape_of(index) == cached.shape_of(index)
        np.testing.assert_allclose(live.latents(index), cached.latents(index), rtol=1e-5, atol=1e-6)
        got, want = live.conditions(index), cached.conditions(index)
        assert got.keys() == want.keys()
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert "buckets" in live.name


def test_pulse_train_refuses_bucket_flags_it_cannot_use_before_launch(pipeline: Path, tmp_path: Path, capsys) -> None:
    from pulse.cli.main import main as pulse_main

    folder = images(tmp_path / "img")
    base = ["train", "--pipeline", str(pipeline), "--pp", "2", "--out-dir", str(tmp_path / "run")]
    cases = [([*base, "--images", str(folder), "--min-bucket-reso", "8"], "--min-bucket-reso applies to aspect-ratio"),
             ([*base, "--data", str(tmp_path), "--buckets"], "--buckets applies to --images"),
             ([*base, "--images", str(folder), "--buckets"], "resolution 16 does not fit between --min-bucket-reso 256"),
             ([*base, "--images", str(folder), "--buckets", "--min-bucket-reso", "8", "--max-bucket-reso", "32",
               "--bucket-reso-steps", "12"], "multiple of the VAE's 8"),
             ([*base, "--images", str(folder), "--buckets", "--encoders", "bubbles"], "--buckets with --encoders")]
    for argv, says in cases:
        assert pulse_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "run").exists()


def test_sdxl_time_ids_in_a_bucketed_cache_are_each_images_size_crop_and_bucket(tmp_path_factory, tmp_path) -> None:
    """diffusers' train_text_to_image_sdxl.py: add_time_ids = original (h, w) + crop top-left (y, x) + target
    (h, w); with buckets the target is the image's bucket and the crop where its resize was cut, on the fly
    as in the cache."""
    from sdxl_helpers import sdxl_fixture

    from pulse.train.run_config import RunConfig
    from pulse_torch.pipeline.bucket_images import image_fits
    from pulse_torch.pipeline.onthefly import ImageSource

    sdxl = sdxl_fixture(tmp_path_factory)
    folder, out = images(tmp_path / "img"), tmp_path / "cache"
    assert cache_main(["--pipeline", str(sdxl), "--images", str(folder), "--out", str(out), "--random-crop",
                       *FLAGS]) == 0
    spec = spec_from_path(sdxl / "unet")
    cached = load_source(str(out), spec, 0, f"diffusers:{sdxl / 'unet'}")
    fits = image_fits(list_images(folder), SETTINGS, 0, True)
    for i, fit in enumerate(fits):
        (w, h), (bw, bh) = SIZES[i], fit.bucket
        top, left = fit.crop[1], fit.crop[0]
        assert 0 <= left <= fit.resized[0] - bw and 0 <= top <= fit.resized[1] - bh
        assert cached.conditions(np.array([i]))["time_ids"][0].tolist() == [h, w, top, left, bh, bw]
    config = RunConfig(buckets=True, min_bucket_reso=8, max_bucket_reso=32, bucket_reso_steps=8, random_crop=True)
    live = ImageSource(str(sdxl), str(folder), spec, buckets=config)
    index = np.flatnonzero(cached.buckets == cached.buckets[0])
    np.testing.assert_array_equal(live.conditions(index)["time_ids"], cached.conditions(index)["time_ids"])
