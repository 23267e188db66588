"""Where a diffusers backbone folder keeps its weights, read from the safetensors headers alone.

::

    unet/diffusion_pytorch_model.safetensors                 one file
    unet/diffusion_pytorch_model.safetensors.index.json      {"weight_map": {name: shard file}} + the shards
        ─▶ {name: Entry(file, dtype "F32" | "F16" | "BF16" ..., shape)}
    text_encoder/model.safetensors[.index.json]              any other part (transformers' names): part_weights

A safetensors file starts with an 8-byte little-endian header length and a
JSON header naming every tensor's dtype, shape and byte range, so the names
and shapes of an 866M-parameter UNet are known without reading a weight, and
without torch or safetensors: a backend that cannot load torch checkpoints
(MindSpore) checks a pipeline here before any rank starts, then reads only
its own layers' tensors.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from pulse.errors import PulseError

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
TRANSFORMERS_WEIGHTS = "model.safetensors"  # a transformers part's (a text encoder's)
_MAX_HEADER = 100 * 2**20  # safetensors itself refuses headers above 100 MB


class WeightsError(PulseError):
    """A backbone folder whose weights cannot be read (one line, names the file)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where it is, its stored dtype and shape."""

    file: Path
    dtype: str  # safetensors' name: F32, F16, BF16, F64, ...
    shape: tuple[int, ...]
    begin: int = 0  # the tensor's bytes in the file: [begin, end), header included in the offsets
    end: int = 0


def read_header(path: Path) -> dict[str, Entry]:
    """Every tensor of one safetensors file by name (the ``__metadata__`` entry left out)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise WeightsError(f"{path}: not a safetensors file (header of {length} bytes)")
            header = json.loads(f.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (its header is not a JSON object)")
    try:
        start = 8 + length  # data_offsets count from the end of the header
        return {name: Entry(path, str(info["dtype"]), tuple(int(n) for n in info["shape"]),
                            *(start + int(o) for o in info.get("data_offsets", (0, 0))))
                for name, info in header.items() if name != "__metadata__"}
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{path}: not a safetensors file (a header entry lacks dtype or shape)") from None


def backbone_weights(folder: Path) -> dict[str, Entry] | None:
    """The backbone's tensors by name; None when the folder holds only a config (nothing to load).

    Refused in one line: weights only in the pickle format (``.bin``), which needs torch to read.
    """
    folder = Path(folder)
    entries = _safetensors(folder, WEIGHTS)
    if entries is not None:
        return entries
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if pickled:
        raise WeightsError(f"{folder}: weights only as {pickled[0]} (PyTorch pickle); save the model with "
                           "safe_serialization=True (safetensors) to train it with --backend mindspore")
    return None


def part_weights(folder: Path) -> dict[str, Entry] | None:
    """Any pipeline part's tensors by name, under diffusers' file names or transformers' (a text encoder's
    ``model.safetensors``); None when the part keeps none in safetensors (a pickle, or only a config)."""
    for file in (WEIGHTS, TRANSFORMERS_WEIGHTS):
        entries = _safetensors(Path(folder), file)
        if entries is not None:
            return entries
    return None


def _safetensors(folder: Path, file: str) -> dict[str, Entry] | None:
    """The tensors of ``folder/file``, or of its ``.index.json``'s shards; None when neither is there."""
    if (folder / file).is_file():
        return read_header(folder / file)
    index = folder / (file + ".index.json")
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({str(v) for v in weight_map.values()})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{index}: not a readable weight index ({exc})") from None
    entries: dict[str, Entry] = {}
    for name in files:
        if Path(name).name != name or not (folder / name).is_file():
            raise WeightsError(f"{index}: names shard '{name}', which is not a file in {folder}")
        entries.update(read_header(folder / name))
    return entries
