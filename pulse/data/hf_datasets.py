"""Captioned images from a Hugging Face ``datasets`` dataset on disk, read by ``datasets`` itself, offline.

::

    --images DIR    a save_to_disk folder (state.json / dataset_dict.json)       datasets.load_from_disk
                    a hub-style folder (data/train-*.parquet, csv, json, images)  datasets.load_dataset(DIR)
    --images FILE   .parquet, .csv, .json, .jsonl, .arrow            datasets.load_dataset(kind, data_files=FILE)
        │ the "train" split of a DatasetDict (or its only one)
        │ --image-column (default "image") and --caption-column (default "text"), as diffusers'
        │   train_text_to_image.py names them; a missing one: one line naming the columns there are
        ▼
    Listing: one Captioned per row, key "row N" (N from 0, the dataset's own order); the image is
             read when a rank needs it: an Image feature's bytes (stored undecoded), raw bytes, or a
             path (relative ones from the data file's folder)

Nothing is downloaded: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE default to 1 here (clusters have no
internet). ``datasets`` imports pyarrow and pandas: it is imported only when such a set is read.
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from pulse.data.captioned_images import BadSample, Captioned, ImageDataError, Listing
from pulse.data.image_sets import HF_FILE_SUFFIXES, HF_SAVED

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before datasets is first imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ImageDataError("--images: reading a datasets folder needs the 'datasets' package: "
                             "pip install 'pulse-diffusion[datasets]'") from None
    datasets.disable_progress_bars()
    return datasets


def load(images: str) -> Any:
    """The dataset ``images`` holds (a ``datasets.Dataset``); one line when ``datasets`` cannot read it."""
    datasets = _datasets()
    path = Path(images).expanduser()
    try:
        if path.is_dir() and any((path / name).is_file() for name in HF_SAVED):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file() and path.suffix.lower() in HF_FILE_SUFFIXES:
            loaded = datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files=str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            raise ImageDataError(f"--images: no datasets folder or file '{images}'")
    except ImageDataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for a folder it cannot read
        raise ImageDataError(f"--images {images}: datasets cannot read it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]})") from None
    return _train_split(loaded, images)


def _train_split(loaded: Any, images: str) -> Any:
    if not hasattr(loaded, "keys"):  # a Dataset, not a DatasetDict
        return loaded
    splits = list(loaded.keys())
    if "train" in splits:
        return loaded["train"]
    if len(splits) == 1:
        return loaded[splits[0]]
    raise ImageDataError(f"--images {images}: no 'train' split to train on (its splits: {', '.join(splits)})")


def _check_column(dataset: Any, flag: str, column: str, images: str) -> None:
    if column not in dataset.column_names:
        raise ImageDataError(f"{flag} '{column}': {images} has no such column (its columns: "
                             f"{', '.join(dataset.column_names)}); name one of them with {flag}")


def read_hf_dataset(images: str, image_column: str = "image", caption_column: str = "text") -> Listing:
    """One ``Captioned`` per row (key ``row N``); a row without a caption or an image is a ``BadSample``.
    No image's bytes are read here: which rows hold bytes and which a path is read off the arrow column."""
    dataset = load(images)
    _check_column(dataset, "--image-column", image_column, images)
    _check_column(dataset, "--caption-column", caption_column, images)
    datasets = _datasets()
    if isinstance(dataset.features[image_column], datasets.Image):  # keep the encoded bytes: decode on use
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    if dataset._indices is not None:  # a select / shuffle view: its rows as the arrow table holds them
        dataset = dataset.flatten_indices()
    column = dataset.select_columns([image_column])
    base = _relative_to(images)
    items, bad = [], []
    refs = _image_refs(dataset.data.column(image_column), len(dataset))
    for row, (caption, (path, has_bytes)) in enumerate(zip(dataset[caption_column], refs)):
        key = f"row {row}"
        if not isinstance(caption, str) or not caption.strip():
            bad.append(BadSample(key, f"{images} {key}", f"no caption in column '{caption_column}'"))
        elif has_bytes:
            items.append(Captioned(None, caption.strip(), key, partial(_row_bytes, column, row, image_column),
                                   f"{dataset._fingerprint}:{row}", origin=images))
        elif path:
            items.append(Captioned(base / Path(path).expanduser(), caption.strip(), key))  # an absolute one stays
        else:
            bad.append(BadSample(key, f"{images} {key}", f"no image in column '{image_column}'"))
    return Listing(items, bad)


def _image_refs(column: Any, rows: int) -> list[tuple[str | None, bool]]:
    """Per row, the path it names (or None) and whether it holds the image's bytes, from the arrow
    column: an Image feature (struct of bytes and path), a path string, or raw bytes."""
    import pyarrow as pa

    kind = column.type
    if pa.types.is_struct(kind):
        names = {kind.field(i).name for i in range(kind.num_fields)}
        paths = [p for c in column.chunks for p in c.field("path").to_pylist()] if "path" in names else [None] * rows
        held = [not n for c in column.chunks for n in c.field("bytes").is_null().to_pylist()] if "bytes" in names \
            else [False] * rows
        return list(zip(paths, held))
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return [(p, False) for p in column.to_pylist()]
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return [(None, not n) for c in column.chunks for n in c.is_null().to_pylist()]
    raise ImageDataError(f"--image-column: its type {kind} holds no images (an Image feature, bytes or paths)")


def _relative_to(images: str) -> Path:
    path = Path(images).expanduser().resolve()
    return path.parent if path.is_file() else path


def _bytes_of(value: Any) -> bytes | None:
    if isinstance(value, dict):
        value = value.get("bytes")
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def _row_bytes(column: Any, row: int, image_column: str) -> bytes:
    """A row's encoded image, read from the (memory-mapped) arrow table when a rank needs it."""
    return _bytes_of(column[row][image_column])
