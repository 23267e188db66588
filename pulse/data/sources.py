"""Where clean latents and their conditioning come from: synthetic fields, a .npy/.npz file, or a
``pulse cache-latents`` folder (``pulse.data.shards``); numpy, the same for every backend.

A source answers ``latents(index)`` (B, C, H, W) float32 and ``conditions(index)``
(every data shared input but the timesteps) for an int64 sample index; all
randomness is drawn from generators seeded by numbers, never from a global RNG,
so every rank of a replica reads bit-identical arrays without talking.
"""
from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

from pulse.data.draws import latent_shape, make_inputs
from pulse.errors import PulseError
from pulse.train.sampler import seeded
from pulse.spec import ModelSpec

TIMESTEPS = "timesteps"  # drawn with the noise, never read from a dataset
SYNTHETIC_SAMPLES, SYNTHETIC_CLASSES = 1024, 8  # the synthetic default's size (pulse.data.footprint prices it)
SYNTHETIC_BLOCK = 16  # samples made at once: the fields' temporaries stay a block's, not the whole set's


def data_input_names(spec: ModelSpec) -> list[str]:
    """Shared inputs every rank loads from the data (not made by a layer), timesteps excluded."""
    return [s.name for s in spec.shared_inputs if s.producer is None and s.name != TIMESTEPS]


class LatentSource(Protocol):
    """A dataset of clean latents with their conditioning, indexed by sample number."""

    name: str
    num_samples: int
    sample_shape: tuple[int, ...]  # one latent's (C, H, W)
    condition_names: tuple[str, ...]  # the keys of ``conditions``

    def latents(self, index: np.ndarray) -> np.ndarray: ...

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]: ...

    def has_empty_prompt(self) -> bool:
        """Can ``empty_conditions`` give the empty prompt's conditioning (cheap to ask)?"""

    def empty_conditions(self) -> dict[str, np.ndarray] | None:
        """The empty prompt's conditioning, one row (``--caption-dropout``); None: the source has none."""


def upsample_bilinear(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """(N, C, h, w) -> (N, C, height, width), half-pixel centres (torch's ``align_corners=False``)."""
    def weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5, 0.0)
        lo = np.minimum(np.floor(src).astype(np.int64), size_in - 1)
        hi = np.minimum(lo + 1, size_in - 1)
        return lo, hi, (src - lo).astype(np.float32)

    lo, hi, w = weights(grid.shape[2], height)
    rows = grid[:, :, lo, :] * (1 - w)[:, None] + grid[:, :, hi, :] * w[:, None]
    lo, hi, w = weights(grid.shape[3], width)
    return rows[..., lo] * (1 - w) + rows[..., hi] * w


def smooth_fields(count: int, shape: tuple[int, int, int], rng: np.random.Generator,
                  coarse: int = 4) -> np.ndarray:
    """(count, C, H, W) unit-variance fields: coarse Gaussian grids upsampled bilinearly.

    Smooth, so neighbouring pixels predict each other: a denoiser can learn to
    tell them from white noise.
    """
    c, h, w = shape
    grid = rng.standard_normal((count, c, max(h // coarse, 1), max(w // coarse, 1)), dtype=np.float32)
    up = upsample_bilinear(grid, h, w)
    std = up.reshape(count, -1).std(axis=1).clip(min=1e-6)
    return (up / std[:, None, None, None]).astype(np.float32)


class SyntheticLatents:
    """Class-structured smooth latents: sample i = prototype[i % K] + 0.5 * its own field, unit variance.

    Conditioning is per class (one synthetic caption / label per class), so it
    carries information about the latent, as a caption does.
    """

    def __init__(self, spec: ModelSpec, num_samples: int = SYNTHETIC_SAMPLES, num_classes: int = SYNTHETIC_CLASSES,
                 seed: int = 0) -> None:
        if num_samples < 1 or num_classes < 1:
            raise PulseError(f"synthetic data needs >= 1 sample and class, got {num_samples} and {num_classes}")
        self.name = f"synthetic({num_samples} smooth latents, {num_classes} classes, seed {seed})"
        self.num_samples = num_samples
        shape = self.sample_shape = latent_shape(spec)
        protos = smooth_fields(num_classes, shape, seeded(seed, "prototypes"))
        self.classes = np.arange(num_samples) % num_classes
        # block by block: the same draws in the same order as all at once (bit for bit), but the
        # temporaries of one block beside the set (all at once: ~4 sets' worth at the peak)
        self._x0 = np.empty((num_samples, *shape), dtype=np.float32)
        rng = seeded(seed, "samples")
        for start in range(0, num_samples, SYNTHETIC_BLOCK):
            block = slice(start, min(start + SYNTHETIC_BLOCK, num_samples))
            own = smooth_fields(block.stop - start, shape, rng)
            self._x0[block] = (protos[self.classes[block]] + 0.5 * own) / np.float32(1.25 ** 0.5)
        per_class = [make_inputs(spec, 1, seeded(seed, "class", k))[1] for k in range(num_classes)]
        self._cond = {n: np.concatenate([c[n] for c in per_class]) for n in data_input_names(spec)}
        self.condition_names = tuple(self._cond)

    def latents(self, index: np.ndarray) -> np.ndarray:
        return self._x0[index]

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {n: table[self.classes[index]] for n, table in self._cond.items()}

    def has_empty_prompt(self) -> bool:
        return False  # synthetic conditioning has no prompt to leave empty

    def empty_conditions(self) -> None:
        return None


class FileLatents:
    """Cached latents from ``.npy`` (N, C, H, W) or ``.npz`` ("latents" plus optional per-sample
    arrays named after the model's data inputs, e.g. "context", "labels").

    Inputs the file lacks are synthesized per sample (seeded by its index), so
    every rank and every run sees the same ones. An input's array of another
    per-sample shape than the model takes is an error; so is an array under
    another name (``encoder_hidden_states``, diffusers' name for the context) that
    looks meant for an input the file lacks. Other arrays are ignored (and named).
    """

    def __init__(self, path: str | Path, spec: ModelSpec, seed: int = 0) -> None:
        path = Path(path)
        arrays = _load_arrays(path)
        key = _latent_key(arrays, path)
        want = latent_shape(spec)
        got = arrays[key].shape
        if tuple(got[1:]) != want:
            raise PulseError(f"{path}: latents have shape {tuple(got)}, but model '{spec.name}' takes "
                             f"(N, {', '.join(map(str, want))}); re-encode or pick the matching model")
        self.num_samples, self.sample_shape = int(got[0]), want
        if self.num_samples < 1:
            raise PulseError(f"{path}: holds no samples")
        self._x0 = arrays[key]  # numpy, memory-mapped for .npy: rows are read per microbatch
        names = data_input_names(spec)
        expected = {n: t for n, t in make_inputs(spec, 1, seeded(seed, "shapes"))[1].items() if n in names}
        ignored = _check_keys(path, arrays, key, expected)
        self._cond = {n: arrays[n] for n in names if n in arrays}
        for n, a in self._cond.items():
            if a.shape[0] != self.num_samples:
                raise PulseError(f"{path}: '{n}' has {a.shape[0]} rows for {self.num_samples} latents")
            if tuple(a.shape[1:]) != tuple(expected[n].shape[1:]):
                raise PulseError(f"{path}: '{n}' has shape {tuple(a.shape)}, but model '{spec.name}' takes "
                                 f"(N, {', '.join(map(str, expected[n].shape[1:]))}); re-encode it for this "
                                 "model (or plan with the matching --model-option context_len=...)")
        self._missing = [n for n in names if n not in self._cond]
        self.condition_names = tuple(names)
        self._spec, self._seed = spec, seed
        made = f", synthetic {', '.join(self._missing)}" if self._missing else ""
        made += f", ignored {', '.join(ignored)}" if ignored else ""
        self.name = f"{path.name} ({self.num_samples} latents{made})"

    def latents(self, index: np.ndarray) -> np.ndarray:
        return np.asarray(self._x0[index], dtype=np.float32)

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        out = {n: np.ascontiguousarray(a[index]) for n, a in self._cond.items()}
        if self._missing:
            made = [make_inputs(self._spec, 1, seeded(self._seed, "sample", int(i)))[1] for i in index]
            out.update({n: np.concatenate([m[n] for m in made]) for n in self._missing})
        return out

    def has_empty_prompt(self) -> bool:
        return False  # a file of latents holds no empty prompt's embedding

    def empty_conditions(self) -> None:
        return None


def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise PulseError(f"data file '{path}' does not exist")
    try:
        if path.suffix == ".npy":
            return {"latents": np.load(path, mmap_mode="r", allow_pickle=False)}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise PulseError(f"{path}: cannot read it as numpy data ({exc})") from None
    raise PulseError(f"{path}: expected a .npy or .npz file of latents (N, C, H, W)")


# The diffusers names of inputs, for the error that says what to rename them to.
_DIFFUSERS_NAMES = {"encoder_hidden_states": "context", "prompt_embeds": "context", "class_labels": "labels"}


def _check_keys(path: Path, arrays: dict[str, np.ndarray], latent_key: str,
                expected: dict[str, np.ndarray]) -> list[str]:
    """The arrays that are neither the latents nor a data input (ignored); an error when one of them is
    meant for an input the file lacks, which would otherwise be synthesized (training silently on noise):
    a diffusers name for it, or an array of that input's per-sample shape."""
    unknown = sorted(set(arrays) - {latent_key, *expected})
    for name in unknown:
        for wanted in (n for n in expected if n not in arrays):
            shape = tuple(expected[wanted].shape[1:])
            if _DIFFUSERS_NAMES.get(name) == wanted or tuple(arrays[name].shape[1:]) == shape:
                raise PulseError(f"{path}: holds '{name}' {tuple(arrays[name].shape)} but no '{wanted}': this model "
                                 f"reads its {wanted} (N, {', '.join(map(str, shape))}) from an array named "
                                 f"'{wanted}'; rename '{name}' -> '{wanted}' (without it '{wanted}' is synthetic)")
    return unknown


def _latent_key(arrays: dict[str, np.ndarray], path: Path) -> str:
    if "latents" in arrays:
        return "latents"
    four_d = [k for k, a in arrays.items() if a.ndim == 4]
    if len(four_d) != 1:
        raise PulseError(f"{path}: name the latents array 'latents' (found 4-D arrays: {four_d or 'none'})")
    return four_d[0]


# The synthetic default this thread made last, as (spec, seed, source). A profile asks for the same set
# once per run (~30 runs a profile: pulse.profiling.runs.feed_of), and made afresh each time it cost
# more than the runs on small models (0.04 s CPU for tiny-unet's 1,024 samples, 0.56 s for SD v2's).
# Asked again for the same spec (the same object: its equality leaves out the layers' attrs, which
# give the shapes) and seed, load_source hands out a copy of that source sharing its arrays, which no
# reader writes to (latents() and conditions() index them into new arrays). Per thread: ranks run as
# threads of one process (pulse.testing) each make their own, as rank processes do.
_last_synthetic = threading.local()


def _synthetic(spec: ModelSpec, seed: int) -> SyntheticLatents:
    made = getattr(_last_synthetic, "made", None)
    if made is not None and made[0] is spec and made[1] == seed:
        return copy.copy(made[2])
    source = SyntheticLatents(spec, seed=seed)
    _last_synthetic.made = (spec, seed, source)
    return copy.copy(source)


def load_source(path: str | None, spec: ModelSpec, seed: int, model: str | None = None) -> LatentSource:
    """The file at ``path``, a ``pulse cache-latents`` folder, or the synthetic default when no path is given.

    ``model``: the plan's model name; a cache checks that a diffusers backbone's config is the one it was made for.
    """
    if path is None:
        return _synthetic(spec, seed)
    if Path(path).is_dir():
        from pulse.data.shards import ShardLatents  # shards.py imports this module

        return ShardLatents(path, spec, model)
    return FileLatents(path, spec, seed)

