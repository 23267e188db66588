"""MindSpore step checkpoints (``pulse_mindspore.checkpoint``) and ``--resume`` on msrun workers.

In one process: a worker's file round-trips weights, AdamW moments and step count, EMA and the
fp16 loss scale into the chunks of another placement (resharding), and the next AdamW step from
the loaded state equals the one from the saved state bit for bit; a file holding a pickled object
and a PyTorch checkpoint are refused in one line. Then real msrun jobs on CPU (tiny-unet, pp 2,
2 microbatches of one sample, --ema): 4 steps with a checkpoint after every step, at most 3 kept;
a copy of its run folder with step 4's file damaged and step 3 interrupted resumes from step 2
and ends with the same losses, weights and EMA bit for bit; another seed's resume is refused
before the workers join the cluster. Skipped without MindSpore, torch (CPU pipelines send over
its gloo) or msrun.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from pulse.train import checkpoints# noqa: E402
from pulse.train.checkpoints import CheckpointError, Found  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.schedules import DynamicLossScale  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_mindspore import checkpoint
from pulse_mindspore.optimizers import step_of  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402
from mindspore_worker_check import make_batches  # noqa: E402
from pulse_mindspore.diffusion import eps_loss  # noqa: E402

MODEL = "tiny-uvit"
MSRUN = Path(sys.executable).parent / "msrun"
LAUNCH_TIMEOUT = 300  # a hung job fails its test, not the suite
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_v": "3"}


class OneRank:
    """The communicator of a world of one: the sum of the file table is the table."""

    def sum_values(self, values, timeout=None):
        return [float(v) for v in values]


def chunks_for(backend: MindSporeBackend, partitioner: str) -> list:
    """Every chunk of a 2-device placement of MODEL, in one process (one shard holds them all)."""
    spec = get_spec(MODEL).with_act_bytes(4)
    placement = partition(partitioner, spec, AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1), 2)
    kind = "greedy_v_1f1b" if partitioner == "pulse" else "1f1b"
    run = local_run(spec, placement, lower(make_schedule(kind, placement, 2), spec, placement), backend,
                    make_batches(spec, 1), eps_loss)
    return [ex.chunks[c] for ex in run.executors for c in sorted(ex.chunks)]


def step_all(backend: MindSporeBackend, chunks: list, seed: int) -> None:
    """One AdamW step of every chunk on seeded gradients (by parameter name: any placement alike)."""
    for c in chunks:
        grads = {n: np.random.default_rng([seed, sum(map(ord, n))]).standard_normal(p.shape).astype(np.float32)
                 for n, p in backend.parameters(c).items()}
        backend.set_gradients(c, grads)
        backend.optimizer_step(c)


def state_of(backend: MindSporeBackend, chunks: list) -> dict[str, np.ndarray]:
    out = {}
    for c in chunks:
        opt = c.opt.optimizer
        for i, (n, p) in enumerate(c.params.items()):
            out[f"param/{n}"], out[f"ema/{n}"] = p.asnumpy(), backend.ema[n].asnumpy()
            out[f"m/{n}"], out[f"v/{n}"] = opt.exp_avg[i].asnumpy(), opt.exp_avg_sq[i].asnumpy()
            out[f"step/{n}"] = np.array(step_of(opt))
    return out


def save_one(root: Path, step: int, shard: checkpoint.Shard) -> Found:
    info = {"identity": {"model": MODEL}, "data": {"step": step}}
    checkpoint.save(root, step, shard, OneRank(), info, {0: shard.layers()})
    found, skipped = checkpoints.find_latest(root)
    assert skipped == [] and found is not None and found.step == step
    return found


def test_a_rank_file_round_trips_the_state_under_another_placement(tmp_path: Path) -> None:
    saved = MindSporeBackend(lr=1e-2, weight_decay=0.1)
    chunks = chunks_for(saved, "pulse")
    for step in range(3):
        step_all(saved, chunks, step)
        saved.ema_update(chunks, 0.9)
    scale = DynamicLossScale(scale=1024.0, good_steps=7, skipped=2)
    found = save_one(tmp_path, 3, checkpoint.Shard(saved, chunks, 0, 1, 0, scale))
    assert [f["name"] for f in found.manifest["files"]] == ["rank-0.npz"]
    with np.load(found.path / "rank-0.npz", allow_pickle=False) as arrays:  # numbers only, no pickle needed
        assert all(arrays[k].dtype != object for k in arrays.files)

    loaded = MindSporeBackend(lr=1e-2, weight_decay=0.1, seed=5)  # other initial weights, other chunks
    other = chunks_for(loaded, "sequential")
    mine = DynamicLossScale()
    assert checkpoint.load(found, checkpoint.Shard(loaded, other, 0, 1, 0, mine)) == {"step": 3}
    assert (mine.scale, mine.good_steps, mine.skipped) == (1024.0, 7, 2)
    before, after = state_of(saved, chunks), state_of(loaded, other)
    assert before.keys() == after.keys() and int(after[next(k for k in after if k.startswith("step/"))]) == 3
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []
    step_all(saved, chunks, 3)  # the state AdamW goes on from is the whole state: the next step agrees
    step_all(loaded, other, 3)
    before, after = state_of(saved, chunks), state_of(loaded, other)
    assert [k for k in before if k.startswith("param/") and not np.array_equal(before[k], after[k])] == []


def test_the_free_space_estimate_covers_the_written_file(tmp_path: Path) -> None:
    backend = MindSporeBackend()
    chunks = chunks_for(backend, "pulse")
    step_all(backend, chunks, 0)  # AdamW's moments too
    backend.ema_update(chunks, 0.9)
    shard = checkpoint.Shard(backend, chunks, 0, 1, 0)
    estimate = checkpoint.arrays_bytes(checkpoint.rank_arrays(shard, 1, {"step": 1}))  # nothing copied to count
    written = save_one(tmp_path, 1, shard).path / "rank-0.npz"
    assert written.stat().st_size <= estimate <= written.stat().st_size + 2**21


def test_pickles_and_pytorch_checkpoints_are_refused_in_one_line(tmp_path: Path) -> None:
    backend = MindSporeBackend()
    chunks = chunks_for(backend, "pulse")
    found = save_one(tmp_path, 1, checkpoint.Shard(backend, chunks, 0, 1, 0))
    buffer = io.BytesIO()  # the same file with one member replaced by a pickled object array
    with zipfile.ZipFile(found.path / "rank-0.npz") as old, zipfile.ZipFile(buffer, "w") as new:
        for name in old.namelist():
            if name.startswith("param/"):
                np.save(new.open(name, "w"), np.array([{"run": "code"}], dtype=object), allow_pickle=True)
                continue
            new.writestr(name, old.read(name))
    (found.path / "rank-0.npz").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match=r"rank-0\.npz: refused: not a numeric-arrays-only PULSE checkpoint "
                                              r"file \(np\.load\(allow_pickle=False\): Object arrays cannot be loaded"):
        checkpoint.load(found, checkpoint.Shard(backend, chunks, 0, 1, 0))
    as_torch = [{**found.manifest["files"][0], "name": "rank-0.pt"}]
    torch_made = Found(1, found.path, {**found.manifest, "files": as_torch})
    with pytest.raises(CheckpointError, match=r"rank-0\.pt: written by the PyTorch backend; resume it with --backend "
                                              r"torch$"):
        checkpoint.load(torch_made, checkpoint.Shard(backend, chunks, 0, 1, 0))


# -- msrun ---------------------------------------------------------------------------------------
def pulse_train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--backend", "mindspore", "--model", "tiny-unet",
           "--pp", "2", "--num-microbatches", "2", "--microbatch-size", "1", "--ema", "0.9", "--timeout", "120",
           "--out-dir", str(out), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("ms_ckpt") / "whole"
    done = pulse_train(out, "--steps", "4", "--checkpoint-every", "1", "--checkpoints-total-limit", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def losses(out: Path) -> list[float]:
    return [s["loss"] for s in json.loads((out / "log.json").read_text())["steps"]]


def test_a_resumed_msrun_job_ends_as_the_uninterrupted_one_bit_for_bit(whole_run: Path) -> None:
    ckpt = whole_run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-3", "step-4"]  # step-1 pruned
    manifest = json.loads((ckpt / "step-4" / "manifest.json").read_text())
    assert [f["name"] for f in manifest["files"]] == ["rank-0.npz", "rank-1.npz"]
    assert manifest["identity"]["backend"] == "mindspore" and manifest["data"]["step"] == 4
    # a crash: step 4's second file damaged on disk, step 3 interrupted before its manifest
    crashed = whole_run.parent / "crashed"
    crashed.mkdir()
    shutil.copy(whole_run / "log.json", crashed / "log.json")
    shutil.copytree(ckpt, crashed / "checkpoints")
    damaged = crashed / "checkpoints" / "step-4" / "rank-1.npz"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    (crashed / "checkpoints" / "step-3" / "manifest.json").unlink()

    done = pulse_train(crashed, "--steps", "4", "--checkpoint-every", "1", "--checkpoints-total-limit", "3",
                       "--resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (f"resume: step 2 from {crashed / 'checkpoints' / 'step-2'}; ignored incomplete step-4: rank-1.npz does "
            "not match its sha256, step-3: no manifest (interrupted while writing)") in done.stdout
    assert "2/2" in done.stdout  # two steps trained, not four
    assert losses(crashed) == losses(whole_run) and len(losses(whole_run)) == 4
    for name in ("weights_rank0.npz", "weights_rank1.npz", "ema_rank0.npz", "ema_rank1.npz"):
        with np.load(whole_run / name) as want, np.load(crashed / name) as got:
            assert want.files == got.files and len(want.files) > 10
            assert [k for k in want.files if not np.array_equal(want[k], got[k])] == [], name
    # the resumed run rewrote steps 3 and 4 whole and kept its limit
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step-2", "step-3", "step-4"]
    assert checkpoints.find_latest(crashed / "checkpoints")[0].step == 4


def test_another_runs_checkpoint_is_refused_before_the_workers_join(whole_run: Path) -> None:
    refused = pulse_train(whole_run, "--steps", "6", "--seed", "1", "--resume")
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    lines = [x for x in (refused.stdout + refused.stderr).splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and "is another run's checkpoint (seed 0 -> 1; data" in lines[0], lines
    assert "Traceback" not in refused.stderr
