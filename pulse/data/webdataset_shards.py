"""Captioned images in WebDataset tar shards, read in place: never extracted, never all in memory.

::

    --images "shards/{000000..000009}.tar"   webdataset's expand_urls (braces, "::" between lists)
    --images shards/                         every .tar in it, by name
    --images shards/000000.tar
        │ read_shards: one pass over each shard's tar headers (stdlib tarfile), its members grouped into
        │   samples by webdataset's own group_by_keys / base_plus_ext ("a/b.c.jpg" -> key "a/b", "c.jpg")
        │   KEY.jpg|jpeg|png|webp   the image: its offset and size in the shard, not its bytes
        │   KEY.txt                 the caption, or KEY.json's --caption-column ("text") or "caption"
        ▼
    Listing: one Captioned per sample in shard then member order, key "SHARD:KEY"; its image bytes
             are read at their offset when a rank needs them (``_member_bytes``)

Order and resume: the samples are indexed, not streamed in one pass, so the sample order is PULSE's
own (``pulse.train.sampler``: seeded epoch permutations of the listing, a pure function of seed,
step and sample count) and a resumed run at step N reads exactly the samples the straight run
reads from step N on: the position is the step, nothing else is recorded. The price: a read is a
seek into a shard (local or network filesystems; a compressed .tar.gz cannot be, so it is refused).
"""
from __future__ import annotations

import json
import tarfile
from functools import partial
from pathlib import Path
from typing import Iterator

from pulse.data.captioned_images import BadSample, Captioned, ImageDataError, Listing

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # in this preference when a sample has several


def shard_paths(images: str) -> list[Path]:
    """The shard files ``images`` names, in order; a bad pattern or a missing shard is one line."""
    path = Path(images).expanduser()
    if "{" not in images and path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.suffix == ".tar" and p.is_file())
        if not shards:
            raise ImageDataError(f"--images {images}: no .tar shards in the folder")
        return shards
    from webdataset.shardlists import expand_urls

    try:
        names = expand_urls(images)
    except Exception as exc:  # noqa: BLE001 - braceexpand's UnbalancedBracesError and the like
        raise ImageDataError(f"--images {images!r}: not a shard pattern webdataset expands ({exc})") from None
    for name in names:
        if "{" in name or "}" in name:
            raise ImageDataError(f"--images {images!r}: '{name}' is not a brace range webdataset expands "
                                 "(e.g. shards/{000000..000009}.tar)")
        if not Path(name).expanduser().is_file():
            raise ImageDataError(f"--images {images!r}: no shard file '{name}'")
        if not name.endswith(".tar"):
            raise ImageDataError(f"--images: '{name}' is not an uncompressed .tar shard (read in place by offset)")
    return [Path(n).expanduser() for n in names]


def _members(shard: Path) -> Iterator[dict]:
    """Each file of the shard as webdataset's tar iterator yields it, its data an (offset, size)."""
    try:
        with tarfile.open(shard, "r:") as tar:
            for member in tar:
                if member.isfile():
                    yield {"fname": member.name, "data": (member.offset_data, member.size), "__url__": str(shard)}
    except tarfile.TarError as exc:
        raise ImageDataError(f"{shard}: not a readable tar shard ({exc})") from None


def _member_bytes(shard: Path, offset: int, size: int) -> bytes:
    with open(shard, "rb") as file:
        file.seek(offset)
        return file.read(size)


def _caption(shard: Path, sample: dict, caption_column: str) -> str | None:
    if "txt" in sample:
        return _member_bytes(shard, *sample["txt"]).decode("utf-8", errors="replace").strip()
    if "json" in sample:
        try:
            meta = json.loads(_member_bytes(shard, *sample["json"]))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if isinstance(meta, dict):
            caption = meta.get(caption_column, meta.get("caption"))
            return caption.strip() if isinstance(caption, str) else None
    return None


def _sample(shard: Path, sample: dict, caption_column: str) -> Captioned | BadSample:
    key = f"{shard.name}:{sample['__key__']}"
    where = f"{shard} {sample['__key__']}"
    image = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
    if image is None:
        return BadSample(key, where, f"no image ({', '.join('.' + e for e in IMAGE_EXTENSIONS)}) in the sample")
    caption = _caption(shard, sample, caption_column)
    if not caption:
        return BadSample(key, where, f"no caption (.txt, or .json with \"{caption_column}\" or \"caption\")")
    offset, size = sample[image]
    return Captioned(None, caption, key, partial(_member_bytes, shard, offset, size), size, origin=str(shard.parent))


def read_shards(images: str, caption_column: str = "text") -> Listing:
    """Every sample of the shards ``images`` names, in shard then member order."""
    from webdataset.tariterators import group_by_keys

    items, bad = [], []
    for shard in shard_paths(images):
        try:
            for sample in group_by_keys(_members(shard)):
                made = _sample(shard, sample, caption_column)
                (items if isinstance(made, Captioned) else bad).append(made)
        except ValueError as exc:  # group_by_keys: a file name twice in one sample
            raise ImageDataError(f"{shard}: {exc}") from None
    return Listing(items, bad)
