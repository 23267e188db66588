"""Where ``--images``' captioned images come from: one reader per format, one listing for all.

::

    --images WHAT [--dataset-format auto|imagefolder|hf|kohya|webdataset]
      imagefolder  DIR/metadata.jsonl, or DIR/a.png + a.txt        pulse.data.captioned_images.read_listing
      hf           a `datasets` save_to_disk folder, parquet / csv / json(l) file(s), a hub-style folder
                   (--image-column, --caption-column)             pulse.data.hf_datasets
      kohya        DIR/N_name/ subfolders, N repeats per epoch     pulse.data.kohya_folders
                   (--caption-extension)
      webdataset   "shards/{000000..000009}.tar", a .tar, or a folder of .tar   pulse.data.webdataset_shards
        │ read_image_set
        ▼
    Listing([Captioned], [BadSample])   every sample keyed within its set (Captioned.key), in the
                                        set's own fixed order: the feed's sample indices

``auto`` reads what ``--images`` points at (``detect_format``). Every rank reads the same listing,
so the data order (``pulse.data.feed``: a function of seed, step and sample count) and
``--bad-samples skip`` (by key) are the same everywhere, a resumed run's too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulse.data.captioned_images import IMAGE_SUFFIXES, METADATA, ImageDataError, Listing, read_listing
from pulse.train.run_config import DATASET_FORMATS  # noqa: F401 - the flag's choices, here with their readers
HF_FILE_SUFFIXES = (".parquet", ".csv", ".json", ".jsonl", ".arrow")
HF_SAVED = ("state.json", "dataset_dict.json", "dataset_info.json")  # what save_to_disk writes
KOHYA_SUBFOLDER = re.compile(r"^\d+_")  # sd-scripts: "<repeats>_<class tokens>"


@dataclass(frozen=True)
class ImageSet:
    """``--images`` and how to read it (the flags as diffusers' and sd-scripts' scripts name them)."""

    images: str
    format: str = "auto"
    image_column: str = "image"  # diffusers train_text_to_image.py --image_column
    caption_column: str = "text"  # its --caption_column
    caption_extension: str = ".caption"  # sd-scripts --caption_extension


def as_image_set(images: str | Path | ImageSet) -> ImageSet:
    return images if isinstance(images, ImageSet) else ImageSet(str(images))


def image_set_of(config: Any) -> ImageSet | None:
    """The image set a ``RunConfig`` (or a parsed ``pulse cache-latents`` namespace) trains on; None: no --images."""
    if getattr(config, "images", None) is None:
        return None
    given = {name: getattr(config, name, None) for name in ("dataset_format", "image_column", "caption_column",
                                                            "caption_extension")}
    defaults = ImageSet(str(config.images))  # a flag not given (None) keeps its default
    return ImageSet(str(config.images), given["dataset_format"] or defaults.format,
                    given["image_column"] or defaults.image_column,
                    given["caption_column"] or defaults.caption_column,
                    given["caption_extension"] or defaults.caption_extension)


def detect_format(images: str) -> str:
    """The format ``--images`` holds, from its name and what is there (one line when it is nothing)."""
    path = Path(images).expanduser()
    if "{" in images or path.suffix == ".tar":
        return "webdataset"
    if path.is_file() and path.suffix.lower() in HF_FILE_SUFFIXES:
        return "hf"
    if not path.is_dir():
        raise ImageDataError(f"--images: no folder or file '{images}' (captioned images: an ImageFolder, a "
                             "datasets folder or file, kohya N_name subfolders, or WebDataset .tar shards)")
    names = {p.name for p in path.iterdir()}
    if METADATA in names:
        return "imagefolder"
    # parquet beside it or in a hub layout's data/ (not a walk of a whole image tree)
    if names & set(HF_SAVED) or any(path.glob("*.parquet")) or any(path.glob("data/**/*.parquet")):
        return "hf"
    if any(n.endswith(".tar") for n in names):
        return "webdataset"
    if any(KOHYA_SUBFOLDER.match(p.name) and p.is_dir() for p in path.iterdir()):
        return "kohya"
    if any(Path(n).suffix.lower() in IMAGE_SUFFIXES for n in names):
        return "imagefolder"
    if any(Path(n).suffix.lower() in HF_FILE_SUFFIXES for n in names):
        return "hf"
    raise ImageDataError(f"--images {images}: no images, datasets files, N_name subfolders or .tar shards in it")


def resolved_format(image_set: ImageSet) -> str:
    if image_set.format not in DATASET_FORMATS:
        raise ImageDataError(f"--dataset-format must be one of {', '.join(DATASET_FORMATS)}, got {image_set.format!r}")
    return detect_format(image_set.images) if image_set.format == "auto" else image_set.format


def read_image_set(images: str | Path | ImageSet) -> Listing:
    """Every captioned sample of the set and every one that cannot train (undecoded: the screening
    decodes); a set that cannot be read at all is one line."""
    image_set = as_image_set(images)
    kind = resolved_format(image_set)
    if kind == "imagefolder":
        return read_listing(image_set.images)
    if kind == "hf":
        from pulse.data.hf_datasets import read_hf_dataset

        return read_hf_dataset(image_set.images, image_set.image_column, image_set.caption_column)
    if kind == "kohya":
        from pulse.data.kohya_folders import read_kohya_folders

        return read_kohya_folders(image_set.images, image_set.caption_extension)
    from pulse.data.webdataset_shards import read_shards

    return read_shards(image_set.images, image_set.caption_column)


def check_image_set(image_set: ImageSet) -> None:
    """Before launch: ``--images`` names something a reader takes (no image is read; one line if not):
    its format, and for shards every file the pattern names."""
    if resolved_format(image_set) == "webdataset":
        from pulse.data.webdataset_shards import shard_paths

        shard_paths(image_set.images)
