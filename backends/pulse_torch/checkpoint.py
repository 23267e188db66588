"""Checkpoints of a torchrun job: what a rank file holds (parameters, AdamW state, RNG states), how it is
written and read back. Finding, checking, pruning and choosing a checkpoint is ``pulse.train.checkpoints``'.

Files load with ``torch.load(weights_only=True)``: tensors and plain containers, never an arbitrary pickle.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from pulse.atomic_io import write_atomic_bytes
from pulse.train.checkpoints import FORMAT, MANIFEST, CheckpointError, Found, check_step, files_of_layers, step_dir
from pulse.runtime.errors import CommTimeout
from pulse_torch.backend import TorchBackend, TorchChunk, trainable
from pulse_torch.optimizers import group_state, set_group_state

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
    """The chunk's optimizer, built as ``TorchBackend.optimizer_step`` builds it (lazily, same arguments)."""
    return backend.optimizer_of(chunk)


def as_saved(t: Tensor) -> Tensor:
    """``t`` for ``torch.save``, never a second copy: a CPU tensor as it lies (torch.save writes its memory),
    a device tensor as it lies too (torch.save copies each storage to the host as it writes it, one at a
    time; the file names the device, and every reader here maps it to the CPU: ``read_file``).

    Why no ``.cpu().clone()``: on a CPU rank that doubled the rank's weights and AdamW moments while the
    file was written (an SD v2-size rank was OOM-killed writing its checkpoint). The payload is saved at
    once, between two steps, before anything updates these tensors again.
    """
    return t.detach()


def optimizer_state(shard: Shard) -> dict[str, dict[str, Any]]:
    """The optimizer's state by parameter name (its own tensors: see ``as_saved``; its plain numbers, such
    as bitsandbytes' or Adafactor's step count, as numbers); parameters that never had a gradient have none."""
    out = {}
    for chunk in shard.chunks:
        if chunk.optimizer is None:
            continue
        for name, p in shard.backend.parameters(chunk).items():
            state = chunk.optimizer.state.get(p)
            if state:
                out[name] = {k: as_saved(v) if isinstance(v, Tensor) else v for k, v in state.items()}
    return out


def optimizer_groups(shard: Shard) -> dict[str, float]:
    """What the rank's optimizer learned in its param group (Prodigy's d; nothing for the others)."""
    stepped = [c.optimizer for c in shard.chunks if c.optimizer is not None]
    return group_state(stepped[0], shard.backend.optimizer_name) if stepped else {}


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
    params = {n: as_saved(p) for n, p in shard.parameters().items()} if weights else {}
    ema = {n: as_saved(shard.backend.ema[n]) for n in params if n in shard.backend.ema}
    return {"pulse_checkpoint": FORMAT, "step": step, "rank": shard.rank,
            "layers": shard.layers() if weights else [], "params": params, "ema": ema,
            "ema_steps": shard.backend.ema_steps,  # the EMA warm-up's count (every rank's is the same)
            "optimizer": optimizer_state(shard) if weights else {},
            "optimizer_group": optimizer_groups(shard) if weights else {}, "rng": rng_state(), "data": dict(data)}


def payload_bytes(payload: Any) -> int:
    """About what ``torch.save`` writes for ``payload``: each tensor storage once and whole (a view saves
    its storage), plus each record's zip header and the pickle (a KiB a storage, a MiB in all: generous)."""
    storages: dict[tuple[str, int], int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, Tensor):
            storage = value.untyped_storage()
            storages[(str(value.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(payload)
    return sum(storages.values()) + 1024 * len(storages) + 2**20


def save(root: Path, step: int, shard: Shard, comm: Any, manifest_info: Mapping[str, Any],
         layers_by_rank: Mapping[int, list[str]], timeout: float | None = None,
         before_manifest: Callable[[], None] = lambda: None) -> Path:
    """Every rank writes ``step-<k>/rank-<r>.pt``; rank 0 then writes the manifest. Collective.

    The ranks' sizes and hashes reach rank 0 in one all-reduce of a small
    table, which is also the barrier: nobody's row is in it before its file
    is fsync'ed. ``before_manifest`` runs between the two: this rank's file is
    on disk, no manifest names it yet.
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


def _load_layer(shard: Shard, chunk: TorchChunk, layer: str, data: Mapping[str, Any], source: Path) -> None:
    # Saved under the backend's names (``<layer>.<param>`` for zoo layers, the model's own module paths
    # for a diffusers model): look each parameter up by the name the backend gives it, as save did.
    names = {id(p): n for n, p in shard.backend.parameters(chunk).items()}
    optimizer = ensure_optimizer(shard.backend, chunk) if names else None  # none: nothing trains here (LoRA)
    for p in chunk.layers[layer].parameters():
        if id(p) not in names:  # frozen (a LoRA run's base): the model's own weights, never saved
            continue
        name = names[id(p)]
        saved = data["params"].get(name)
        if saved is None or saved.shape != p.shape:
            got = "missing" if saved is None else f"shape {tuple(saved.shape)}"
            raise CheckpointError(f"{source}: parameter '{name}' is {got}, this model's is {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(saved)
        state = data["optimizer"].get(name)
        if state and optimizer is not None:
            optimizer.state[p] = {k: restored(v, p) for k, v in state.items()}
        ema = data.get("ema", {}).get(name)  # by the same name: a diffusers model's own, a zoo layer's
        if ema is not None:
            shard.backend.ema[name] = ema.to(p.device).float().clone()


def restored(saved: Any, p: Tensor) -> Any:
    """One saved state entry for parameter ``p``: a number as it was; a tensor in its saved dtype (uint8
    8-bit moments, fp32 ones), on ``p``'s device, but a 0-d one (AdamW's step, Prodigy's p0 of a zero
    tensor) on the CPU, where AdamW keeps its step."""
    if not isinstance(saved, Tensor):
        return saved
    return saved.clone() if saved.dim() == 0 else saved.to(p.device).clone()


def load(found: Found, shard: Shard) -> dict[str, Any]:
    """Load this rank's layers from whichever files hold them, and its RNG states; the data position."""
    by_file = files_of_layers(found, [(chunk, layer) for chunk in shard.chunks for layer in chunk.layers])
    for name, wanted in sorted(by_file.items()):
        data = read_file(found.path / name)
        for chunk, layer in wanted:
            _load_layer(shard, chunk, layer, data, found.path / name)
            if data.get("optimizer_group") and trainable(chunk):  # Prodigy's d, as the saving rank had it
                set_group_state(ensure_optimizer(shard.backend, chunk), data["optimizer_group"])
        if data.get("ema"):  # a file from before the count was kept: one update per step
            shard.backend.ema_steps = int(data.get("ema_steps", found.step))
    saved_world = len(found.manifest["files"])
    # RNG states are per process; under another world size rank r takes saved rank r mod W.
    own = read_file(found.path / f"rank-{shard.rank % saved_world}.pt")
    set_rng_state(own["rng"])
    return dict(own["data"])


def merge_weights(path: Path, step: int, ema: bool = False) -> dict[str, Tensor]:
    """Every parameter of the complete directory ``step-<step>`` by the backend's name for it
    (``<layer>.<param>`` for zoo layers, the model's own names such as ``conv_in.weight`` for diffusers);
    ``ema``: their moving averages instead (a run with ``--ema``)."""
    out: dict[str, Tensor] = {}
    for f in check_step(path, step)["files"]:
        if f["layers"]:
            data = read_file(path / f["name"])
            out.update({n: t.clone() for n, t in data["ema" if ema else "params"].items()})
    return out

