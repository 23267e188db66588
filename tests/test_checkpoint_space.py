"""A checkpoint that would not fit on its filesystem is skipped whole, on every rank, before anything is written.

::

    every rank: [its file's bytes, the free bytes it sees] ─ one sum over the world ─ the same verdict
    too big: one warning line (rank 0), no step folder, the earlier checkpoints stay, training goes on

The free space is ``shutil.disk_usage``'s, monkeypatched here.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pulse.train import checkpoint_space
from pulse.train.checkpoint_space import HEADROOM, MIB, free_bytes, space_row, verdict

torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.layout import Layout  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.train import checkpoints  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.run_checkpoints import saver  # noqa: E402

SPEC = get_spec("tiny-unet")
GiB = 2**30


def test_every_rank_takes_the_same_verdict_from_the_summed_table() -> None:
    world = 2
    rows = [space_row(0, world, 300 * MIB, 10 * GiB), space_row(1, world, 200 * MIB, HEADROOM + 400 * MIB)]
    summed = [a + b for a, b in zip(*rows)]
    check = verdict(summed, world)
    assert (check.need_bytes, check.free_bytes) == (500 * MIB, HEADROOM + 400 * MIB)  # every file, least free
    assert not check.fits  # rank 0's disk would hold its own file: the step is skipped on both all the same
    roomy = [a + b for a, b in zip(rows[0], space_row(1, world, 200 * MIB, 10 * GiB))]
    assert verdict(roomy, world).fits
    assert space_row(0, 1, 10, 0)[0] == 1.0  # a reported need is never 0, even for a tiny file


def test_free_space_is_asked_where_the_folder_will_be(tmp_path: Path) -> None:
    assert free_bytes(tmp_path / "checkpoints" / "not-yet") == shutil.disk_usage(tmp_path).free


class OtherRanks:
    """The communicator of rank 0 in a world whose other ranks' rows are given; the manifest's table as is."""

    def __init__(self, others: list[list[float]] = ()) -> None:
        self.others = others

    def sum_values(self, values, timeout=None):
        return [v + sum(o[i] for o in self.others) for i, v in enumerate(values)]

    def all_reduce(self, t, group, timeout=None):
        return t


def rank_zero_job(pp: int, comm) -> SimpleNamespace:
    """Rank 0 of a ``pp``-deep tiny-unet plan, as the checkpoint hook reads a job."""
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2)
    placement = partition("sequential", SPEC, costs, pp, folds=1)
    plan = Plan("tiny-unet", "cpu-local", pp, 1, 2, 4, "sequential", placement)
    backend, wiring = TorchBackend(seed=0, lr=1e-3), Wiring(SPEC, placement)
    chunks = {c: backend.build_chunk(SPEC, wiring.ios[c]) for c in placement.chunks_of(0)}
    return SimpleNamespace(plan=plan, spec=SPEC, comm=comm, layout=Layout(pp, 1, 0), backend=backend,
                           executor=SimpleNamespace(chunks=chunks), timeout=None)


def fake_disk(free: int):
    def disk_usage(path):
        return shutil._ntuple_diskusage(10 * free, 9 * free, free)
    return disk_usage


def test_a_checkpoint_that_does_not_fit_is_skipped_and_the_earlier_one_stays(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    job = rank_zero_job(1, OtherRanks())
    save = saver(RunConfig(checkpoint_every=2), tmp_path, job, "synthetic", 64)
    root = tmp_path / "checkpoints"
    save(2)
    assert checkpoints.check_step(root / "step-2", 2)["step"] == 2
    file_bytes = (root / "step-2" / "rank-0.pt").stat().st_size
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", fake_disk(file_bytes))  # the file, no headroom
    capsys.readouterr()
    save(4)  # returns: the run goes on
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: checkpoint: step 4 not written: its files need "), err
    assert "training goes on, the earlier checkpoints stay" in err[0] and str(root) in err[0]
    assert not (root / "step-4").exists()  # nothing written: no folder, no temporary file
    found, skipped = checkpoints.find_latest(root)
    assert found is not None and found.step == 2 and skipped == []
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", fake_disk(file_bytes + HEADROOM + 16 * MIB))
    save(6)  # room again: written (the estimate covers the file the save then writes)
    assert checkpoints.find_latest(root)[0].step == 6


def test_a_rank_short_of_space_skips_the_step_on_every_rank(tmp_path: Path, capsys) -> None:
    full = space_row(1, 2, 10 * MIB, 0)  # rank 1's filesystem: nothing free
    save = saver(RunConfig(checkpoint_every=2), tmp_path, rank_zero_job(2, OtherRanks([full])), "synthetic", 64)
    save(2)
    assert "step 2 not written" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints" / "step-2").exists()


def test_the_estimate_covers_what_torch_save_writes(tmp_path: Path) -> None:
    job = rank_zero_job(1, OtherRanks())
    shard = checkpoint.Shard(job.backend, list(job.executor.chunks.values()), 0, 1, 0)
    for chunk in shard.chunks:  # AdamW state too: the file's bulk after the first step
        for p in chunk.parameters():
            p.grad = torch.ones_like(p)
        job.backend.optimizer_step(chunk)
    payload = checkpoint.rank_payload(shard, 1, {"step": 1})
    path = tmp_path / "rank-0.pt"
    torch.save(payload, path)
    assert path.stat().st_size <= checkpoint.payload_bytes(payload) <= path.stat().st_size + 2 * MIB
