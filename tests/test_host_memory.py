"""``pulse train``'s memory check on a CPU host: every rank's simulated peak plus the training data it
holds (``pulse.data.footprint``), summed over the ranks that share the host (``pulse.cli.host_memory``).
Planning path only: no process is launched."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from pulse.cli.host_memory import host_need, host_refusal
from pulse.cli.main import main
from pulse.data.footprint import data_bytes, synthetic_bytes
from pulse.data.sources import SyntheticLatents, smooth_fields
from pulse.hardware import load_cluster
from pulse.plan import load_plan
from pulse.train.sampler import seeded
from pulse.zoo.loading import load_model

GiB = 2**30


def test_four_ranks_that_each_fit_are_refused_when_the_host_cannot_hold_them(tmp_path: Path, capsys) -> None:
    big = ["train", "--model-option", "latent_size=512", "--pp", "2", "--dp", "2", "--plan-only",
           "--out-dir", str(tmp_path / "big")]
    assert main(big) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pulse train: error: the plan's 4 ranks on one host need "), err
    assert "GiB of training data each) but the cpu-local host has 24.0 GiB" in err[0]
    assert not (tmp_path / "big").exists()  # refused before anything is written or launched
    assert main([*big, "--force"]) == 0 and "warning (--force)" in capsys.readouterr().err
    small = ["train", "--pp", "2", "--dp", "2", "--plan-only", "--out-dir", str(tmp_path / "small")]
    assert main(small) == 0


def test_the_sum_counts_each_ranks_device_and_data(tmp_path: Path) -> None:
    assert main(["train", "--pp", "2", "--dp", "2", "--plan-only", "--out-dir", str(tmp_path / "r")]) == 0
    plan, _ = load_plan(tmp_path / "r" / "plan.yaml", load_model)
    plan = replace(plan, predicted={**plan.predicted, "peak_memory_bytes_per_device": [3 * GiB, 5 * GiB]})
    need = host_need(plan, GiB, nnodes=1)
    assert (need.ranks, need.state_bytes, need.total) == (4, 16 * GiB, 20 * GiB)
    assert host_need(plan, GiB, nnodes=2).total == 10 * GiB  # a node holds one replica: stages 0 and 1
    hardware = load_cluster("cpu-local").hardware  # 24 GiB, its ranks share it
    assert host_refusal(plan, hardware, GiB, 1) is None
    assert "need 28.0 GiB together" in host_refusal(plan, hardware, 3 * GiB, 1)
    assert host_refusal(plan, replace(hardware, shared_cores=None), 3 * GiB, 1) is None  # a device per rank


def test_the_data_a_rank_holds_is_priced() -> None:
    spec = load_model("tiny-unet", {"latent_size": 64})
    made = SyntheticLatents(spec)
    assert made._x0.nbytes <= synthetic_bytes(spec) <= 1.5 * made._x0.nbytes
    assert data_bytes(None, spec) == synthetic_bytes(spec)
    assert data_bytes(None, spec, images="imgs") == 0  # encoded a microbatch at a time


def test_files_are_priced_as_they_are_read(tmp_path: Path) -> None:
    spec = load_model("tiny-unet")
    latents = np.zeros((10, 4, 8, 8), dtype=np.float32)
    np.save(tmp_path / "l.npy", latents)
    np.savez(tmp_path / "l.npz", latents=latents, labels=np.zeros(10, dtype=np.int64))
    assert data_bytes(tmp_path / "l.npy", spec) == 0  # memory-mapped
    assert latents.nbytes + 80 <= data_bytes(tmp_path / "l.npz", spec) <= latents.nbytes + 80 + 1024  # read whole
    assert data_bytes(tmp_path, spec) == 0  # a cache folder: memory-mapped shards


def test_synthetic_data_made_in_blocks_is_the_same_bit_for_bit() -> None:
    spec = load_model("tiny-unet", {"latent_size": 16})
    made = SyntheticLatents(spec, num_samples=100, seed=3)
    protos = smooth_fields(8, made.sample_shape, seeded(3, "prototypes"))
    own = smooth_fields(100, made.sample_shape, seeded(3, "samples"))  # every sample at once, as before
    whole = ((protos[made.classes] + 0.5 * own) / np.float32(1.25 ** 0.5)).astype(np.float32)
    assert whole.tobytes() == made._x0.tobytes()
