"""``--images`` in the formats users already have, each read by its own library and listed as the same
captioned images as the equivalent ImageFolder (``pulse.data.image_sets``).

::

    ImageFolder  images/img000.png ... + metadata.jsonl            the reference
    hf           Dataset.save_to_disk, parquet, csv / jsonl with paths, a hub-style data/ folder, datasets'
                 own imagefolder (--dataset-format hf)
    kohya        3_sks dog/ ..., 1_style/ ...: repeats as sd-scripts counts them
    webdataset   TarWriter shards: the same samples webdataset's own WebDataset streams; exact resume
    refused      a missing column, an empty folder, a bad brace pattern: one line (exit 2 from the CLI)
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline_helpers import torch_stack

from pulse.data.captioned_images import ImageDataError, read_listing, screen_images
from pulse.data.image_sets import ImageSet, check_image_set, detect_format, read_image_set
from pulse.train.sampler import Sampler

datasets = pytest.importorskip("datasets")  # the `datasets` extra (installed by scripts/setup.sh)
wds = pytest.importorskip("webdataset")
Image = pytest.importorskip("PIL.Image")

CAPTIONS = ["a red square", "a blue cat", "a photo of the green dog", "a small red cat"]


def image_folder(folder: Path, count: int = 4, size: int = 8) -> Path:
    """The reference: ``count`` random PNGs listed in metadata.jsonl."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    rows = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (size, size + 2, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
        rows.append(json.dumps({"file_name": f"img{i:03d}.png", "text": CAPTIONS[i % len(CAPTIONS)]}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def pixels(item) -> np.ndarray:
    with Image.open(item.image) as image:
        return np.asarray(image.convert("RGB"))


def same_as_folder(listing, folder: Path) -> None:
    reference = read_listing(folder).items
    assert [i.caption for i in listing.items] == [i.caption for i in reference] and not listing.bad
    for item, ref in zip(listing.items, reference):
        assert np.array_equal(pixels(item), pixels(ref))


# -- Hugging Face datasets ---------------------------------------------------------------------------
def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]


def pil_dataset(folder: Path):
    """A ``datasets.Dataset`` of PIL images (its Image feature) and captions, as a user builds one."""
    images = [Image.open(folder / r["file_name"]) for r in rows(folder)]
    return datasets.Dataset.from_dict({"image": images, "text": [r["text"] for r in rows(folder)]},
                                      features=datasets.Features({"image": datasets.Image(),
                                                                  "text": datasets.Value("string")}))


def test_a_save_to_disk_folder_lists_the_folders_images_and_captions(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images")
    pil_dataset(folder).save_to_disk(str(tmp_path / "saved"))
    assert detect_format(str(tmp_path / "saved")) == "hf"
    listing = read_image_set(tmp_path / "saved")
    same_as_folder(listing, folder)
    assert [i.key for i in listing.items] == ["row 0", "row 1", "row 2", "row 3"]
    datasets.DatasetDict({"train": pil_dataset(folder)}).save_to_disk(str(tmp_path / "dict"))  # its train split
    same_as_folder(read_image_set(tmp_path / "dict"), folder)


def test_parquet_csv_jsonl_and_a_hub_folder(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images")
    pil_dataset(folder).to_parquet(str(tmp_path / "train.parquet"))  # the images' bytes inside
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    pil_dataset(folder).to_parquet(str(hub / "train-00000-of-00001.parquet"))
    paths = [{"file": f"images/{r['file_name']}", "caption": r["text"]} for r in rows(folder)]  # relative paths
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(r) for r in paths) + "\n")
    (tmp_path / "list.csv").write_text("file,caption\n" + "".join(f"{r['file']},{r['caption']}\n" for r in paths))
    for images, columns in ((tmp_path / "train.parquet", {}), (tmp_path / "hub", {}),
                            (tmp_path / "list.jsonl", {"image_column": "file", "caption_column": "caption"}),
                            (tmp_path / "list.csv", {"image_column": "file", "caption_column": "caption"})):
        assert detect_format(str(images)) == "hf"
        same_as_folder(read_image_set(ImageSet(str(images), **columns)), folder)
    # the ImageFolder itself, read by datasets' own imagefolder builder
    same_as_folder(read_image_set(ImageSet(str(folder), "hf")), folder)


def test_a_missing_column_is_one_line_naming_the_columns_there_are(tmp_path: Path) -> None:
    pil_dataset(image_folder(tmp_path / "images")).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ImageDataError) as caught:
        read_image_set(ImageSet(str(tmp_path / "saved"), caption_column="prompt"))
    line = str(caught.value)
    assert "\n" not in line and "--caption-column 'prompt'" in line and "(its columns: image, text)" in line


def test_raw_bytes_rows_and_the_bad_ones_skipped_by_key(tmp_path: Path) -> None:
    """A column of raw image bytes; a row without a caption and a row whose bytes are cut short are
    bad samples ("row N"), named with the dataset, left out under --bad-samples skip."""
    folder = image_folder(tmp_path / "images", 4)
    data = [(folder / r["file_name"]).read_bytes() for r in rows(folder)]
    data[2] = data[2][:len(data[2]) // 2]
    captions = [r["text"] for r in rows(folder)]
    captions[1] = ""
    datasets.Dataset.from_dict({"png": data, "prompt": captions}).save_to_disk(str(tmp_path / "saved"))
    saved = ImageSet(str(tmp_path / "saved"), image_column="png", caption_column="prompt")
    screened = screen_images(saved, "skip")
    assert [b.key for b in screened.skipped] == ["row 1", "row 2"]
    assert screened.skipped[1].where == f"{tmp_path / 'saved'} row 2"
    assert [pixels(i).tolist() for i in screened.items] == [pixels(r).tolist() for r in
                                                           (read_listing(folder).items[k] for k in (0, 3))]
    with pytest.raises(ImageDataError, match=r"saved row 1: no caption in column 'prompt'; 1 more bad sample"):
        screen_images(saved, "stop")


# -- kohya sd-scripts folders -------------------------------------------------------------------------
def kohya_folder(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for sub, names in (("3_sks dog", ("a", "b")), ("1_style", ("c",)), ("no_repeats", ("d",)), ("0_none", ("e",))):
        (root / sub).mkdir(parents=True)
        for name in names:
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / sub / f"{name}.png")
    (root / "3_sks dog" / "a.caption").write_text("sks dog on grass\nsecond line unused\n")
    (root / "3_sks dog" / "b.txt").write_text("a .txt caption\n")  # not the extension asked for: class tokens
    (root / "1_style" / "c.caption").write_text("a painting\n")
    return root


def test_kohya_folders_repeat_each_image_as_sd_scripts_counts_them(tmp_path: Path) -> None:
    root = kohya_folder(tmp_path / "train")
    assert detect_format(str(root)) == "kohya"
    listing = read_image_set(root)  # default --caption-extension .caption
    # sd-scripts: num_train_images = sum(repeats x images) over "N_name" folders with N >= 1; others ignored
    assert len(listing.items) == 3 * 2 + 1 * 1 and not listing.bad
    assert [(i.key, i.caption) for i in listing.items] == [("1_style/c.png", "a painting")] + \
        [("3_sks dog/a.png", "sks dog on grass")] * 3 + [("3_sks dog/b.png", "sks dog")] * 3
    with_txt = read_image_set(ImageSet(str(root), caption_extension="txt"))  # "txt" means ".txt", as sd-scripts
    assert [i.caption for i in with_txt.items if i.key.endswith("b.png")] == ["a .txt caption"] * 3
    (root / "1_style" / "c.caption").write_text("")  # sd-scripts stops at an empty caption file: a bad sample
    screened = screen_images(root, "skip")
    assert [b.key for b in screened.skipped] == ["1_style/c.png"] and len(screened.items) == 6


# -- WebDataset shards --------------------------------------------------------------------------------
def write_shards(folder: Path, images: Path, per_shard: int = 3) -> list[str]:
    """Shards written by webdataset's own TarWriter: png + txt, the last sample json only."""
    folder.mkdir(parents=True)
    items = read_listing(images).items
    names = []
    for start in range(0, len(items), per_shard):
        name = folder / f"{len(names):06d}.tar"
        with wds.TarWriter(str(name)) as sink:
            for item in items[start:start + per_shard]:
                sample = {"__key__": f"s/{item.path.stem}", "png": item.path.read_bytes()}
                if item is items[-1]:
                    sample["json"] = json.dumps({"caption": item.caption}).encode()
                else:
                    sample["txt"] = item.caption.encode()
                sink.write(sample)
        names.append(str(name))
    return names


def test_shards_list_the_samples_webdataset_streams(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images", 7)
    shards = write_shards(tmp_path / "shards", folder)
    pattern = str(tmp_path / "shards" / "{000000..000002}.tar")
    assert detect_format(pattern) == detect_format(str(tmp_path / "shards")) == "webdataset"
    listing = read_image_set(pattern)
    same_as_folder(listing, folder)
    assert read_image_set(tmp_path / "shards").items == listing.items
    streamed = list(wds.WebDataset(shards, shardshuffle=False))  # webdataset's own reading of the shards
    assert [i.key for i in listing.items] == [f"{Path(s['__url__']).name}:{s['__key__']}" for s in streamed]
    assert [i.image.read() for i in listing.items] == [s["png"] for s in streamed]


def test_a_damaged_shard_sample_is_skipped_by_its_key(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "images", 3)
    (folder / "img001.png").write_bytes((folder / "img001.png").read_bytes()[:40])  # cut short
    write_shards(tmp_path / "shards", folder)
    screened = screen_images(tmp_path / "shards", "skip")
    assert [b.key for b in screened.skipped] == ["000000.tar:s/img001"]
    assert [i.key for i in screened.items] == ["000000.tar:s/img000", "000000.tar:s/img002"]
    with pytest.raises(ImageDataError, match=r"shards 000000.tar:s/img001: cannot read the image"):
        screen_images(tmp_path / "shards", "stop")


def test_a_resumed_run_reads_the_samples_the_straight_run_reads(tmp_path: Path) -> None:
    """Steps 3..8 of a straight run, and of a run resumed at step 3 (a fresh listing and sampler, as a
    restarted rank makes): the same sample keys, over two epochs."""
    image_folder(tmp_path / "images", 7)
    pattern = str(tmp_path / "shards" / "{000000..000002}.tar")
    write_shards(tmp_path / "shards", tmp_path / "images")

    def keys(steps: range, listing) -> list[str]:
        sampler = Sampler(len(listing.items), 2, 2, 1, seed=5)
        return [listing.items[i].key for s in steps for mb in range(2) for i in sampler.indices(s, 0, mb)]

    straight = keys(range(0, 9), read_image_set(pattern))
    resumed = keys(range(3, 9), read_image_set(pattern))
    assert straight[3 * 4:] == resumed and len(set(straight)) == 7  # every sample, epochs over


def test_bad_patterns_and_empty_folders_are_one_line(tmp_path: Path) -> None:
    image_folder(tmp_path / "images", 4)
    write_shards(tmp_path / "shards", tmp_path / "images")
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "shards" / "{000000..000001.tar"): "not a shard pattern webdataset expands",
             str(tmp_path / "shards" / "{000000..}.tar"): "is not a brace range webdataset expands",
             str(tmp_path / "shards" / "{000000..000005}.tar"): "no shard file",
             str(tmp_path / "empty"): "no images, datasets files, N_name subfolders or .tar shards"}
    for images, message in cases.items():
        with pytest.raises(ImageDataError) as caught:
            check_image_set(ImageSet(images))
            read_image_set(images)
        assert message in str(caught.value) and "\n" not in str(caught.value), (images, caught.value)
    with pytest.raises(ImageDataError, match="no kohya subfolders"):
        read_image_set(ImageSet(str(tmp_path / "empty"), "kohya"))


# -- end to end: `pulse cache-latents` from a save_to_disk folder -------------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    from pipeline_helpers import pipeline_fixture

    return pipeline_fixture(tmp_path_factory)


@torch_stack
def test_cache_latents_from_a_saved_dataset_equals_the_image_folders_cache(pipeline: Path, tmp_path: Path,
                                                                          capfd) -> None:
    """The same images and captions as a save_to_disk folder and as an ImageFolder: bit for bit the same
    latents and text encodings (the shards' checksums), flips included; a missing column: exit 2, one line."""
    from pipeline_helpers import image_folder as tiny_images

    from pulse.cli.main import main as pulse_main
    from pulse_torch.cache_latents import main as cache_main

    folder = tiny_images(tmp_path / "images", 3)
    pil_dataset(folder).save_to_disk(str(tmp_path / "saved"))
    base = ["--pipeline", str(pipeline), "--random-flip", "--seed", "3"]
    assert cache_main([*base, "--images", str(folder), "--out", str(tmp_path / "from-folder")]) == 0
    assert cache_main([*base, "--images", str(tmp_path / "saved"), "--out", str(tmp_path / "from-saved")]) == 0
    made = {name: json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("from-folder", "from-saved")}
    sums = {name: [s["sha256"] for s in manifest["shards"]] for name, manifest in made.items()}
    assert sums["from-saved"] == sums["from-folder"] and sums["from-saved"][0]["latents"]
    assert [f[1] for f in made["from-saved"]["files"]] == [f[1] for f in made["from-folder"]["files"]]
    assert [f[0] for f in made["from-saved"]["files"]] == ["row 0", "row 1", "row 2"]
    capfd.readouterr()
    refused = tmp_path / "refused"
    assert pulse_main(["cache-latents", *base, "--images", str(tmp_path / "saved"), "--caption-column", "prompt",
                       "--out", str(refused)]) == 2
    # (a library's import-time notice about optional "kernels" is not the command's line)
    err = [line for line in capfd.readouterr().err.strip().splitlines() if "kernels" not in line]
    assert len(err) == 1 and "--caption-column 'prompt'" in err[0] and "its columns: image, text" in err[0], err
    assert not refused.exists()


@torch_stack
def test_pulse_train_streams_webdataset_shards_named_by_a_brace_pattern(pipeline: Path, tmp_path: Path) -> None:
    """`pulse train` on shards: the pattern checked before launch, every rank reading the samples' bytes
    from the tars, the format recorded in run.yaml; a bad pattern is refused before anything is written."""
    import os
    import subprocess
    import sys

    from pipeline_helpers import image_folder as tiny_images

    from pulse.cli.main import main as pulse_main

    write_shards(tmp_path / "shards", tiny_images(tmp_path / "images", 3), per_shard=2)
    flags = ["train", "--pipeline", str(pipeline), "--pp", "2", "--microbatch-size", "1", "--schedule", "gpipe",
             "--steps", "2", "--caption-column", "caption"]
    assert pulse_main([*flags, "--images", str(tmp_path / "shards" / "{000000..000009}.tar"), "--plan-only",
                       "--out-dir", str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *flags, "--images",
                           str(tmp_path / "shards" / "{000000..000001}.tar"), "--out-dir", str(run)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((run / "log.json").read_text())
    assert len(log["steps"]) == 2 and "3 images" in log["run"]["data"], log["run"]["data"]
    assert "caption_column: caption" in (run / "run.yaml").read_text()
