"""Captioned images in diffusers' ImageFolder convention, as the pipeline's VAE takes them.

::

    DIR/metadata.jsonl    {"file_name": "a.png", "text": "a caption"} per line (diffusers' ImageFolder), or
    DIR/a.png + a.txt     the caption in a same-named .txt beside each image
        │ list_images: sorted by file name; every image needs its caption (one line naming the file)
        ▼
    load_image: RGB, shorter side resized to the resolution (bicubic), center-cropped to a square,
                optionally flipped left-right, scaled to [-1, 1] as (3, R, R) float32 (what
                diffusers' train_text_to_image feeds its VAE)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pulse.errors import PulseError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"


class ImageDataError(PulseError):
    """A missing, unreadable or uncaptioned image (one line naming the file)."""


@dataclass(frozen=True)
class Captioned:
    path: Path
    caption: str


def _from_metadata(root: Path) -> list[Captioned]:
    items = []
    meta = root / METADATA
    try:
        lines = meta.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ImageDataError(f"{meta}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ImageDataError(f"{meta}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise ImageDataError(f"{meta}:{number}: each line needs \"file_name\" (and \"text\")")
        caption = row.get("text")
        if not isinstance(caption, str) or not caption.strip():
            raise ImageDataError(f"{meta}:{number}: '{row['file_name']}' has no caption (\"text\": \"...\")")
        path = (root / row["file_name"]).resolve()
        if root.resolve() not in path.parents:  # a metadata line must not read files elsewhere
            raise ImageDataError(f"{meta}:{number}: '{row['file_name']}' is outside {root}")
        if not path.is_file():
            raise ImageDataError(f"{meta}:{number}: no image file '{path}'")
        items.append(Captioned(path, caption.strip()))
    return items


def _from_text_files(root: Path) -> list[Captioned]:
    items = []
    for path in sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        text = path.with_suffix(".txt")
        if not text.is_file():
            raise ImageDataError(f"{path}: no caption: write it to {text.name} beside the image "
                                 f"(or list every image in {METADATA})")
        caption = text.read_text(encoding="utf-8", errors="replace").strip()
        if not caption:
            raise ImageDataError(f"{text}: the caption is empty")
        items.append(Captioned(path, caption))
    return items


def list_images(folder: str | Path) -> list[Captioned]:
    """Every captioned image of ``folder``, sorted by file name (the cache's sample order)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ImageDataError(f"--images: no folder '{root}'")
    items = _from_metadata(root) if (root / METADATA).is_file() else _from_text_files(root)
    if not items:
        raise ImageDataError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) with captions")
    names = [i.path for i in items]
    if len(set(names)) != len(names):
        raise ImageDataError(f"{root / METADATA}: an image is listed twice")
    return sorted(items, key=lambda i: i.path.name)


def load_image(path: Path, resolution: int, flip: bool = False) -> np.ndarray:
    """(3, resolution, resolution) float32 in [-1, 1]; a file PIL cannot decode is one line naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            rgb = image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDataError(f"{path}: cannot read the image ({type(exc).__name__}: {exc}); replace or remove "
                             "it") from None
    w, h = rgb.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    rgb = rgb.crop((left, top, left + resolution, top + resolution))
    if flip:
        rgb = rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    return np.ascontiguousarray(pixels)


def images_hash(items: list[Captioned]) -> str:
    """Which image set (names, captions, sizes): part of a cache's and a run's identity."""
    rows = [[i.path.name, i.caption, i.path.stat().st_size] for i in items]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def check_images(items: list[Captioned]) -> None:
    """Every file is an image PIL can identify, before anything is encoded or written."""
    from PIL import Image

    for item in items:
        try:
            with Image.open(item.path) as image:
                image.verify()
        except Exception as exc:  # PIL raises many kinds for a damaged file
            raise ImageDataError(f"{item.path}: cannot read the image ({type(exc).__name__}); replace or "
                                 "remove it") from None


def flips(count: int, seed: int, enabled: bool) -> np.ndarray:
    """Which images are flipped left-right: seeded per image, so the cache and on-the-fly encoding agree."""
    if not enabled:
        return np.zeros(count, bool)
    return np.array([np.random.default_rng([seed, i]).random() < 0.5 for i in range(count)])


def size_arrays(items: list[Captioned], index, resolution: int, recipe) -> dict[str, np.ndarray]:
    """The per-image size conditions ``recipe`` (a ``pulse.data.pipeline_text.EncodingRecipe``) asks for, from
    each image's original size: Hunyuan-DiT's ``image_meta_size`` (B, 6) float32 and ``style`` (B,) int64 (0),
    SDXL's ``time_ids`` (B, 6) float32; {} for none. Only the file headers are read."""
    from PIL import Image

    from pulse.data.pipeline_text import IMAGE_META, STYLE, TIME_IDS, image_meta, sdxl_time_ids

    if not (recipe.image_meta or recipe.time_ids):
        return {}
    rows = []
    for i in index:
        with Image.open(items[i].path) as image:
            w, h = image.size
        rows.append((image_meta if recipe.image_meta else sdxl_time_ids)((h, w), resolution))
    if recipe.time_ids:
        return {TIME_IDS: np.array(rows, np.float32)}
    return {IMAGE_META: np.array(rows, np.float32), STYLE: np.zeros(len(rows), np.int64)}
