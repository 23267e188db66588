"""Checkpoints that survive a crash and load under another plan.

::

    DIR/step-6/rank-0.pt ... rank-<W-1>.pt     each rank: its layers' parameters and AdamW state
                                                by parameter name ("<layer>.<param>"), its RNG
                                                states, the step and the data position
    DIR/step-6/manifest.json                    written last, by rank 0, once every rank file is
                                                on disk: files, sizes, sha256, layers per file,
                                                plan (model, pp, dp, placement, batch)

A step directory without a manifest, or whose files do not match it, was
interrupted and is never loaded. Everything is keyed by layer name, so a rank
of another plan (other pp, placement, folds, dp) reads the layers it now owns
from whichever files hold them. Only replica 0 saves weights: data-parallel
replicas hold identical ones after every all-reduced step. Files load with
``torch.load(weights_only=True)``: tensors and plain containers, never an
arbitrary pickle. Step directories assume a filesystem every rank can read.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from pulse.errors import PulseError
from pulse.runtime.errors import CommTimeout
from pulse_torch.backend import TorchBackend, TorchChunk

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^rank-\d+\.pt$")  # the only names a manifest may list: inside its step folder
_TEMP_FILE = re.compile(r"^\.(rank-\d+\.pt|manifest\.json)\..+$")  # write_atomic_bytes' leftovers


class CheckpointError(PulseError):
    """A checkpoint that cannot be written, found or loaded (one line, says which file)."""


# -- atomic, hashed writes ----------------------------------------------------------------
class _HashingWriter:
    """A file object that hashes and counts what passes through (no second read of the file)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.sha, self.size = handle, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry durable (POSIX only: Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_bytes(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """``write(file)`` into a temporary file next to ``path``, fsync, rename: (size, sha256 hex).

    A crash leaves either the old file or the new one, never half of one (the
    temporary ``.name.*`` file may stay behind; loaders never read it).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; other jobs (evaluation) read checkpoints
        with os.fdopen(fd, "wb") as handle:
            writer = _HashingWriter(handle)
            write(writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.sha.hexdigest()


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


# -- what one rank holds ----------------------------------------------------------------------
@dataclass
class Shard:
    """One rank's share of the job: its chunk modules and where it sits."""

    backend: TorchBackend
    chunks: Sequence[TorchChunk]
    rank: int
    world_size: int
    replica: int  # only replica 0 saves weights

    def layers(self) -> list[str]:
        return [name for c in self.chunks for name in c.layers]

    def parameters(self) -> dict[str, Tensor]:
        return {n: p for c in self.chunks for n, p in self.backend.parameters(c).items()}


def ensure_optimizer(backend: TorchBackend, chunk: TorchChunk) -> torch.optim.Optimizer:
    """The chunk's AdamW, built as ``TorchBackend.optimizer_step`` builds it (lazily, same arguments)."""
    if chunk.optimizer is None:
        chunk.optimizer = torch.optim.AdamW(chunk.parameters(), lr=backend.lr, betas=backend.betas,
                                            eps=backend.eps, weight_decay=backend.weight_decay)
    return chunk.optimizer


def optimizer_state(shard: Shard) -> dict[str, dict[str, Tensor]]:
    """AdamW state by parameter name; parameters that never had a gradient have none."""
    out = {}
    for chunk in shard.chunks:
        if chunk.optimizer is None:
            continue
        for name, p in shard.backend.parameters(chunk).items():
            state = chunk.optimizer.state.get(p)
            if state:
                out[name] = {k: v.detach().cpu().clone() if isinstance(v, Tensor) else torch.tensor(v)
                             for k, v in state.items()}
    return out


def rng_state() -> dict[str, Any]:
    """torch (CPU), numpy and python RNG states as tensors and plain numbers (weights_only-safe)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss": py_gauss}}


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))


def rank_payload(shard: Shard, step: int, data: Mapping[str, int]) -> dict[str, Any]:
    """What ``rank-<r>.pt`` holds: tensors and plain containers only (weights_only-loadable)."""
    weights = shard.replica == 0
    params = {n: p.detach().cpu().clone() for n, p in shard.parameters().items()} if weights else {}
    return {"pulse_checkpoint": FORMAT, "step": step, "rank": shard.rank,
            "layers": shard.layers() if weights else [], "params": params,
            "optimizer": optimizer_state(shard) if weights else {}, "rng": rng_state(), "data": dict(data)}


# -- saving -------------------------------------------------------------------------------------
def save(root: Path, step: int, shard: Shard, comm: Any, manifest_info: Mapping[str, Any],
         layers_by_rank: Mapping[int, list[str]], timeout: float | None = None,
         before_manifest: Callable[[], None] = lambda: None) -> Path:
    """Every rank writes ``step-<k>/rank-<r>.pt``; rank 0 then writes the manifest. Collective.

    The ranks' sizes and hashes reach rank 0 in one all-reduce of a small
    table, which is also the barrier: nobody's row is in it before its file
    is fsync'ed. ``before_manifest`` runs between the two (the fault hook).
    """
    where = step_dir(root, step)
    where.mkdir(parents=True, exist_ok=True)
    payload = rank_payload(shard, step, manifest_info["data"])
    name = f"rank-{shard.rank}.pt"
    size, sha = write_atomic_bytes(where / name, lambda f: torch.save(payload, f))
    before_manifest()
    table = torch.zeros(shard.world_size, 33, dtype=torch.int64)
    table[shard.rank, 0] = size
    table[shard.rank, 1:] = torch.tensor(list(bytes.fromhex(sha)), dtype=torch.int64)
    try:
        table = comm.all_reduce(table, list(range(shard.world_size)), timeout)
    except CommTimeout as exc:
        raise CommTimeout(f"checkpoint {where.name}, waiting for every rank's file: {exc}") from None
    if shard.rank == 0:
        files = [{"name": f"rank-{r}.pt", "rank": r, "bytes": int(row[0]),
                  "sha256": bytes(int(v) for v in row[1:].tolist()).hex(), "layers": layers_by_rank[r]}
                 for r, row in enumerate(table)]
        manifest = {"pulse_checkpoint": FORMAT, "step": step, **manifest_info, "files": files}
        text = json.dumps(manifest, indent=1) + "\n"
        write_atomic_bytes(where / MANIFEST, lambda f: f.write(text.encode()))
    return where


# -- housekeeping -----------------------------------------------------------------------------------
def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<k>`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def remove_temp_files(root: Path, keep_step: int | None = None) -> list[Path]:
    """Delete the temporary files a crash left in step directories (not in ``keep_step``'s, being written)."""
    removed = []
    for step, path in step_dirs(root):
        if step == keep_step:
            continue
        for file in path.iterdir():
            if _TEMP_FILE.match(file.name) and file.is_file():
                file.unlink(missing_ok=True)
                removed.append(file)
    return removed


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints; delete older complete and interrupted ones.

    Rank 0 calls it after writing a manifest: every rank has finished its file by then.
    """
    complete = []
    removed = []
    for step, path in reversed(step_dirs(root)):
        try:
            check_step(path, step)
        except CheckpointError:
            if complete:  # an interrupted step older than a complete one can never be resumed
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        complete.append(path)
        if len(complete) > keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# -- finding the newest complete checkpoint -------------------------------------------------------
@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    manifest: dict


def check_step(path: Path, step: int) -> dict:
    """The manifest of a complete step directory; ``CheckpointError`` saying what is wrong otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError("no manifest (interrupted while writing)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest["step"] != step or not isinstance(files, list):
            raise ValueError("step or file list mismatch")
        checks = [(path / f["name"], int(f["bytes"]), str(f["sha256"]), f["layers"]) for f in files]
        names = [str(f["name"]) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable manifest ({exc})") from None
    outside = [n for n in names if not _RANK_FILE.match(n)]
    if outside:  # '../step-5/rank-1.pt', '/etc/...': never read a file the step folder does not hold
        raise CheckpointError(f"manifest names '{outside[0][:80]}', not a rank-<r>.pt file of its own folder: refused")
    for file, size, sha, _ in checks:
        if not file.is_file():
            raise CheckpointError(f"{file.name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file.name} has {file.stat().st_size} bytes, the manifest says {size}")
        if sha256_of(file) != sha:
            raise CheckpointError(f"{file.name} does not match its sha256")
    return manifest


def find_latest(root: Path) -> tuple[Found | None, list[str]]:
    """The newest complete step under ``root`` and one note per newer step that was skipped."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        try:
            return Found(step, path, check_step(path, step)), skipped
        except CheckpointError as exc:
            skipped.append(f"{path.name}: {exc}")
    return None, skipped


# -- loading ---------------------------------------------------------------------------------------
def read_file(path: Path) -> dict[str, Any]:
    """A rank file, tensors and plain containers only; an arbitrary pickle is refused in one line."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (not a zip), EOFError, ...
        detail = re.search(r"Unsupported global: GLOBAL [\w.]+", str(exc))
        reason = detail.group(0) if detail else " ".join(str(exc).split())[:160]
        raise CheckpointError(f"{path}: refused: not a tensors-only PULSE checkpoint file "
                              f"(torch.load(weights_only=True): {reason})") from None
    if not isinstance(data, dict) or data.get("pulse_checkpoint") != FORMAT:
        raise CheckpointError(f"{path}: not a PULSE checkpoint rank file (format {FORMAT})")
    return data


def layer_files(found: Found) -> dict[str, str]:
    """Layer name -> the file (of this step) holding its parameters and optimizer state."""
    where: dict[str, str] = {}
    for f in found.manifest["files"]:
        for layer in f["layers"]:
            where.setdefault(layer, f["name"])
    return where


def _load_layer(shard: Shard, chunk: TorchChunk, layer: str, data: Mapping[str, Any], source: Path) -> None:
    optimizer = ensure_optimizer(shard.backend, chunk)
    for pname, p in chunk.layers[layer].named_parameters():
        name = f"{layer}.{pname}"
        saved = data["params"].get(name)
        if saved is None or saved.shape != p.shape:
            got = "missing" if saved is None else f"shape {tuple(saved.shape)}"
            raise CheckpointError(f"{source}: parameter '{name}' is {got}, this model's is {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(saved)
        state = data["optimizer"].get(name)
        if state:  # 'step' stays a CPU tensor, as AdamW keeps it; moments follow the parameter
            optimizer.state[p] = {k: v.clone() if k == "step" else v.to(p.device, p.dtype).clone()
                                  for k, v in state.items()}


def load(found: Found, shard: Shard) -> dict[str, Any]:
    """Load this rank's layers from whichever files hold them, and its RNG states; the data position."""
    holders = layer_files(found)
    missing = [layer for layer in shard.layers() if layer not in holders]
    if missing:
        raise CheckpointError(f"{found.path}: holds no parameters for layers {missing} (another model?)")
    by_file: dict[str, list[tuple[TorchChunk, str]]] = {}
    for chunk in shard.chunks:
        for layer in chunk.layers:
            by_file.setdefault(holders[layer], []).append((chunk, layer))
    for name, wanted in sorted(by_file.items()):
        data = read_file(found.path / name)
        for chunk, layer in wanted:
            _load_layer(shard, chunk, layer, data, found.path / name)
    saved_world = len(found.manifest["files"])
    # RNG states are per process; under another world size rank r takes saved rank r mod W.
    own = read_file(found.path / f"rank-{shard.rank % saved_world}.pt")
    set_rng_state(own["rng"])
    return dict(own["data"])


def merge_weights(path: Path, step: int) -> dict[str, Tensor]:
    """Every parameter of the complete directory ``step-<step>`` by name (``<layer>.<param>``)."""
    out: dict[str, Tensor] = {}
    for f in check_step(path, step)["files"]:
        if f["layers"]:
            out.update({n: t.clone() for n, t in read_file(path / f["name"])["params"].items()})
    return out


# -- what the launcher records ------------------------------------------------------------------------
def layers_by_rank(plan: Any, spec: Any) -> dict[int, list[str]]:
    """Global rank -> the layers its file holds: its stage's chunks on replica 0, nothing elsewhere."""
    out = {}
    for rank in range(plan.pp * plan.dp):
        stage, replica = rank % plan.pp, rank // plan.pp
        chunks = [plan.placement.chunks[c] for c in plan.placement.chunks_of(stage)] if replica == 0 else []
        out[rank] = [layer.name for c in chunks for layer in spec.layers[c.start:c.end]]
    return out


def data_position(step: int, global_batch: int, num_samples: int) -> dict[str, int]:
    """Where the sample stream is after ``step`` steps (informative: the sampler is a function of step)."""
    seen = step * global_batch
    return {"step": step, "samples_seen": seen, "epoch": seen // num_samples, "index": seen % num_samples}


def run_identity(plan: Any, spec: Any, seed: int, data_name: str) -> dict[str, Any]:
    """What makes a checkpoint this run's: model (name, options, architecture), seed and data.

    The plan's pipeline (pp, dp, placement, folds) may change on resume: checkpoints reshard.
    """
    arch = hashlib.sha256(json.dumps([[layer.name, layer.params] for layer in spec.layers]).encode()).hexdigest()
    return {"model": plan.model, "model_options": dict(sorted(plan.model_options.items())),
            "architecture": arch[:16], "seed": seed, "data": data_name}


def identity_mismatch(found: Found, identity: Mapping[str, Any]) -> list[str]:
    """How the checkpoint's run differs from ``identity`` ("key: saved -> now" each); [] if it is this run's."""
    saved = found.manifest.get("identity")
    if not isinstance(saved, dict):
        return ["it records no run identity"]
    return [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in identity.items() if saved.get(key) != value]


def manifest_info(plan: Any, spec: Any, seed: int, data: Mapping[str, int],
                  identity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"identity": dict(identity or {}), "plan": {"model": plan.model, "pp": plan.pp, "dp": plan.dp, "placement": plan.placement.kind,
                     "folds": plan.placement.folds, "microbatch_size": plan.microbatch_size,
                     "num_microbatches": plan.num_microbatches, "global_batch": plan.global_batch},
            "seed": seed, "data": dict(data), "layers": [layer.name for layer in spec.layers]}


def describe_resume(found: Found, plan: Any, seed: int, skipped: Sequence[str]) -> str:
    """One line: which step resumes, what was skipped, and what differs from the saved plan."""
    saved = found.manifest.get("plan", {})
    line = f"resume: step {found.step} from {found.path}"
    if (saved.get("pp"), saved.get("dp"), saved.get("placement")) != (plan.pp, plan.dp, plan.placement.kind):
        line += (f"; resharding pp{saved.get('pp')} x dp{saved.get('dp')} {saved.get('placement')} -> "
                 f"pp{plan.pp} x dp{plan.dp} {plan.placement.kind}")
    if saved.get("global_batch") != plan.global_batch:
        line += (f"; global batch {saved.get('global_batch')} -> {plan.global_batch}: the sample stream "
                 "continues at step x new batch, not where it stopped")
    if found.manifest.get("seed") != seed:
        line += f"; seed {found.manifest.get('seed')} -> {seed}"
    if skipped:
        line += f"; ignored incomplete {', '.join(skipped)}"
    return line
