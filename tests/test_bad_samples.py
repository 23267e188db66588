"""``--bad-samples stop|skip``: a truncated image or a metadata line that is not JSON.

::

    images/  img000.png ... img004.png (img001.png truncated), metadata.jsonl (line 5, img004.png's: not JSON)
    stop (default)  pulse train / pulse cache-latents refuse in one line naming img001.png and
                    metadata.jsonl:5, before any rank starts or anything is written
    skip            both left out, each named once; run.yaml lists their keys (every rank leaves out
                    the same ones, decoding nothing again); log.json lists and counts them (2)

The screening itself is framework-free and checked without torch; the runs need the tiny pipeline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline_helpers import torch_stack

from pulse.data import captioned_images
from pulse.data.captioned_images import ImageDataError, screen_images

BAD_LINE = "{'file_name': 'img004.png'"  # single quotes: not JSON


def captioned_folder(folder: Path, count: int = 5) -> Path:
    """``count`` captioned 20 px PNGs listed in metadata.jsonl (a tiny pipeline's 16 px crop fits)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    rows = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
        rows.append(json.dumps({"file_name": f"img{i:03d}.png", "text": "a red cat"}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def damaged_folder(folder: Path) -> Path:
    """Five images, img001.png cut in half, and img004.png's metadata line (the 5th) not JSON."""
    captioned_folder(folder)
    png = (folder / "img001.png").read_bytes()
    (folder / "img001.png").write_bytes(png[:len(png) // 2])
    lines = (folder / "metadata.jsonl").read_text().splitlines()
    (folder / "metadata.jsonl").write_text("\n".join([*lines[:4], BAD_LINE]) + "\n")
    return folder


def test_stop_names_every_bad_sample_in_one_line(tmp_path: Path) -> None:
    images = damaged_folder(tmp_path / "images")
    with pytest.raises(ImageDataError) as caught:
        screen_images(images, "stop")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{images / 'metadata.jsonl'}:5: not a JSON line"), line
    assert f"1 more bad sample ({images / 'img001.png'})" in line and "--bad-samples skip" in line


def test_skip_leaves_them_out_and_a_screened_folder_is_not_decoded_again(tmp_path: Path, monkeypatch) -> None:
    images = damaged_folder(tmp_path / "images")
    screened = screen_images(images, "skip")
    assert [b.key for b in screened.skipped] == ["metadata.jsonl:5", "img001.png"]
    assert "cannot read the image (OSError" in screened.skipped[1].reason
    assert [i.path.name for i in screened.items] == ["img000.png", "img002.png", "img003.png"]

    def no_decoding(items):
        raise AssertionError("a rank decoded a folder `pulse train` screened already")
    monkeypatch.setattr(captioned_images, "undecodable", no_decoding)
    again = screen_images(images, "skip", [b.key for b in screened.skipped])  # what every rank does
    assert again.items == screened.items


def test_a_truncated_jpeg_that_verify_passes_is_found_by_decoding(tmp_path: Path) -> None:
    from PIL import Image

    images = captioned_folder(tmp_path / "images", 2)
    Image.new("RGB", (64, 64), "red").save(images / "img001.jpg")
    data = (images / "img001.jpg").read_bytes()
    (images / "img001.jpg").write_bytes(data[:len(data) * 2 // 3])
    (images / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": n, "text": "a cat"})
                                                     for n in ("img000.png", "img001.jpg")) + "\n")
    assert [b.key for b in screen_images(images, "skip").skipped] == ["img001.jpg"]


def test_captions_beside_images_skip_an_uncaptioned_one(tmp_path: Path) -> None:
    images = captioned_folder(tmp_path / "images", 3)
    (images / "metadata.jsonl").unlink()
    for name in ("img000", "img002"):
        (images / f"{name}.txt").write_text("a dog\n")
    screened = screen_images(images, "skip")
    assert [b.key for b in screened.skipped] == ["img001.png"] and len(screened.items) == 2
    with pytest.raises(ImageDataError, match=r"img001\.png: no caption: write it to img001\.txt"):
        screen_images(images, "stop")


# -- the commands -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    from pipeline_helpers import pipeline_fixture

    return pipeline_fixture(tmp_path_factory)


@torch_stack
def test_pulse_train_stop_refuses_before_launch_and_skip_trains_counting_two(pipeline: Path, tmp_path: Path,
                                                                            capfd) -> None:
    from pulse.cli.main import main as pulse_main

    images = damaged_folder(tmp_path / "images")
    flags = ["train", "--pipeline", str(pipeline), "--images", str(images), "--pp", "2", "--microbatch-size", "1",
             "--schedule", "gpipe", "--steps", "2"]
    assert pulse_main([*flags, "--plan-only", "--out-dir", str(tmp_path / "stopped")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metadata.jsonl:5: not a JSON line" in err[0] and "img001.png" in err[0], err
    assert not (tmp_path / "stopped").exists()  # refused before anything was written

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *flags, "--bad-samples", "skip", "--out-dir",
                           str(run)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    named = [line for line in done.stderr.splitlines() if "--bad-samples skip: leaving out" in line]
    assert len(named) == 2 and "metadata.jsonl:5" in named[0] and "img001.png" in named[1], done.stderr[-2000:]
    log = json.loads((run / "log.json").read_text())
    assert log["summary"]["skipped_samples"] == 2 and len(log["steps"]) == 2
    assert log["run"]["skipped_samples"] == ["metadata.jsonl:5", "img001.png"]
    assert "3 images" in log["run"]["data"]  # every rank trained on the same three


@torch_stack
def test_cache_latents_skips_or_stops(pipeline: Path, tmp_path: Path, capfd) -> None:
    from pulse_torch.cache_latents import main as cache_main

    images = damaged_folder(tmp_path / "images")
    base = ["--pipeline", str(pipeline), "--images", str(images)]
    assert cache_main([*base, "--out", str(tmp_path / "stopped")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metadata.jsonl:5" in err[0] and "img001.png" in err[0], err
    assert not (tmp_path / "stopped").exists()
    assert cache_main([*base, "--out", str(tmp_path / "cache"), "--bad-samples", "skip"]) == 0
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["images"]["count"] == 3 and [s["sample"] for s in manifest["skipped"]] == ["metadata.jsonl:5",
                                                                                              "img001.png"]
    assert capfd.readouterr().out.count("cache-latents: skipped ") == 2  # each named once
