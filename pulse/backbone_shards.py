"""A backbone's weights written as diffusers writes them, one tensor at a time (every backend's export).

::

    [TensorInfo(name, dtype, shape), ...]  (in the order the exporter reads them)
        ─ plan_shards: huggingface_hub's rule: a new shard when the next tensor would tip the current one over
          max_bytes; a tensor bigger than max_bytes alone in its own
        ─ one shard:  diffusion_pytorch_model.safetensors
          several:    diffusion_pytorch_model-00001-of-0000N.safetensors ...
                      + diffusion_pytorch_model.safetensors.index.json {"metadata": {"total_size"}, "weight_map"}
        ─ write_safetensors: the header from the infos alone, then each tensor's bytes as ``data(info)`` hands
          them over; nothing of a shard is kept once written

Why not ``safetensors.save_file``: it takes the whole shard as a dict and
turns every tensor into ``bytes`` before writing, two copies of a shard in
memory; here the header is known before any weight is read (names, dtypes
and shapes only), so the exporting process holds one tensor at a time.
Framework-free: the backend hands in the bytes (a torch tensor's or a numpy
array's memory, anything with the buffer protocol).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from pulse.data.backbone_weights import INDEX, WEIGHTS
from pulse.errors import PulseError

# safetensors' dtype names and their sizes in bytes
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# diffusers' ``save_pretrained(max_shard_size="10GB")``: an SD-size backbone stays one file, as on the Hub.
# Memory does not grow with it: the writer holds one tensor, whatever the shard's size.
DEFAULT_MAX_SHARD_BYTES = 10 * 10**9
METADATA = {"format": "pt"}  # what diffusers' own files say (transformers' loaders check it)
_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8 bytes


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as it will be stored: its diffusers name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Shard:
    """One file of the backbone's weights and the tensors it holds, in order."""

    filename: str
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: Sequence[TensorInfo], max_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Shard]:
    """The files ``tensors`` go into, by ``huggingface_hub.split_torch_state_dict_into_shards``' rule and names."""
    groups: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_bytes:  # alone in its own shard, as huggingface_hub does
            groups.append([t])
            continue
        if current and size + t.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [Shard(WEIGHTS, tuple(groups[0]))]
    stem, suffix = WEIGHTS.rsplit(".", 1)
    n = len(groups)
    return [Shard(f"{stem}-{i + 1:05d}-of-{n:05d}.{suffix}", tuple(g)) for i, g in enumerate(groups)]


def safetensors_header(tensors: Sequence[TensorInfo], metadata: dict[str, str] = METADATA) -> bytes:
    """The 8-byte length and the JSON header of a file holding ``tensors`` back to back, in order."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    at = 0
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(path: Path, tensors: Sequence[TensorInfo], data: Callable[[TensorInfo], Any]) -> None:
    """``path``: a safetensors file of ``tensors``, each one's bytes from ``data(info)`` (buffer protocol,
    exactly ``info.nbytes`` long, little-endian as safetensors stores), written and dropped one by one."""
    with open(path, "wb") as f:
        f.write(safetensors_header(tensors))
        for t in tensors:
            view = as_bytes(data(t))
            if view.nbytes != t.nbytes:
                raise PulseError(f"{path}: '{t.name}' came as {view.nbytes} bytes, {t.dtype}{list(t.shape)} is "
                                 f"{t.nbytes}")
            f.write(view)
            del view  # before the next tensor is read: one at a time


def as_bytes(buffer: Any) -> memoryview:
    """``buffer``'s memory as flat bytes, not copied (it must be contiguous: a view of it is written)."""
    view = memoryview(buffer)
    if view.nbytes == 0:
        return memoryview(b"")
    if not view.c_contiguous:
        raise ValueError("a tensor handed to the writer must be contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def index_json(shards: Sequence[Shard]) -> str:
    """diffusers' ``*.safetensors.index.json`` for ``shards`` (its own layout: indent 2, sorted keys)."""
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)},
             "weight_map": {t.name: s.filename for s in shards for t in s.tensors}}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def write_backbone_weights(folder: Path, tensors: Sequence[TensorInfo], data: Callable[[TensorInfo], Any],
                           max_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Shard]:
    """``folder``'s weight files (and index when there are several) for ``tensors``; the shards written.

    ``folder`` is the backbone folder being built beside its target (``pulse.export_folder``): a crash
    leaves no half-written pipeline, so the files themselves need no rename of their own.
    """
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise PulseError(f"{folder}: '{twice}' would be written twice")
    shards = plan_shards(tensors, max_bytes)
    for shard in shards:
        write_safetensors(folder / shard.filename, shard.tensors, data)
    if len(shards) > 1:
        (folder / INDEX).write_text(index_json(shards))
    return shards
