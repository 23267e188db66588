"""A local diffusers pipeline folder (what ``DiffusionPipeline.save_pretrained`` writes), checked by reading JSON.

Nothing here imports torch or diffusers: the folder is checked (and refused in
one line naming the missing part) before anything heavy loads.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulse.errors import PulseError

BACKBONES = ("unet", "transformer")
MODEL_INDEX = "model_index.json"


class PipelineError(PulseError):
    """A pipeline folder that lacks what the command needs (one line, names the folder or file)."""


@dataclass(frozen=True)
class PipelineFolder:
    """The parts of a pipeline folder; a part the folder lacks is None."""

    root: Path
    index: dict[str, Any]
    backbone: Path  # unet/ or transformer/
    vae: Path | None
    text_encoders: tuple[Path, ...]  # text_encoder/ [, text_encoder_2/]
    tokenizers: tuple[Path, ...]
    scheduler: Path | None

    @property
    def backbone_name(self) -> str:
        return self.backbone.name

    def identity(self) -> dict[str, str]:
        """Hashes of the parts' configs: which pipeline a cache was encoded with (weights are not read)."""
        parts = {"backbone": self.backbone, "vae": self.vae}
        parts.update({p.name: p for p in (*self.text_encoders, *self.tokenizers)})
        return {name: config_hash(path) for name, path in parts.items() if path is not None}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PipelineError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: expected a JSON object")
    return data


def _config_file(folder: Path) -> Path | None:
    for name in ("config.json", "scheduler_config.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            return folder / name
    return None


def config_hash(folder: Path) -> str:
    """sha256 (16 hex digits) of a part's config with the keys saving adds (``_name_or_path``, versions) left out."""
    file = _config_file(folder)
    if file is None:
        return "none"
    data = {k: v for k, v in _read_json(file).items()
            if not k.startswith("_") and k not in ("transformers_version", "torch_dtype", "dtype")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _part(root: Path, index: dict[str, Any], name: str) -> Path | None:
    """``root/name`` when the index lists it (not null) and the folder holds a config."""
    entry = index.get(name)
    if entry is None or entry == [None, None] or not (root / name).is_dir():
        return None
    return root / name if _config_file(root / name) is not None else None


def read_pipeline(path: str | Path, *, need_encoders: bool = False) -> PipelineFolder:
    """The pipeline at ``path``; ``need_encoders``: the VAE, a text encoder and its tokenizer must be there."""
    root = Path(path).expanduser()
    try:
        root.is_dir()
    except OSError as exc:  # e.g. a name too long for the file system
        raise PipelineError(f"--pipeline: cannot read '{str(path)[:80]}': {exc.strerror}") from None
    if not root.is_dir():
        raise PipelineError(f"--pipeline: no folder '{root}' (give a local diffusers pipeline folder, "
                            f"the one holding {MODEL_INDEX})")
    if not (root / MODEL_INDEX).is_file():
        raise PipelineError(f"{root}: no {MODEL_INDEX}: not a diffusers pipeline folder (save one with "
                            "DiffusionPipeline.save_pretrained, or point at its root, not a part)")
    index = _read_json(root / MODEL_INDEX)
    backbones = [b for b in BACKBONES if _part(root, index, b) is not None]
    if not backbones:
        raise PipelineError(f"{root}: no backbone: expected unet/ or transformer/ with a config.json "
                            f"(and listed in {MODEL_INDEX})")
    encoders = tuple(p for p in (_part(root, index, "text_encoder"), _part(root, index, "text_encoder_2")) if p)
    tokenizers = tuple(p for p in (_part(root, index, "tokenizer"), _part(root, index, "tokenizer_2")) if p)
    folder = PipelineFolder(root.resolve(), index, root.resolve() / backbones[0], _part(root, index, "vae"),
                            encoders, tokenizers, _part(root, index, "scheduler"))
    if need_encoders:
        for what, present in (("vae/ (the VAE that encodes the images)", folder.vae),
                              ("text_encoder/ (encodes the captions)", encoders),
                              ("tokenizer/ (splits the captions into tokens)", tokenizers)):
            if not present:
                raise PipelineError(f"{root}: no {what}: encoding captioned images needs the pipeline's "
                                    "VAE, text encoder and tokenizer")
    return folder


def part_config(path: Path | None, name: str = "config.json") -> dict[str, Any]:
    """A part's config file (empty for a part the folder lacks)."""
    return _read_json(path / name) if path is not None and (path / name).is_file() else {}


def resolution_of(folder: PipelineFolder) -> tuple[int, int]:
    """(pixels, VAE scale factor): the backbone's latent side times the VAE's downsampling."""
    factor = 2 ** (len(part_config(folder.vae).get("block_out_channels", [0] * 4)) - 1)
    size = part_config(folder.backbone).get("sample_size")
    if isinstance(size, (list, tuple)):
        size = size[0]
    if not isinstance(size, int) or size < 1:
        raise PipelineError(f"{folder.backbone}/config.json: no sample_size; give --resolution")
    return size * factor, factor
