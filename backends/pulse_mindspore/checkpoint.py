"""Step checkpoints of an msrun job: what a worker's file holds, how it is written and read back.
Finding, checking, pruning and choosing a checkpoint is ``pulse.train.checkpoints``' (PyTorch's too).

::

    DIR/step-6/rank-<r>.npz    numpy arrays only, read with np.load(allow_pickle=False): nothing in it runs code
        param/<layer>.<path>       the weights (replica 0 only: data-parallel replicas hold the same ones)
        exp_avg/<name>, exp_avg_sq/<name>, adam_step/<name>
                                   AdamW's moments and step count, per parameter (a chunk of another
                                   plan gathers its parameters' from whichever files hold them); with
                                   --optimizer adafactor exp_avg_sq_row/, exp_avg_sq_col/, exp_avg_sq/
                                   and its step count (pulse_mindspore.optimizers.STATE)
        ema/<name>                 the moving average (--ema)
        meta                       JSON as uint8: format, step, rank, layers, data position, fp16 loss scale,
                                   EMA update count (the warm-up's t)
    DIR/step-6/manifest.json   worker 0's, written last, once every file is on disk: sizes, sha256, the run

No random state is saved: a MindSpore run draws nothing at random as it trains
(data, noise and timesteps are functions of (seed, step, replica, microbatch),
``pulse.data.feed``; initial weights are seeded per layer name), so the step
resumes the stream. The sizes and hashes reach worker 0 through the
communicator's float32 ``sum_values`` (exact: 16-bit pieces, one worker's per slot).
"""
from __future__ import annotations

import json
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from pulse.atomic_io import write_atomic_bytes
from pulse.train import checkpoints
from pulse.train.checkpoint_space import agree_on_space
from pulse.train.checkpoints import (FORMAT, MANIFEST, CheckpointError, Found, checkpoint_root, files_of_layers,
                                       step_dir)
from pulse.layers.chunk_layout import param_name
from pulse.runtime.errors import CommTimeout
from pulse.train.loop import TrainingJob
from pulse.train.run_config import RunConfig
from pulse.train.schedules import DynamicLossScale
from pulse_mindspore.backend import MindSporeBackend, MindSporeChunk
from pulse_mindspore.optimizers import STATE, set_state, set_step, state_of, step_of

BACKEND = "mindspore"  # in the run identity: a PyTorch checkpoint is another run's
_SIZE_PIECES, _SHA_BYTES = 4, 32  # a file's row in the gathered table: its size in 16-bit pieces, its sha256
_ROW = _SIZE_PIECES + _SHA_BYTES


def run_identity(plan: Any, spec: Any, seed: int, data_name: str) -> dict[str, Any]:
    """``pulse.train.checkpoints.run_identity`` and the backend (the files' formats differ)."""
    return {**checkpoints.run_identity(plan, spec, seed, data_name), "backend": BACKEND}


@dataclass
class Shard:
    """One worker's share of the job: its chunks, where it sits, its fp16 loss scale."""

    backend: MindSporeBackend
    chunks: Sequence[MindSporeChunk]
    rank: int
    world_size: int
    replica: int  # only replica 0 saves weights
    loss_scale: DynamicLossScale | None = None

    def layers(self) -> list[str]:
        return [name for c in self.chunks for name in c.layers.keys()]


def shard_of(job: TrainingJob) -> Shard:
    layout = job.layout
    chunks = [job.executor.chunks[c] for c in sorted(job.executor.chunks)]
    return Shard(job.backend, chunks, layout.rank, layout.pp * layout.dp, layout.replica, job.loss_scale)


def layer_params(chunk: MindSporeChunk, layer: str) -> dict[str, Parameter]:
    """The parameters of one layer of ``chunk`` by the backend's name ("<layer>.<path>", ``param_name``)."""
    return {param_name(layer, path): p for path, p in chunk.layers[layer].parameters_and_names()}


# -- writing ------------------------------------------------------------------------------------------
# An array, or what makes it when the writer gets to it (a tensor's ``asnumpy``): on a device each is
# copied to the host as it is written, one at a time; on a CPU ``asnumpy`` is the tensor's own memory.
ArraySource = Union[np.ndarray, Callable[[], np.ndarray]]


def rank_arrays(shard: Shard, step: int, data: Mapping[str, int]) -> dict[str, ArraySource]:
    """What ``rank-<r>.npz`` holds (see the module doc), each tensor's array made as it is written."""
    arrays: dict[str, ArraySource] = {}
    weights = shard.replica == 0
    for chunk in shard.chunks if weights else ():
        optimizer, kind = chunk.opt.optimizer, shard.backend.optimizer_name
        adam_step = np.array(step_of(optimizer), np.int64) if optimizer is not None else None
        for i, (name, p) in enumerate(chunk.params.items()):
            arrays[f"param/{name}"] = p.asnumpy
            if optimizer is not None:
                arrays.update({f"{k}/{name}": v for k, v in state_of(optimizer, kind, i).items()})
                arrays[f"adam_step/{name}"] = adam_step
            if name in shard.backend.ema:
                arrays[f"ema/{name}"] = shard.backend.ema[name].asnumpy
    scale = shard.loss_scale
    meta = {"pulse_checkpoint": FORMAT, "backend": BACKEND, "step": step, "rank": shard.rank,
            "layers": shard.layers() if weights else [], "data": dict(data),
            "ema_steps": shard.backend.ema_steps,  # the EMA warm-up's count (every worker's is the same)
            "loss_scale": None if scale is None else
            {"scale": scale.scale, "good_steps": scale.good_steps, "skipped": scale.skipped}}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    return arrays


def arrays_bytes(arrays: Mapping[str, ArraySource]) -> int:
    """About what ``write_npz`` writes: every array's bytes (a tensor's own ``nbytes`` for one made as it is
    written: nothing is copied to count it), plus each member's headers (a KiB each, a MiB in all)."""
    def nbytes(value: ArraySource) -> int:
        return int(value.nbytes if isinstance(value, np.ndarray) else value.__self__.nbytes)  # p.asnumpy's p
    return sum(nbytes(v) for v in arrays.values()) + 1024 * len(arrays) + 2**20


def write_npz(handle: Any, arrays: Mapping[str, ArraySource]) -> None:
    """``np.savez``'s layout (one .npy per array in a zip), streamed into ``handle`` (the atomic writer's
    temporary file): no copy of the archive in memory, and one array made (``ArraySource``) at a time."""
    with zipfile.ZipFile(handle, "w") as archive:
        for key, value in arrays.items():
            array = np.asarray(value() if callable(value) else value)
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)  # 0-d stays 0-d
            del array  # before the next one is made


def gather_files(comm: Any, shard: Shard, size: int, sha: str, timeout: float | None) -> list[tuple[int, str]]:
    """Every worker's (file size, sha256) on every worker, in one sum over the world (also the barrier:
    no worker's row is in it before its file is fsync'ed)."""
    row = [0.0] * (shard.world_size * _ROW)
    at = shard.rank * _ROW
    row[at:at + _SIZE_PIECES] = [float((size >> (16 * i)) & 0xFFFF) for i in range(_SIZE_PIECES)]
    row[at + _SIZE_PIECES:at + _ROW] = [float(b) for b in bytes.fromhex(sha)]
    summed = [int(round(v)) for v in comm.sum_values(row, timeout)]
    rows = [summed[r * _ROW:(r + 1) * _ROW] for r in range(shard.world_size)]
    return [(sum(v << (16 * i) for i, v in enumerate(r[:_SIZE_PIECES])), bytes(r[_SIZE_PIECES:]).hex())
            for r in rows]


def save(root: Path, step: int, shard: Shard, comm: Any, manifest_info: Mapping[str, Any],
         layers_by_rank: Mapping[int, list[str]], timeout: float | None = None,
         before_manifest: Callable[[], None] = lambda: None) -> Path:
    """Every worker writes ``step-<k>/rank-<r>.npz``; worker 0 then the manifest. Collective."""
    where = step_dir(root, step)
    where.mkdir(parents=True, exist_ok=True)
    arrays = rank_arrays(shard, step, manifest_info["data"])
    size, sha = write_atomic_bytes(where / f"rank-{shard.rank}.npz", lambda f: write_npz(f, arrays))
    before_manifest()
    try:
        table = gather_files(comm, shard, size, sha, timeout)
    except CommTimeout as exc:
        raise CommTimeout(f"checkpoint {where.name}, waiting for every worker's file: {exc}") from None
    if shard.rank == 0:
        files = [{"name": f"rank-{r}.npz", "rank": r, "bytes": b, "sha256": h, "layers": layers_by_rank[r]}
                 for r, (b, h) in enumerate(table)]
        manifest = {"pulse_checkpoint": FORMAT, "step": step, **manifest_info, "files": files}
        text = json.dumps(manifest, indent=1) + "\n"
        write_atomic_bytes(where / MANIFEST, lambda f: f.write(text.encode()))
    return where


def saver(config: RunConfig, out_dir: Path, job: TrainingJob, data_name: str, num_samples: int):
    """The loop's checkpoint hook: every worker writes its file, worker 0 the manifest, then tidies up; a step
    whose files would not fit on the filesystem is skipped whole, on every worker (``checkpoint_space``)."""
    def save_step(step: int, preempted: str | None = None) -> None:  # preempted: the stop signal's name
        plan = job.plan
        data = checkpoints.data_position(step, plan.global_batch, num_samples)
        identity = run_identity(plan, job.spec, config.seed, data_name)
        info = checkpoints.manifest_info(plan, job.spec, config.seed, data, identity, preempted, config.optimizer)
        shard = shard_of(job)
        root = checkpoint_root(config, out_dir)
        need = arrays_bytes(rank_arrays(shard, step, data))
        space = agree_on_space(job.comm, shard.rank, shard.world_size, need, root, job.timeout)
        if not space.fits:  # every worker took the same verdict: none writes, no partial step
            if shard.rank == 0:
                print(space.warning(step, root), file=sys.stderr, flush=True)
            return
        where = save(root, step, shard, job.comm, info, checkpoints.layers_by_rank(plan, job.spec), job.timeout)
        if shard.rank == 0:  # every worker's file is on disk (the manifest waited for them): tidy up
            checkpoints.remove_temp_files(root)
            limit = config.checkpoints_total_limit
            pruned = checkpoints.prune(root, limit, identity) if limit else []
            gone = f"; removed {', '.join(p.name for p in pruned)}" if pruned else ""
            print(f"checkpoint: wrote {where}{gone}", flush=True)
    return save_step


# -- reading ------------------------------------------------------------------------------------------
@contextmanager
def rank_file(path: Path) -> Iterator[tuple[dict, Any]]:
    """A rank file's meta and its arrays (read on demand); anything but numeric arrays is refused in one line."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            meta = json.loads(arrays["meta"].tobytes().decode())
            if not isinstance(meta, dict) or meta.get("pulse_checkpoint") != FORMAT:
                raise ValueError(f"no PULSE checkpoint meta of format {FORMAT}")
            yield meta, arrays
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())[:160]
        raise CheckpointError(f"{path}: refused: not a numeric-arrays-only PULSE checkpoint file "
                              f"(np.load(allow_pickle=False): {reason})") from None


def _as(value: np.ndarray, like: Tensor, name: str, source: Path) -> Tensor:
    if tuple(value.shape) != tuple(like.shape):
        raise CheckpointError(f"{source}: '{name}' has shape {tuple(value.shape)}, this model's is {tuple(like.shape)}")
    return Tensor(np.ascontiguousarray(value), like.dtype)


def _load_layer(shard: Shard, chunk: MindSporeChunk, layer: str, arrays: Any, source: Path) -> int | None:
    """Set one layer's weights, AdamW moments and EMA from ``arrays``; its saved AdamW step (None: none saved)."""
    params = layer_params(chunk, layer)
    if not params:  # a layer without weights (a chunk of them has no AdamW to build)
        return None
    optimizer = shard.backend.optimizer_of(chunk)
    index = {name: i for i, name in enumerate(chunk.params)}
    adam_step = None
    for name, p in params.items():
        if f"param/{name}" not in arrays.files:
            raise CheckpointError(f"{source}: parameter '{name}' is missing, this model's is {tuple(p.shape)}")
        p.set_data(_as(arrays[f"param/{name}"], p, name, source))
        kinds = STATE[shard.backend.optimizer_name]
        if f"{kinds[0]}/{name}" in arrays.files:
            saved = {k: arrays[f"{k}/{name}"] for k in kinds}
            wrong = [v.shape for v in saved.values() if kinds == STATE["adamw"] and tuple(v.shape) != tuple(p.shape)]
            if wrong:  # AdamW's moments are shaped as the parameter
                raise CheckpointError(f"{source}: '{name}' has shape {tuple(wrong[0])}, this model's is "
                                      f"{tuple(p.shape)}")
            set_state(optimizer, shard.backend.optimizer_name, index[name], saved)
            adam_step = int(arrays[f"adam_step/{name}"])
        if f"ema/{name}" in arrays.files:
            shard.backend.ema[name] = Tensor(np.ascontiguousarray(arrays[f"ema/{name}"]), ms.float32)
    return adam_step


def load(found: Found, shard: Shard) -> dict[str, Any]:
    """Load this worker's layers from whichever files hold them (and its fp16 loss scale); the data position."""
    names = [f["name"] for f in found.manifest["files"]]
    foreign = [n for n in names if not n.endswith(".npz")]
    if foreign:
        raise CheckpointError(f"{found.path / foreign[0]}: written by the PyTorch backend; resume it with "
                              "--backend torch")
    wanted = files_of_layers(found, [(chunk, layer) for chunk in shard.chunks for layer in chunk.layers.keys()])
    steps: dict[int, set[int]] = {}  # chunk -> its parameters' saved AdamW steps
    for name, layers in sorted(wanted.items()):
        with rank_file(found.path / name) as (_, arrays):
            for chunk, layer in layers:
                adam_step = _load_layer(shard, chunk, layer, arrays, found.path / name)
                if adam_step is not None:
                    steps.setdefault(id(chunk), set()).add(adam_step)
    for chunk in shard.chunks:  # one count per chunk's AdamW: every saved chunk stepped as often
        if steps.get(id(chunk)):
            set_step(chunk.opt.optimizer, max(steps[id(chunk)]))
    with rank_file(found.path / f"rank-{shard.rank % len(names)}.npz") as (meta, _):
        saved_scale = meta.get("loss_scale")
        shard.backend.ema_steps = int(meta.get("ema_steps", 0))
        data = dict(meta.get("data", {}))
    if shard.loss_scale is not None and saved_scale:  # replicas hold the same: any worker's file will do
        shard.loss_scale.scale = float(saved_scale["scale"])
        shard.loss_scale.good_steps = int(saved_scale["good_steps"])
        shard.loss_scale.skipped = int(saved_scale["skipped"])
    return data
