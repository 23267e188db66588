"""Checkpoint files in one process: atomic writes, finding the newest complete step, refusing
pickles, and loading a checkpoint saved under one placement into another's chunks, bit for bit.

The real multi-process launches (stop/resume, crash, resharding, dead peer) are in
tests/test_fault_tolerance.py.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Placement  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402
from pulse.atomic_io import write_atomic_bytes  # noqa: E402
from pulse.train import checkpoints  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from fault_injection import pulse_faults as faults  # noqa: E402  (tests/fault_injection)

SPEC = get_spec("tiny-unet")
COSTS = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2)


class TableComm:
    """``all_reduce`` for ranks saved one after another in one process: rank 0 goes last and sees
    the sum of every row (the real all-reduce is also the barrier before the manifest)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def all_reduce(self, t: torch.Tensor, group: list[int], timeout: float | None = None) -> torch.Tensor:
        self.total = t.clone() if self.total is None else self.total + t
        return self.total.clone()


def plan_for(kind: str, pp: int, dp: int = 1) -> Plan:
    placement = partition("sequential" if kind == "sequential" else "pulse", SPEC, COSTS, pp, folds=1)
    return Plan("tiny-unet", "cpu-local", pp, dp, 2, 4, "pulse", placement)


def shards(plan: Plan, seed: int) -> list[checkpoint.Shard]:
    """Every rank's chunks of ``plan`` (weights seeded by layer name, as on a real rank)."""
    backend, wiring = TorchBackend(seed=seed, lr=1e-3), Wiring(SPEC, plan.placement)
    out = []
    for rank in range(plan.pp * plan.dp):
        stage = rank % plan.pp
        chunks = [backend.build_chunk(SPEC, wiring.ios[c]) for c in plan.placement.chunks_of(stage)]
        out.append(checkpoint.Shard(backend, chunks, rank, plan.pp * plan.dp, rank // plan.pp))
    return out


def train_one_step(shard: checkpoint.Shard, seed: int) -> None:
    """A fake AdamW step with seeded gradients: moments and 'step' become non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    for chunk in shard.chunks:
        for p in chunk.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        shard.backend.optimizer_step(chunk)


def save_all(root: Path, plan: Plan, ranks: list[checkpoint.Shard], step: int) -> Path:
    comm, info = TableComm(), checkpoints.manifest_info(plan, SPEC, 0, checkpoints.data_position(step, 8, 1024))
    for shard in sorted(ranks, key=lambda s: -s.rank):  # rank 0 last: it writes the manifest
        where = checkpoint.save(root, step, shard, comm, info, checkpoints.layers_by_rank(plan, SPEC))
    return where


@pytest.fixture(scope="module")
def saved_v2(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A P=2 V checkpoint after one step; its parameters and AdamW moments by name."""
    root = tmp_path_factory.mktemp("v2")
    plan = plan_for("v", 2)
    ranks = shards(plan, seed=0)
    for shard in ranks:
        train_one_step(shard, seed=shard.rank)
    params = {n: p.detach().clone() for s in ranks for n, p in s.parameters().items()}
    moments = {n: {k: v.clone() for k, v in state.items()}
               for s in ranks for n, state in checkpoint.optimizer_state(s).items()}
    save_all(root, plan, ranks, 1)
    return root, params, moments


def test_atomic_write_reports_size_and_hash_and_leaves_nothing_when_it_fails(tmp_path: Path) -> None:
    size, sha = write_atomic_bytes(tmp_path / "a.bin", lambda f: f.write(b"hello"))
    assert (tmp_path / "a.bin").read_bytes() == b"hello" and size == 5
    assert sha == checkpoints.sha256_of(tmp_path / "a.bin")

    def crash(f) -> None:
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic_bytes(tmp_path / "a.bin", crash)
    assert (tmp_path / "a.bin").read_bytes() == b"hello"  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]  # no temporary left


def test_the_newest_complete_step_wins_and_the_others_are_named(saved_v2, tmp_path: Path) -> None:
    import shutil

    src, _, _ = saved_v2
    for step in (3, 6, 9, 12):
        shutil.copytree(src / "step-1", tmp_path / f"step-{step}")
        manifest = json.loads((tmp_path / f"step-{step}" / "manifest.json").read_text())
        manifest["step"] = step
        (tmp_path / f"step-{step}" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "step-6" / "manifest.json").unlink()  # crashed before the manifest
    with open(tmp_path / "step-9" / "rank-1.pt", "r+b") as f:  # same size, one byte flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    (tmp_path / "step-12" / "rank-0.pt").unlink()
    found, skipped = checkpoints.find_latest(tmp_path)
    assert found is not None and found.step == 3
    assert skipped == ["step-12: rank-0.pt is missing", "step-9: rank-1.pt does not match its sha256",
                       "step-6: no manifest (interrupted while writing)"]
    assert checkpoints.find_latest(tmp_path / "nowhere") == (None, [])


class Boom:
    """Unpickling this would run ``Path.touch``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_file_holding_an_arbitrary_pickle_is_refused_in_one_line(saved_v2, tmp_path: Path) -> None:
    import shutil

    src, _, _ = saved_v2
    shutil.copytree(src / "step-1", tmp_path / "step-1")
    marker = tmp_path / "pwned"
    evil = torch.load(tmp_path / "step-1" / "rank-1.pt", weights_only=True)
    evil["params"]["extra"] = Boom(marker)
    torch.save(evil, tmp_path / "step-1" / "rank-1.pt")
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())  # a consistent manifest
    entry = manifest["files"][1]
    entry["bytes"] = (tmp_path / "step-1" / "rank-1.pt").stat().st_size
    entry["sha256"] = checkpoints.sha256_of(tmp_path / "step-1" / "rank-1.pt")
    (tmp_path / "step-1" / "manifest.json").write_text(json.dumps(manifest))
    found, _ = checkpoints.find_latest(tmp_path)
    assert found is not None
    with pytest.raises(checkpoints.CheckpointError) as info:
        checkpoint.load(found, shards(plan_for("v", 2), seed=5)[1])
    text = str(info.value)
    print(text)
    assert "\n" not in text and "rank-1.pt: refused" in text and "Unsupported global" in text
    assert not marker.exists()  # the pickle never ran


@pytest.mark.parametrize("kind,pp,dp", [("v", 4, 1), ("sequential", 4, 1), ("v", 2, 2), ("sequential", 1, 1)])
def test_a_v2_checkpoint_loads_bit_exactly_under_another_plan(saved_v2, kind: str, pp: int, dp: int) -> None:
    root, params, moments = saved_v2
    found, _ = checkpoints.find_latest(root)
    assert found is not None
    plan = plan_for(kind, pp, dp)
    seen = set()
    for shard in shards(plan, seed=7):  # other initial weights: everything must come from the files
        checkpoint.load(found, shard)
        for chunk in shard.chunks:
            for name, p in shard.backend.parameters(chunk).items():
                assert torch.equal(p.detach(), params[name]), name
                state = chunk.optimizer.state[p]
                assert state.keys() == moments[name].keys()
                assert all(torch.equal(state[k], moments[name][k]) for k in state), name
                seen.add(name)
    assert seen == set(params)
    merged = checkpoint.merge_weights(found.path, found.step)
    assert merged.keys() == params.keys() and all(torch.equal(merged[n], params[n]) for n in params)


def test_only_replica_0_saves_weights() -> None:
    layers = checkpoints.layers_by_rank(plan_for("v", 2, 2), SPEC)
    assert sorted(layers[0] + layers[1]) == sorted(layer.name for layer in SPEC.layers)
    assert layers[2] == layers[3] == []


def test_a_shape_mismatch_names_the_parameter(saved_v2, tmp_path: Path) -> None:
    root, _, _ = saved_v2
    found, _ = checkpoints.find_latest(root)
    shard = shards(plan_for("v", 2), seed=0)[0]
    layer = next(iter(shard.chunks[0].layers.values()))
    name, p = next(iter(layer.named_parameters()))
    p.data = torch.zeros(p.numel() + 1)
    with pytest.raises(checkpoints.CheckpointError, match=rf"'\w+\.{name}' is shape .* this model's is"):
        checkpoint.load(found, shard)


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    state = checkpoint.rng_state()
    write_atomic_bytes(tmp_path / "rng.pt", lambda f: torch.save({"rng": state}, f))
    want = (torch.rand(3), np.random.rand(3), random.random(), np.random.standard_normal())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random(), np.random.standard_normal())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]


def test_fault_specs_parse_and_typos_are_errors() -> None:
    assert faults.parse("die:rank=2:step=2") == faults.Fault("die", 2, 2)
    assert faults.parse("crash-during-checkpoint:step=6") == faults.Fault("crash-during-checkpoint", 0, 6)
    for bad in ("die:step=2", "explode:step=1", "die:rank=two:step=1", "crash-during-checkpoint"):
        with pytest.raises(PulseError, match="PULSE_FAULT"):
            faults.parse(bad)


def test_the_product_holds_no_fault_injection() -> None:
    """``PULSE_FAULT`` is the tests' (tests/fault_injection wraps the product from outside): no file of
    pulse/ or backends/ reads it or calls a fault hook."""
    root = Path(__file__).resolve().parents[1]
    found = [str(path.relative_to(root)) for folder in ("pulse", "backends") for path in (root / folder).rglob("*.py")
             if any(word in path.read_text() for word in ("PULSE_FAULT", "maybe_fail", "fault_injection"))]
    assert found == []


def test_the_placement_helper_builds_real_placements() -> None:
    assert isinstance(plan_for("v", 4).placement, Placement) and plan_for("v", 4).placement.kind == "v"
    assert plan_for("sequential", 4).placement.kind == "sequential"
