"""A complete checkpoint step's weights, read where they lie: tensor by tensor, never merged, never cloned.

::

    step-<k>/manifest.json (checked: sizes, sha256)
    step-<k>/rank-<r>.pt   torch.load(mmap=True, weights_only=True): the file is mapped, not read;
                           a tensor's pages are read when its bytes are (a copy_, a write)
        ─ StepWeights: {name: tensor} over every rank file that holds weights (replica 0's),
          names, shapes and dtypes known from the mapped files alone

Why a window: a mapped file's pages, once read, count in the process's
resident memory until the mapping goes, and the mapping goes only when no
tensor of it is left. So after ``window_bytes`` handed out of one file the
mapping is dropped and the file mapped again: the pages read so far leave the
process (they stay in the page cache, where the kernel may reclaim them), and
an export of an 866M-parameter UNet stays resident at a window, not a rank file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from pulse.train.checkpoints import CheckpointError, check_step
from pulse_torch.checkpoint import read_file

WINDOW_BYTES = 256 * 2**20  # a mapping is dropped once this much of it was handed out


class StepWeights(Mapping[str, Tensor]):
    """Every parameter of a complete step by the backend's name (``ema``: its moving average), read on access.

    A value is a view of the mapped rank file: read-only use (copy it into a model, cast it, write it).
    """

    def __init__(self, path: Path, manifest: Mapping[str, Any], ema: bool = False,
                 window_bytes: int = WINDOW_BYTES) -> None:
        self.path, self.key, self.window_bytes = Path(path), "ema" if ema else "params", window_bytes
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for entry in manifest["files"]:
            if not entry["layers"]:  # a data-parallel replica's file: no weights
                continue
            file = self.path / entry["name"]
            data = read_file(file)
            for name, t in data.get(self.key, {}).items():  # "ema": none in a file of before it was kept
                self.file_of[name], self.shapes[name], self.dtypes[name] = file, tuple(t.shape), t.dtype
            del data  # only names, shapes and dtypes were looked at: nothing was read
        self._mapped: tuple[Path, dict[str, Tensor]] | None = None
        self._handed = 0  # bytes handed out of the current mapping

    def __getitem__(self, name: str) -> Tensor:
        file = self.file_of[name]  # KeyError for a name no file holds, as a dict
        if self._mapped is None or self._mapped[0] != file or self._handed >= self.window_bytes:
            self.release()
            self._mapped = (file, read_file(file)[self.key])
        tensor = self._mapped[1][name]
        self._handed += tensor.numel() * tensor.element_size()
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)

    def numel(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes.values())

    def release(self) -> None:
        """Drop the mapping (its pages leave once the tensors handed out of it are gone too)."""
        self._mapped, self._handed = None, 0


def step_weights(path: Path, step: int, ema: bool = False, manifest: Mapping[str, Any] | None = None,
                 window_bytes: int = WINDOW_BYTES) -> StepWeights:
    """The weights of the complete ``step-<step>`` folder ``path`` (its manifest checked unless given);
    ``ema``: their moving averages, refused in one line when the run kept none."""
    manifest = check_step(path, step) if manifest is None else manifest
    weights = StepWeights(path, manifest, ema, window_bytes)
    if ema and not weights:  # a run without --ema: its files' "ema" is empty
        raise CheckpointError(f"{path}: holds no EMA weights (the run trained without --ema): export without "
                              "--ema")
    return weights


def shapes_of(weights: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, without reading a lazy mapping's values."""
    if isinstance(weights, StepWeights):
        return dict(weights.shapes)
    return {n: tuple(t.shape) for n, t in weights.items()}
