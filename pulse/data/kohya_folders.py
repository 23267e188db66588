"""Captioned images in kohya-ss sd-scripts' DreamBooth folders, with their meanings.

::

    DIR/5_sks dog/a.png + a.caption     "<repeats>_<class tokens>" subfolders: each image trains 5 times an
    DIR/2_style/b.jpg   + b.caption      epoch; a subfolder not starting with a number (or repeats < 1) is
                                         ignored, as sd-scripts ignores it
        │ read_kohya_folders(DIR, --caption-extension): as sd-scripts' config_util
        │   (generate_dreambooth_subsets_config_by_subdirs) and train_util (read_caption, glob_images):
        │   images of .png .jpg .jpeg .webp .bmp (not recursive, sorted); the caption is the first line of
        │   IMAGE_BASE + extension (default ".caption"; "txt" means ".txt"), or of the face-crop base's
        │   (a name of 5+ "_" tokens without its last 4); without one, the folder's class tokens
        ▼
    Listing: each image `repeats` times in a row (sd-scripts' num_train_images counts them so), key
             "SUBFOLDER/NAME" for every copy, so --bad-samples skip leaves out all of them

Where sd-scripts trains an image with no caption file and no class tokens on "" (a warning) or stops
at an empty caption file, PULSE lists either as a ``BadSample`` (--bad-samples stop | skip).
"""
from __future__ import annotations

from pathlib import Path

from pulse.data.captioned_images import IMAGE_SUFFIXES, BadSample, Captioned, ImageDataError, Listing


def repeats_and_tokens(name: str) -> tuple[int, str]:
    """sd-scripts' ``extract_dreambooth_params``: "10_sks dog" -> (10, "sks dog"); no number -> (0, "")."""
    tokens = name.split("_")
    try:
        return int(tokens[0]), "_".join(tokens[1:])
    except ValueError:
        return 0, ""


def caption_extension(extension: str) -> str:
    return extension if not extension or extension.startswith(".") else "." + extension


def read_caption(image: Path, extension: str) -> str | None:
    """sd-scripts' ``read_caption`` (no wildcards): the first line, stripped; "" for an empty file; None: none."""
    base = str(image.with_suffix(""))
    tokens = base.split("_")
    face_crop = "_".join(tokens[:-4]) if len(tokens) >= 5 else base
    for candidate in (Path(base + extension), Path(face_crop + extension)):
        if candidate.is_file():
            lines = candidate.read_text(encoding="utf-8", errors="replace").splitlines()
            return lines[0].strip() if lines else ""
    return None


def _subfolder(folder: Path, repeats: int, class_tokens: str, extension: str) -> Listing:
    items, bad = [], []
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    for image in images:
        key = f"{folder.name}/{image.name}"
        caption = read_caption(image, extension)
        if caption is None and class_tokens.strip():
            caption = class_tokens.strip()
        if not caption:
            why = "the caption file is empty" if caption == "" else \
                f"no caption: write it to {image.with_suffix(extension).name} (or name the folder N_<class tokens>)"
            bad.append(BadSample(key, str(image), why))
            continue
        items.extend([Captioned(image, caption, key)] * repeats)
    return Listing(items, bad)


def read_kohya_folders(images: str, extension: str = ".caption") -> Listing:
    """Every captioned image of the ``N_name`` subfolders of ``images``, each ``N`` times (subfolders sorted
    by name); no such subfolder at all is one line."""
    root = Path(images).expanduser()
    if not root.is_dir():
        raise ImageDataError(f"--images: no folder '{root}'")
    extension = caption_extension(extension)
    items, bad, used = [], [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        repeats, class_tokens = repeats_and_tokens(folder.name)
        if repeats < 1:  # sd-scripts: "ignore directory without repeats"
            continue
        listing = _subfolder(folder, repeats, class_tokens, extension)
        items += listing.items
        bad += listing.bad
        used.append(folder.name)
    if not used:
        raise ImageDataError(f"--images {root}: no kohya subfolders '<repeats>_<name>' (e.g. '10_sks dog') in it")
    return Listing(items, bad)
