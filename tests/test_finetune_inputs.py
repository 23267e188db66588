"""Fine-tuning inputs: pipeline folders, captioned images, the encoding cache, .npz keys, diffusers resume.

Tiny models, mostly in process (the whole file: about 25 s on a shared core):

* a pipeline folder lacking its backbone, VAE or text encoder is one line naming what is missing;
* captions from metadata.jsonl or .txt files; a missing caption or a corrupt image names the file;
  images are resized and center-cropped to the resolution, a flip mirrors them;
* the cache equals a direct encoding with the pipeline's VAE (mean x scaling_factor) and text encoder;
  it resumes keeping finished shards, refuses another run's folder, and training refuses it for
  another resolution, text length or backbone config;
* an .npz with ``encoder_hidden_states`` (not ``context``) or a context of the wrong length is an error;
* a diffusers model's checkpoint (parameters under the model's own names) loads back: the resume fix.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import RESOLUTION, TableComm, image_folder, pipeline_fixture  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.zoo.diffusers_config import spec_from_path  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse.data.sources import FileLatents, load_source  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse_torch.pipeline.images import list_images, load_image  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)


def one_error(capfd) -> str:
    """The one stderr line, read at the file descriptor: a library's logger writing there counts too."""
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- the pipeline folder ---------------------------------------------------------------------------
@pytest.mark.parametrize("remove, named", [("unet", "no backbone"), ("vae", "no vae/"),
                                           ("text_encoder", "no text_encoder/"), ("model_index.json", "no model_index")])
def test_a_pipeline_without_a_needed_part_is_one_line(pipeline: Path, tmp_path: Path, remove: str, named: str,
                                                      capfd) -> None:
    broken = tmp_path / "pipe"
    shutil.copytree(pipeline, broken)
    target = broken / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    image_folder(tmp_path / "img", 2)
    code = cache_main(["--pipeline", str(broken), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "c")])
    assert code == 2 and named in one_error(capfd)
    assert not (tmp_path / "c").exists()  # refused before anything was written


def test_a_part_that_fails_to_load_is_one_line_from_the_command(pipeline: Path, tmp_path: Path) -> None:
    """In a child process: diffusers' own logger (bound to the real stderr) must not add its line."""
    import subprocess
    import sys

    broken = tmp_path / "pipe"
    shutil.copytree(pipeline, broken)
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    done = subprocess.run([sys.executable, "-m", "pulse_torch.cache_latents", "--pipeline", str(broken), "--images",
                           str(image_folder(tmp_path / "img", 2)), "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "vae: cannot load AutoencoderKL" in err[0], err


def test_the_folder_reader_finds_every_part(pipeline: Path) -> None:
    folder = read_pipeline(pipeline, need_encoders=True)
    assert folder.backbone_name == "unet" and folder.vae.name == "vae"
    assert [p.name for p in folder.text_encoders] == ["text_encoder"]
    assert set(folder.identity()) == {"backbone", "vae", "text_encoder", "tokenizer"}


# -- captioned images ------------------------------------------------------------------------------
def test_captions_from_metadata_or_text_files(tmp_path: Path) -> None:
    jsonl = list_images(image_folder(tmp_path / "a", 3))
    txt = list_images(image_folder(tmp_path / "b", 3, layout="txt"))
    assert [(i.path.name, i.caption) for i in jsonl] == [(i.path.name, i.caption) for i in txt]
    assert [i.caption for i in txt] == ["a red square", "a blue cat", "a photo of the green dog"]


def test_a_missing_caption_or_corrupt_image_names_the_file(pipeline: Path, tmp_path: Path, capfd) -> None:
    folder = image_folder(tmp_path / "txt", 3, layout="txt")
    (folder / "img001.txt").unlink()
    with pytest.raises(PulseError, match=r"img001\.png: no caption: write it to img001\.txt"):
        list_images(folder)
    bad = image_folder(tmp_path / "bad", 3)
    (bad / "img002.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    code = cache_main(["--pipeline", str(pipeline), "--images", str(bad), "--out", str(tmp_path / "c")])
    assert code == 2 and "img002.png: cannot read the image" in one_error(capfd)
    assert not (tmp_path / "c").exists()
    meta = image_folder(tmp_path / "meta", 2)
    (meta / "metadata.jsonl").write_text('{"file_name": "img000.png"}\n')
    with pytest.raises(PulseError, match=r"metadata\.jsonl:1: 'img000.png' has no caption"):
        list_images(meta)
    (meta / "metadata.jsonl").write_bytes(b'{"file_name": "img000.png", "text": "\xff"}\n')
    with pytest.raises(PulseError, match=r"metadata\.jsonl: not UTF-8 text"):
        list_images(meta)


def test_images_are_resized_center_cropped_and_flipped(tmp_path: Path) -> None:
    from PIL import Image

    wide = np.zeros((8, 24, 3), np.uint8)
    wide[:, 8:16] = 255  # a white middle third: exactly what the center crop keeps
    wide[:, 15] = 0      # one dark column right of the middle: the flip moves it left
    Image.fromarray(wide).save(tmp_path / "w.png")
    x = load_image(tmp_path / "w.png", 8)
    assert x.shape == (3, 8, 8) and x.dtype == np.float32
    assert x[:, :, 0].min() == 1.0 and x[:, :, 7].max() == -1.0
    np.testing.assert_array_equal(load_image(tmp_path / "w.png", 8, flip=True), x[:, :, ::-1])


# -- the cache -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache(pipeline: Path, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cache")
    images = image_folder(root / "images", 5)
    out = root / "cache"
    assert cache_main(["--pipeline", str(pipeline), "--images", str(images), "--out", str(out),
                       "--shard-size", "2", "--batch-size", "2"]) == 0
    return images, out


def test_cached_latents_and_embeddings_are_the_pipelines_own(pipeline: Path, cache) -> None:
    images, out = cache
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["resolution"] == RESOLUTION and manifest["images"]["count"] == 5
    assert manifest["latent_shape"] == [4, 8, 8] and manifest["arrays"]["encoder_hidden_states"] == [77, 32]
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(pipeline, local_files_only=True)
    items = list_images(images)
    pixels = torch.from_numpy(np.stack([load_image(i.path, RESOLUTION) for i in items]))
    with torch.no_grad():
        want = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
        ids = pipe.tokenizer([i.caption for i in items], padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids
        text = pipe.text_encoder(ids)[0]
    spec = spec_from_path(pipeline / "unet")
    source = load_source(str(out), spec, 0, f"diffusers:{pipeline / 'unet'}")
    index = np.arange(5)
    assert source.num_samples == 5
    np.testing.assert_allclose(source.latents(index), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(source.conditions(index)["context"], text.numpy(), rtol=1e-5, atol=1e-6)


def test_replicas_read_disjoint_images_with_their_own_captions(pipeline: Path, cache) -> None:
    """The Sampler splits one epoch over two data-parallel replicas; every latent keeps its caption's row."""
    from pulse.train.sampler import Sampler

    _, out = cache
    source = load_source(str(out), spec_from_path(pipeline / "unet"), 0)
    every = np.arange(5)
    latents, context = source.latents(every), source.conditions(every)["context"]
    sampler = Sampler(5, 1, 2, 2, seed=3)  # microbatches of 1, 2 per replica, dp 2: 4 of 5 images per step
    seen = [int(sampler.indices(0, r, m)[0]) for r in range(2) for m in range(2)]
    assert len(set(seen)) == 4  # no image twice within a step: the replicas' shares are disjoint
    index = np.array(seen)
    assert np.array_equal(source.latents(index), latents[index])
    assert np.array_equal(source.conditions(index)["context"], context[index])
    assert not np.array_equal(context[0], context[1])  # different captions: the pairing is observable


def test_an_interrupted_cache_resumes_keeping_finished_shards(pipeline: Path, cache, tmp_path: Path,
                                                               capfd) -> None:
    images, done = cache
    out = tmp_path / "cache"
    shutil.copytree(done, out)
    shutil.rmtree(out / "shard-00002")  # interrupted before the last shard: the manifest says incomplete
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    (out / ".shard-00002.tmp99").mkdir()  # a crash's half-written shard
    spec = spec_from_path(pipeline / "unet")
    with pytest.raises(PulseError, match="the cache is incomplete"):
        load_source(str(out), spec, 0)
    kept = (out / "shard-00000" / "latents.npy").stat().st_mtime_ns
    args = ["--pipeline", str(pipeline), "--images", str(images), "--out", str(out), "--shard-size", "2"]
    assert cache_main(args) == 0
    assert "2 shard(s) kept" in capfd.readouterr().out
    assert (out / "shard-00000" / "latents.npy").stat().st_mtime_ns == kept
    assert not (out / ".shard-00002.tmp99").exists()
    for name in ("latents", "encoder_hidden_states", "attention_mask"):
        np.testing.assert_array_equal(np.load(out / "shard-00002" / f"{name}.npy"),
                                      np.load(done / "shard-00002" / f"{name}.npy"))
    # other settings into the same folder: refused, nothing touched
    assert cache_main([*args[:-1], "3"]) == 2
    assert "holds a cache made with other shard_size" in one_error(capfd)


def test_a_flipped_byte_in_a_shard_is_caught_and_a_cache_without_checksums_still_loads(pipeline: Path, cache,
                                                                                       tmp_path: Path, capfd) -> None:
    _, done = cache
    spec = spec_from_path(pipeline / "unet")
    manifest = json.loads((done / "manifest.json").read_text())
    assert all(set(s["sha256"]) == {"latents", "encoder_hidden_states", "attention_mask"} for s in manifest["shards"])
    out = tmp_path / "cache"
    shutil.copytree(done, out)
    shard = out / "shard-00001" / "latents.npy"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # one bit of one latent: a float that stays a float, only its value changes
    shard.write_bytes(bytes(data))
    with pytest.raises(PulseError) as info:
        load_source(str(out), spec, 0)
    message = str(info.value)
    assert "\n" not in message and "shard-00001/latents.npy" in message and "pulse cache-latents" in message
    assert f"remove {out / 'shard-00001'}" in message
    # a cache written before caches had checksums: it loads, and says once that it is not verified
    for entry in manifest["shards"]:
        del entry["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    capfd.readouterr()
    assert load_source(str(out), spec, 0).num_samples == 5
    assert load_source(str(out), spec, 0).num_samples == 5
    notes = capfd.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and "written before caches had checksums" in notes[0]


def test_training_refuses_a_cache_for_another_resolution_length_or_backbone(pipeline: Path, cache,
                                                                            tmp_path: Path) -> None:
    _, out = cache
    unet = pipeline / "unet"
    with pytest.raises(PulseError, match=r"latents \(4, 8, 8\), but model .* takes \(4, 16, 16\)"):
        load_source(str(out), spec_from_path(unet, resolution=128), 0)
    with pytest.raises(PulseError, match=r"plan with --model-option context_len=77"):
        load_source(str(out), spec_from_path(unet, context_len=8), 0)
    other = tmp_path / "unet"
    shutil.copytree(unet, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "attention_head_dim": 4}))
    with pytest.raises(PulseError, match="made for another pipeline"):
        load_source(str(out), spec_from_path(other), 0, f"diffusers:{other}")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["latent_shape"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PulseError, match=r"manifest.json: damaged \(KeyError"):
        load_source(str(damaged), spec_from_path(unet), 0)


# -- .npz files ------------------------------------------------------------------------------------
def test_npz_text_embeddings_under_another_name_or_length_are_errors(pipeline: Path, tmp_path: Path) -> None:
    spec = spec_from_path(pipeline / "unet")  # context: 77 tokens x 32
    latents = np.zeros((3, 4, 8, 8), np.float32)
    np.savez(tmp_path / "diffusers.npz", latents=latents, encoder_hidden_states=np.zeros((3, 77, 32), np.float32))
    with pytest.raises(PulseError, match=r"holds 'encoder_hidden_states' \(3, 77, 32\) but no 'context'.*rename "
                                         r"'encoder_hidden_states' -> 'context'"):
        FileLatents(tmp_path / "diffusers.npz", spec)
    np.savez(tmp_path / "renamed.npz", latents=latents, text=np.zeros((3, 77, 32), np.float32))
    with pytest.raises(PulseError, match=r"rename 'text' -> 'context'"):  # any name, the context's shape
        FileLatents(tmp_path / "renamed.npz", spec)
    np.savez(tmp_path / "short.npz", latents=latents, context=np.zeros((3, 8, 32), np.float32))
    with pytest.raises(PulseError, match=r"'context' has shape \(3, 8, 32\), but model .* takes \(N, 77, 32\)"):
        FileLatents(tmp_path / "short.npz", spec)
    ids = np.zeros((3, 77))  # not an input, not shaped like one: ignored, and said so
    np.savez(tmp_path / "good.npz", latents=latents, context=np.ones((3, 77, 32), np.float32), ids=ids)
    good = FileLatents(tmp_path / "good.npz", spec)
    assert "synthetic" not in good.name and "ignored ids" in good.name
    assert good.conditions(np.array([1]))["context"].sum() == 77 * 32


# -- resume of a diffusers model ---------------------------------------------------------------------
def test_a_diffusers_checkpoint_loads_back_under_the_models_own_names(pipeline: Path, tmp_path: Path) -> None:
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_hardware
    from pulse.partition import partition
    from pulse.plan import Plan
    from pulse.train import checkpoints
    from pulse.runtime.wiring import Wiring
    from pulse_torch import checkpoint
    from pulse_torch.diffusers_adapter import load_diffusers

    def ranks(seed: int):
        torch.manual_seed(seed)
        adapter = load_diffusers(f"diffusers:{tmp_path / 'unet'}")
        spec, backend = adapter.spec, adapter.backend(lr=1e-3)
        costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
        placement = partition("sequential", spec, costs, 2)
        wiring = Wiring(spec, placement)
        plan = Plan(f"diffusers:{tmp_path / 'unet'}", "cpu-local", 2, 1, 1, 2, "sequential", placement)
        return plan, spec, [checkpoint.Shard(backend, [backend.build_chunk(spec, wiring.ios[c])
                                                       for c in placement.chunks_of(r)], r, 2, 0) for r in range(2)]

    diffusers.UNet2DConditionModel.from_config(  # config only: random weights drawn from torch's seed
        diffusers.UNet2DConditionModel.load_config(pipeline / "unet")).save_config(tmp_path / "unet")
    plan, spec, saved = ranks(seed=0)
    gen = torch.Generator().manual_seed(1)
    for shard in saved:  # one AdamW step on seeded gradients: weights and moments move
        for chunk in shard.chunks:
            for p in chunk.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            shard.backend.optimizer_step(chunk)
    comm, info = TableComm(), checkpoints.manifest_info(plan, spec, 0, checkpoints.data_position(1, 2, 4))
    for shard in sorted(saved, key=lambda s: -s.rank):
        where = checkpoint.save(tmp_path / "ckpt", 1, shard, comm, info, checkpoints.layers_by_rank(plan, spec))
    assert "conv_in.weight" in checkpoint.merge_weights(where, 1)  # the model's own names
    _, _, loaded = ranks(seed=5)  # other initial weights
    found = checkpoints.Found(1, where, checkpoints.check_step(where, 1))
    for shard in loaded:
        checkpoint.load(found, shard)
    want = {n: p for s in saved for n, p in s.parameters().items()}
    got = {n: p for s in loaded for n, p in s.parameters().items()}
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    moments = {n: st for s in loaded for n, st in checkpoint.optimizer_state(s).items()}
    assert torch.equal(moments["conv_in.weight"]["exp_avg"],
                       checkpoint.optimizer_state(saved[0])["conv_in.weight"]["exp_avg"])


def test_export_takes_only_a_diffusers_run_of_this_backbone(pipeline: Path, tmp_path: Path) -> None:
    from pulse_torch.export import build_parser, check_model

    folder = read_pipeline(pipeline)
    check_model({"identity": {"model": f"diffusers:{pipeline / 'unet'}"}}, tmp_path, folder)  # its own: taken
    with pytest.raises(PulseError, match="trained model 'tiny-unet', not a diffusers model"):
        check_model({"identity": {"model": "tiny-unet"}}, tmp_path, folder)
    other = tmp_path / "unet"
    shutil.copytree(pipeline / "unet", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "attention_head_dim": 4}))
    with pytest.raises(PulseError, match="whose config differs from"):
        check_model({"identity": {"model": f"diffusers:{other}"}}, tmp_path, folder)
    assert build_parser().allow_abbrev is False
