"""The encoding cache on disk, and the ``LatentSource`` training reads it through.

::

    OUT/manifest.json      {"pulse_latent_cache": 1, "complete": false|true, resolution, latent_shape,
                            arrays (name -> per-image shape), inputs (model input -> array), encoding,
                            pipeline identity (config hashes), images (count, hash of names + captions +
                            sizes), shard_size, shards}
    OUT/shard-00000/       sha256.json (array -> sha256 of its .npy, written with the shard; the final
                           manifest's shards list them too: a shard is verified when training opens it),
                           <array>.npy for every array of the pipeline's recipe (pulse.data.pipeline_text):
                           latents (n, C, h, w) float32; SD: encoder_hidden_states (n, L, D) float32,
                           attention_mask (n, L) int64; Hunyuan-DiT: text_clip, text_clip_mask, text_t5,
                           text_t5_mask, image_meta_size, style: images [0, shard_size), in file-name order
    OUT/empty_prompt.npz   the empty caption's text arrays, one row each (``--caption-dropout``)

A shard is written into a temporary folder and renamed, so a shard folder
that exists is complete; the manifest is rewritten atomically, first with
``complete: false`` (the run's settings), last with ``complete: true``. A run
with the same settings keeps the shards already there (resume); other
settings in a non-empty folder are refused. Training refuses an incomplete
cache, another resolution, another text-encoder width or length, or another
backbone config than the cache was made for.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pulse.errors import PulseError
from pulse.spec import ModelSpec
from pulse.atomic_io import file_sha256, write_atomic, write_atomic_bytes
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.data.draws import make_inputs
from pulse.zoo.shapes import latent_shape
from pulse.data.pipeline_folder import config_hash

FORMAT = 1
MANIFEST = "manifest.json"
SUMS = "sha256.json"  # in each shard folder: its arrays' checksums, renamed into place with them
EMPTY_PROMPT = "empty_prompt.npz"
TEXT_INPUT = "context"  # the UNet spec's shared input for the text embeddings (pulse.zoo.unet)
# Settings that must match for a run to keep shards of an earlier one.
_SETTINGS = ("resolution", "encoding", "flip", "pipeline", "images", "shard_size", "buckets")


class CacheError(PulseError):
    """A cache folder that cannot be written, resumed or trained on (one line, says which)."""


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError(f"{path}: not a readable cache manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("pulse_latent_cache") != FORMAT:
        raise CacheError(f"{path}: not a PULSE latent cache manifest (format {FORMAT})")
    return data


def write_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def prepare(out: Path, manifest: Mapping[str, Any]) -> set[int]:
    """Make ``out`` ready for ``manifest``'s run; the shard numbers already complete there (kept)."""
    old = read_manifest(out) if out.is_dir() else None
    if out.is_dir() and old is None and any(out.iterdir()):
        raise CacheError(f"--out: '{out}' is not empty and holds no cache manifest: choose an empty or new folder")
    if old is not None:
        changed = [k for k in _SETTINGS if old.get(k) != manifest.get(k)]
        if changed:
            raise CacheError(f"{out}: holds a cache made with other {', '.join(changed)}: choose another --out "
                             "or remove that folder")
    if not out.parent.is_dir():  # the cache folder is asked for, its parents are not
        raise CacheError(f"--out: no folder '{out.parent}'; create it first (PULSE makes no folder it was not "
                         "asked for)")
    out.mkdir(exist_ok=True)
    for leftover in out.glob(".shard-*.tmp*"):  # an interrupted shard: never renamed, so never used
        shutil.rmtree(leftover, ignore_errors=True)
    write_manifest(out, {**manifest, "complete": False})
    return {i for i in range(len(manifest["shards"])) if (out / shard_name(i)).is_dir()}


def write_shard(out: Path, i: int, arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """``out/shard-<i>/`` atomically: written and fsync'ed in a temporary folder, then renamed.

    Its checksums (array -> sha256) are returned and written into the folder with the arrays.
    """
    final = out / shard_name(i)
    temp = out / f".{shard_name(i)}.tmp{os.getpid()}"
    temp.mkdir()
    sums = {}
    for name in arrays:
        with open(temp / f"{name}.npy", "wb") as handle:
            np.save(handle, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        sums[name] = file_sha256(temp / f"{name}.npy")
    write_atomic(temp / SUMS, json.dumps(sums, indent=1) + "\n")
    os.replace(temp, final)
    return sums


def shard_sums(out: Path, i: int) -> dict[str, str]:
    """A finished shard's checksums: its ``sha256.json``, or (a shard kept from a cache written before
    caches had checksums) its files hashed now."""
    folder = out / shard_name(i)
    try:
        sums = json.loads((folder / SUMS).read_text())
        if isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values()):
            return sums
    except (OSError, ValueError):
        pass
    return {p.stem: file_sha256(p) for p in sorted(folder.glob("*.npy"))}


def write_empty_prompt(out: Path, text: Mapping[str, np.ndarray]) -> None:
    buffer = io.BytesIO()  # a zip archive needs a seekable file
    np.savez(buffer, **text)
    write_atomic_bytes(out / EMPTY_PROMPT, lambda f: f.write(buffer.getvalue()))


def layout_of(manifest: Mapping[str, Any]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(array -> per-image shape, model input -> array); a cache written before caches named them is SD's."""
    if "arrays" in manifest:
        return ({str(k): list(map(int, v)) for k, v in manifest["arrays"].items()},
                {str(k): str(v) for k, v in manifest["inputs"].items()})
    length, width = map(int, manifest["context_shape"])
    return ({"latents": list(map(int, manifest["latent_shape"])), "encoder_hidden_states": [length, width],
             "attention_mask": [length]}, {TEXT_INPUT: "encoder_hidden_states"})


class ShardLatents:
    """``LatentSource`` over a cache folder: memory-mapped shards, each array given to the model input it feeds."""

    def __init__(self, path: str | Path, spec: ModelSpec, model: str | None = None) -> None:
        root = Path(path)
        manifest = read_manifest(root)
        if manifest is None:
            raise CacheError(f"--data: '{root}' holds no {MANIFEST}: make the cache with `pulse cache-latents`")
        if not manifest.get("complete"):
            raise CacheError(f"{root}: the cache is incomplete (interrupted?): run the same `pulse cache-latents` "
                             "command again to finish it")
        try:
            counts = [int(s["count"]) for s in manifest["shards"]]
            shapes, inputs = layout_of(manifest)
            list(map(int, manifest["latent_shape"])), int(manifest["resolution"]), str(manifest["pipeline"]["backbone"]), str(manifest["images"]["hash"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheError(f"{root / MANIFEST}: damaged ({type(exc).__name__}: {exc}); re-make the cache") from None
        if len(shapes.get("latents", ())) != 3 or not set(inputs.values()) <= set(shapes):
            raise CacheError(f"{root / MANIFEST}: damaged (arrays {shapes}, inputs {inputs})")
        check_against(root, manifest, spec, model)
        self._inputs = {n: inputs[n] for n in data_inputs(spec)}
        names = ("latents", *self._inputs.values())
        verify_shards(root, manifest, names)
        self._arrays = [{n: _open(root / shard_name(i) / f"{n}.npy", c) for n in names} for i, c in enumerate(counts)]
        self._where = np.concatenate([np.stack([np.full(c, i), np.arange(c)], 1) for i, c in enumerate(counts)])
        self.sample_shape, self.condition_names = tuple(shapes["latents"]), tuple(self._inputs)
        self.buckets: np.ndarray | None = None  # each sample's aspect-ratio bucket (None: one square shape)
        if "buckets" in manifest:
            self._read_buckets(root, manifest)
        self.num_samples = len(self._where)
        self._root = root
        # the run identity of checkpoints includes this name: another image set or pipeline is another run
        # buckets: their settings too (another bucketing of the same images is another run)
        at = (f"in {len(self._latents)} buckets {json.dumps(manifest['buckets']['settings'], sort_keys=True)} of "
              f"{manifest['resolution']} px area" if self.buckets is not None else f"at {manifest['resolution']} px")
        self.name = (f"{root.name} (latent cache: {self.num_samples} images {at}, "
                     f"images {manifest['images']['hash']}, backbone {manifest['pipeline']['backbone']})")

    def _read_buckets(self, root: Path, manifest: Mapping[str, Any]) -> None:
        """A cache in aspect-ratio buckets (``pulse_torch.cache_buckets``): shards per bucket, each naming the
        images (file-list positions) it holds; samples keep the file order, each with its bucket's shape."""
        try:
            self._latents = [tuple(map(int, s)) for s in manifest["buckets"]["latents"]]
            where = {int(m): (i, r) for i, shard in enumerate(manifest["shards"])
                     for r, m in enumerate(shard["members"])}
            bucket_of = {i: int(shard["bucket"]) for i, shard in enumerate(manifest["shards"])}
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"{root / MANIFEST}: damaged buckets ({type(exc).__name__}: {exc}); re-make the cache") \
                from None
        if sorted(where) != list(range(len(where))) or any(
                tuple(self._arrays[i]["latents"].shape[1:]) != self._latents[k] for i, k in bucket_of.items()):
            raise CacheError(f"{root / MANIFEST}: damaged buckets (shards do not hold every image once at its "
                             "bucket's shape); re-make the cache")
        self._where = np.array([where[m] for m in range(len(where))], dtype=np.int64).reshape(-1, 2)
        self.buckets = np.array([bucket_of[i] for i, _ in self._where], dtype=np.int64)
        self.sample_shape = max(self._latents, key=lambda s: int(np.prod(s)))  # the largest bucket's

    def shape_of(self, index: np.ndarray) -> tuple[int, ...]:
        """One latent's shape for ``index`` (samples of one bucket, as the bucketed sampler draws them)."""
        if self.buckets is None:
            return self.sample_shape
        found = np.unique(self.buckets[index])
        if len(found) != 1:
            raise CacheError(f"{self._root}: one batch asks for images of buckets {found.tolist()}; a batch is "
                             "drawn from one bucket")
        return self._latents[int(found[0])]

    def _rows(self, name: str, index: np.ndarray) -> np.ndarray:
        rows = np.stack([self._arrays[s][name][r] for s, r in self._where[index]])
        return rows.astype(np.float32) if rows.dtype.kind == "f" else rows

    def latents(self, index: np.ndarray) -> np.ndarray:
        return self._rows("latents", index)

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {n: self._rows(array, index) for n, array in self._inputs.items()}

    def has_empty_prompt(self) -> bool:
        return (self._root / EMPTY_PROMPT).is_file()  # a cache made before caches kept it has none

    def empty_conditions(self) -> dict[str, np.ndarray] | None:
        path = self._root / EMPTY_PROMPT
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                empty = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise CacheError(f"{path}: cannot read it ({exc}); re-make the cache") from None
        return {n: empty[a].astype(np.float32) if empty[a].dtype.kind == "f" else empty[a]
                for n, a in self._inputs.items() if a in empty}


def data_inputs(spec: ModelSpec) -> list[str]:
    from pulse.data.sources import data_input_names  # sources.py imports this module

    return data_input_names(spec)


_UNCHECKED_SAID: set[str] = set()  # caches already said to have no checksums (once per process)


def verify_shards(root: Path, manifest: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """Every array training reads matches the sha256 its shard was written with (a flipped byte in a
    latent trains silently otherwise); a cache written before checksums loads, said once."""
    for i, shard in enumerate(manifest["shards"]):
        sums = shard.get("sha256") if isinstance(shard, dict) else None
        if sums is None:
            if str(root) not in _UNCHECKED_SAID:
                _UNCHECKED_SAID.add(str(root))
                print(f"note: {root}: a cache written before caches had checksums: its shards are not verified "
                      "(re-make it with `pulse cache-latents` to have them)", file=sys.stderr, flush=True)
            return
        folder = root / shard_name(i)
        for name in names:
            path = folder / f"{name}.npy"
            want = sums.get(name) if isinstance(sums, dict) else None
            if want is None:
                raise CacheError(f"{root / MANIFEST}: damaged (no sha256 for {shard_name(i)}/{name}.npy); re-make the cache")
            if not path.is_file() or file_sha256(path) != want:
                images, pipeline = manifest["images"].get("folder", "IMAGES"), manifest["pipeline"].get("folder", "PIPELINE")
                raise CacheError(f"{path}: damaged (does not match its sha256 in {MANIFEST}); rebuild the shard: remove "
                                 f"{folder} and run the same `pulse cache-latents --pipeline {pipeline} --images "
                                 f"{images} --out {root} ...` again (it re-encodes only missing shards)")


def _open(path: Path, count: int) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: cannot read it ({exc}); re-make the cache") from None
    if array.shape[0] != count:
        raise CacheError(f"{path}: {array.shape[0]} rows where the manifest says {count}; re-make the cache")
    return array


def check_against(root: Path, manifest: Mapping[str, Any], spec: ModelSpec, model: str | None) -> None:
    """The cache fits ``spec`` (and, for a diffusers model, was made with this backbone's config)."""
    want = tuple(latent_shape(spec))
    got = tuple(manifest["latent_shape"])
    if got != want:
        raise CacheError(f"{root}: the cache holds {manifest['resolution']} px images as latents {got}, but model "
                         f"'{spec.name}' takes {want}: re-run `pulse cache-latents` for this model's pipeline "
                         "(or plan with --model-option resolution=...)")
    shapes, inputs = layout_of(manifest)
    names = data_inputs(spec)
    missing = [n for n in names if n not in inputs]
    if missing:
        raise CacheError(f"{root}: the cache holds {sorted(inputs)} but model '{spec.name}' reads {names}: "
                         "re-run `pulse cache-latents` with this model's pipeline")
    expected = make_inputs(spec, 1, np.random.default_rng(0))[1]
    for name in names:
        have, need = tuple(shapes[inputs[name]]), tuple(expected[name].shape[1:])
        if have != need:
            hint = (f"plan with --model-option context_len={have[0]} or " if name == TEXT_INPUT and len(have) == 2
                    else "")
            raise CacheError(f"{root}: '{inputs[name]}' is {have} per image but model '{spec.name}' takes "
                             f"{need} for '{name}': {hint}re-encode with the matching pipeline")
    if model is not None and model.startswith(DIFFUSERS_PREFIX):
        folder = Path(model[len(DIFFUSERS_PREFIX):])
        made_for = manifest["pipeline"].get("backbone")
        if config_hash(folder) != made_for:
            raise CacheError(f"{root}: made for another pipeline (backbone config {made_for}, {folder} is "
                             f"{config_hash(folder)}): re-run `pulse cache-latents --pipeline` with this model's "
                             "pipeline")
