"""Captioned images in diffusers' ImageFolder convention: which samples a folder holds, and which are bad.

::

    DIR/metadata.jsonl    {"file_name": "a.png", "text": "a caption"} per line (diffusers' ImageFolder), or
    DIR/a.png + a.txt     the caption in a same-named .txt beside each image
        │ read_listing: every captioned image, sorted by file name; a line that is not JSON, names no
        │   file or caption, or an image without its caption is a BadSample, not the end
        ▼
    screen_images(DIR, "stop" | "skip"): + every listed image decoded far enough to know it is whole
        stop  the bad samples end it in one line naming them (the file; the metadata line)
        skip  they are left out, each named once (BadSample.key: "b.png", "metadata.jsonl:3")

Every rank screens the same files the same way, so every rank leaves out the same samples
and the data order (``pulse.data.feed``: a function of the seed, the step and the sample
count) is the same everywhere, a resumed run's too. `pulse train` screens once before
launching (``pulse.cli.bad_samples``): ``stop`` refuses there, before any rank starts, and
``skip`` writes the keys into run.yaml (``RunConfig.skipped_samples``) and log.json.
Framework-free; PIL is imported only to decode.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from pulse.errors import PulseError
from pulse.train.run_config import BAD_SAMPLES

if TYPE_CHECKING:
    from pulse.data.image_sets import ImageSet

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"


class ImageDataError(PulseError):
    """A missing, unreadable or uncaptioned image (one line naming the file)."""


@dataclass(frozen=True)
class Captioned:
    """One captioned image: a file of its own (``path``), or one held inside a dataset or a tar shard
    (``read`` gives its encoded bytes: ``pulse.data.hf_datasets``, ``pulse.data.webdataset_shards``).

    ``key`` names the sample within its set (--bad-samples skip, run.yaml, the cache's file list): the
    file name in an ImageFolder. ``identity`` is what `images_hash` reads for the image's content (the
    file's size by default; a dataset's fingerprint or a tar member's size otherwise)."""

    path: Path | None
    caption: str
    key: str = ""
    read: Callable[[], bytes] | None = field(default=None, compare=False, repr=False)
    identity: int | str | None = None
    origin: str = ""  # the dataset or shard a ``read`` sample is in, for messages

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.path.name)

    @property
    def image(self) -> Path | io.BytesIO:
        """What ``PIL.Image.open`` reads: the file, or a fresh buffer of the sample's bytes."""
        return self.path if self.read is None else io.BytesIO(self.read())

    @property
    def where(self) -> str:
        """The sample in a message: the file, else its key."""
        return str(self.path) if self.path is not None else f"{self.origin} {self.key}".strip()

    def content_identity(self) -> int | str:
        return self.identity if self.identity is not None else self.path.stat().st_size


@dataclass(frozen=True)
class BadSample:
    """One sample that cannot train: ``key`` names it within the folder (an image's file name, or
    ``metadata.jsonl:<line>``), ``where`` is the full path of what is wrong (and its line)."""

    key: str
    where: str
    reason: str

    def describe(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class Listing:
    items: list[Captioned]  # sorted by file name: the cache's and the feed's sample order
    bad: list[BadSample]


def _from_metadata(root: Path) -> Listing:
    items, bad = [], []
    meta = root / METADATA
    try:
        lines = meta.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ImageDataError(f"{meta}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item_or_reason = _metadata_row(root, line)
        if isinstance(item_or_reason, Captioned):
            items.append(item_or_reason)
        else:
            bad.append(BadSample(f"{METADATA}:{number}", f"{meta}:{number}", item_or_reason))
    return Listing(items, bad)


def _metadata_row(root: Path, line: str) -> Captioned | str:
    """One metadata line's captioned image, or why it cannot train."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not a JSON line ({exc.msg})"
    if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
        return "each line needs \"file_name\" (and \"text\")"
    caption = row.get("text")
    if not isinstance(caption, str) or not caption.strip():
        return f"'{row['file_name']}' has no caption (\"text\": \"...\")"
    path = (root / row["file_name"]).resolve()
    if root.resolve() not in path.parents:  # a metadata line must not read files elsewhere
        return f"'{row['file_name']}' is outside {root}"
    if not path.is_file():
        return f"no image file '{path}'"
    return Captioned(path, caption.strip())


def _from_text_files(root: Path) -> Listing:
    items, bad = [], []
    for path in sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        text = path.with_suffix(".txt")
        caption = text.read_text(encoding="utf-8", errors="replace").strip() if text.is_file() else None
        if caption is None:
            bad.append(BadSample(path.name, str(path), f"no caption: write it to {text.name} beside the image "
                                                       f"(or list every image in {METADATA})"))
        elif not caption:
            bad.append(BadSample(path.name, str(text), "the caption is empty"))
        else:
            items.append(Captioned(path, caption))
    return Listing(items, bad)


def read_listing(folder: str | Path) -> Listing:
    """Every captioned image of ``folder`` and every sample that cannot train; a folder that cannot be
    read at all (missing, metadata not UTF-8, an image listed twice) is one line."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ImageDataError(f"--images: no folder '{root}'")
    listing = _from_metadata(root) if (root / METADATA).is_file() else _from_text_files(root)
    names = [i.path for i in listing.items]
    if len(set(names)) != len(names):
        raise ImageDataError(f"{root / METADATA}: an image is listed twice")
    return Listing(sorted(listing.items, key=lambda i: i.path.name), listing.bad)


def undecodable(items: Iterable[Captioned]) -> list[BadSample]:
    """The images PIL cannot decode whole (a truncated or damaged file), before anything is encoded.

    Each is verified (PNG's checksums) and then decoded: ``verify`` alone passes a truncated JPEG,
    which only ``load`` finds, and it would then stop the run at its first batch."""
    from PIL import Image

    bad = []
    for item in _once_each(items):
        try:
            with Image.open(item.image) as image:
                image.verify()
            with Image.open(item.image) as image:
                image.load()
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for a damaged file
            bad.append(BadSample(item.key, item.where, f"cannot read the image ({type(exc).__name__}: "
                                                                 f"{' '.join(str(exc).split())[:120]})"))
    return bad


def _once_each(items: Iterable[Captioned]) -> list[Captioned]:
    """Each sample once (a kohya folder repeats its images: each is decoded once)."""
    return list({item.key: item for item in items}.values())


@dataclass(frozen=True)
class Screened:
    items: list[Captioned]  # the samples that train, in file-name order
    skipped: list[BadSample]  # --bad-samples skip: those left out


def screen_images(folder: "str | Path | ImageSet", bad_samples: str = "stop",
                  screened: Iterable[str] | None = None) -> Screened:
    """The samples of ``folder`` that can train. ``stop``: any bad one is one line naming it (and how many
    more); ``skip``: the bad ones are left out. No usable sample at all is one line either way.

    ``screened``: the keys of the bad samples an earlier screening of this folder found (`pulse train`'s,
    before launch, carried in run.yaml); those are left out and the rest are not decoded again, only
    listed (a rank's start then costs no decode of the whole folder). None: decode every image here."""
    if bad_samples not in BAD_SAMPLES:
        raise PulseError(f"--bad-samples must be one of {', '.join(BAD_SAMPLES)}, got {bad_samples!r}")
    from pulse.data.image_sets import as_image_set, read_image_set  # it reads ImageFolders with read_listing

    image_set = as_image_set(folder)
    listing = read_image_set(image_set)
    known = set(screened or ())
    listed = [i for i in listing.items if i.key not in known]
    bad = listing.bad + (undecodable(listed) if screened is None else [])
    if bad and bad_samples == "stop":
        raise ImageDataError(stop_line(bad))
    broken = {b.key for b in bad}
    items = [i for i in listed if i.key not in broken]
    if not items:
        why = f" ({len(bad)} bad: {bad[0].describe()})" if bad else ""
        raise ImageDataError(f"{image_set.images}: no images with captions{why}")
    return Screened(items, bad)


def stop_line(bad: list[BadSample]) -> str:
    """``--bad-samples stop``'s one line: the first bad sample in full, the others by name."""
    line = bad[0].describe()
    if len(bad) > 1:
        more = ", ".join(b.where for b in bad[1:4]) + (", ..." if len(bad) > 4 else "")
        line += f"; {len(bad) - 1} more bad sample{'s' if len(bad) > 2 else ''} ({more})"
    return line + "; fix or remove them, or give --bad-samples skip to train without them"


def list_images(folder: "str | Path | ImageSet") -> list[Captioned]:
    """Every captioned image of ``folder`` (an ImageFolder: sorted by file name; any set
    ``pulse.data.image_sets`` reads); any bad listing is one line (undecoded: ``check_images`` decodes)."""
    from pulse.data.image_sets import as_image_set, read_image_set

    image_set = as_image_set(folder)
    listing = read_image_set(image_set)
    if listing.bad:
        raise ImageDataError(stop_line(listing.bad))
    if not listing.items:
        raise ImageDataError(f"{image_set.images}: no images ({', '.join(IMAGE_SUFFIXES)}) with captions")
    return listing.items


def check_images(items: list[Captioned]) -> None:
    """Every file is an image PIL can decode whole, before anything is encoded or written (one line if not)."""
    bad = undecodable(items)
    if bad:
        raise ImageDataError(stop_line(bad))
