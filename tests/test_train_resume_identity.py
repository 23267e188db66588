"""Checkpoints belong to their run; housekeeping; plans that do not fit; names that stay in runs/.

Unit tests on ``pulse_torch.checkpoint`` with hand-made step folders, then real runs:
a 4-step run keeps one checkpoint (``--checkpoints-total-limit 1``), another seed refuses it,
``--resume-any`` continues it and log.json keeps every step; broken-only checkpoints and NaN
data stop with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from pulse.cli.main import main  # noqa: E402
from pulse.train import checkpoints# noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PULSE = Path(sys.executable).parent / "pulse"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# -- step folders by hand ---------------------------------------------------------------------------
def fake_step(root: Path, step: int, names: list[str] | None = None, identity: dict | None = None) -> Path:
    """A complete step folder: rank files with matching sizes and hashes, then the manifest."""
    where = root / f"step-{step}"
    where.mkdir(parents=True)
    files = []
    for rank in range(2):
        data = f"rank {rank} at step {step}".encode()
        (where / f"rank-{rank}.pt").write_bytes(data)
        files.append({"name": (names or [])[rank] if names else f"rank-{rank}.pt", "rank": rank,
                      "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "layers": []})
    manifest = {"pulse_checkpoint": 1, "step": step, "files": files, "identity": identity or {}}
    (where / "manifest.json").write_text(json.dumps(manifest))
    return where


def test_manifest_naming_a_file_outside_its_step_is_refused(tmp_path: Path) -> None:
    fake_step(tmp_path, 5)
    fake_step(tmp_path, 6, names=["rank-0.pt", "../step-5/rank-1.pt"])
    # the file it points at exists and matches: only the path makes it wrong
    (tmp_path / "step-6" / "manifest.json").write_text(
        (tmp_path / "step-6" / "manifest.json").read_text().replace(
            hashlib.sha256(b"rank 1 at step 6").hexdigest(), hashlib.sha256(b"rank 1 at step 5").hexdigest()))
    found, skipped = checkpoints.find_latest(tmp_path)
    assert found is not None and found.step == 5
    assert len(skipped) == 1 and "not a rank-<r>.pt file of its own folder: refused" in skipped[0]
    for name in ("/etc/passwd", "sub/rank-1.pt", "rank-1.pt.bak", ".."):
        shutil.rmtree(tmp_path / "step-6")
        fake_step(tmp_path, 6, names=["rank-0.pt", name])
        with pytest.raises(checkpoints.CheckpointError, match="refused"):
            checkpoints.check_step(tmp_path / "step-6", 6)


def test_prune_keeps_the_newest_complete_and_drops_older_interrupted(tmp_path: Path) -> None:
    ident = {"model": "tiny-unet", "seed": 0}
    for step in (2, 4, 6, 8):
        fake_step(tmp_path, step, identity=ident)
    (tmp_path / "step-3").mkdir()  # interrupted, older than complete ones
    (tmp_path / "step-10").mkdir()  # interrupted, newest: may still be written, so it stays
    (tmp_path / "step-10" / "rank-0.pt").write_bytes(b"half")
    removed = checkpoints.prune(tmp_path, keep=2, identity=ident)
    assert sorted(p.name for p in removed) == ["step-2", "step-3", "step-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-6", "step-8"]


def test_temporary_files_of_a_crash_are_removed(tmp_path: Path) -> None:
    where = fake_step(tmp_path, 2)
    stale = [where / ".rank-1.pt.k2j3h4", where / ".manifest.json.abc", tmp_path / "step-4" / ".rank-0.pt.x"]
    (tmp_path / "step-4").mkdir()
    for path in stale:
        path.write_bytes(b"partial")
    keep = [where / "rank-1.pt", where / "manifest.json", where / "notes.rank-1.pt.txt"]
    keep[-1].write_text("user file")
    assert sorted(checkpoints.remove_temp_files(tmp_path)) == sorted(stale)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in stale)


def test_identity_mismatch_says_what_differs(tmp_path: Path) -> None:
    ident = {"model": "tiny-unet", "model_options": {}, "architecture": "abc", "seed": 0, "data": "synthetic"}
    found = checkpoints.Found(2, fake_step(tmp_path, 2, identity=ident), {"identity": ident})
    assert checkpoints.identity_mismatch(found, ident) == []
    assert checkpoints.identity_mismatch(found, {**ident, "seed": 1}) == ["seed 0 -> 1"]
    assert checkpoints.identity_mismatch(replace(found, manifest={}), ident) == ["it records no run identity"]


# -- real runs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--schedule", "gpipe", "--plan-only",
                 "--out-dir", str(out)]) == 0
    return out / "plan.yaml"


def train(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PULSE), "train", "--plan", str(plan), "--out-dir", str(out), *extra], env=ENV,
                          capture_output=True, text=True, timeout=300)


def entry(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Rank 0 of two, alone: everything it checks before joining the job."""
    env = {**ENV, "WORLD_SIZE": "2", "RANK": "0"}
    return subprocess.run([sys.executable, "-m", "pulse_torch.train", "--plan", str(plan), "--out-dir", str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=120)


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_resume_belongs_to_its_run_keeps_history_and_tidies(plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = train(plan, out, "--steps", "4", "--checkpoint-every", "2", "--checkpoints-total-limit", "1")
    assert first.returncode == 0, first.stderr
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-4"]  # step-2 pruned once step-4 was complete
    first_log = json.loads((out / "log.json").read_text())["steps"]
    assert [s["step"] for s in first_log] == [0, 1, 2, 3]
    stale = ckpt / "step-4" / ".rank-1.pt.crashed"
    stale.write_bytes(b"left by a crash")

    # another seed: another run's checkpoint, refused before anything starts
    refused = entry(plan, out, "--steps", "6", "--resume", "--seed", "1")
    assert refused.returncode == 2 and "another run's checkpoint (seed 0 -> 1; data" in one_line(refused)

    # every checkpoint broken: bare --resume is an error, not a silent start from step 0
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    with open(broken / "step-4" / "rank-0.pt", "ab") as handle:
        handle.write(b"x")
    done = entry(plan, out, "--steps", "6", "--resume", "--checkpoint-dir", str(broken))
    assert done.returncode == 2 and "no complete checkpoint there" in one_line(done)

    # asked for: continue it; the log keeps steps 0-3 and adds 4-5; the crash's temp file is gone
    again = train(plan, out, "--steps", "6", "--resume", "--seed", "1", "--resume-any", "--checkpoint-every", "2",
                  "--checkpoints-total-limit", "1")
    assert again.returncode == 0, again.stderr
    assert "taken on --resume-any: seed 0 -> 1" in again.stdout
    log = json.loads((out / "log.json").read_text())
    assert [s["step"] for s in log["steps"]] == [0, 1, 2, 3, 4, 5]
    assert log["steps"][:4] == first_log  # the first run's rows, as it wrote them
    # step-4 is the seed-0 run's (taken on --resume-any, not this run's): the limit never deletes it
    assert not stale.exists() and sorted(p.name for p in ckpt.iterdir()) == ["step-4", "step-6"]
    manifest = json.loads((ckpt / "step-6" / "manifest.json").read_text())
    assert manifest["identity"]["seed"] == 1 and manifest["identity"]["model"] == "tiny-unet"


def test_non_finite_loss_stops_the_run(plan: Path, tmp_path: Path) -> None:
    from pulse.cli.common import load_model
    from pulse.zoo.shapes import latent_shape

    latents = np.full((16, *latent_shape(load_model("tiny-unet"))), np.nan, dtype=np.float32)
    np.save(tmp_path / "nan.npy", latents)
    done = train(plan, tmp_path / "run", "--steps", "3", "--data", str(tmp_path / "nan.npy"))
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert "step 1: the loss is nan (non-finite); training stopped" in line


def test_plan_over_device_memory_is_refused_unless_forced(tmp_path: Path, capsys) -> None:
    big = ["train", "--model", "tiny-unet", "--pp", "2", "--model-option", "latent_size=4096", "--schedule", "gpipe",
           "--out-dir", str(tmp_path / "big")]
    assert main(big) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB per device in simulation but a cpu-local device has 24.0 GiB" in err[0]
    assert not (tmp_path / "big").exists()  # refused before writing anything
    assert main([*big, "--force", "--plan-only"]) == 0
    assert "warning (--force)" in capsys.readouterr().err
    small = ["train", "--model", "tiny-unet", "--pp", "2", "--schedule", "gpipe", "--plan-only",
             "--out-dir", str(tmp_path / "small")]
    assert main(small) == 0  # the same check lets a plan that fits through


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute-escape", "a/../../b"])
def test_model_names_stay_inside_runs(name: str, tmp_path: Path, monkeypatch, capsys) -> None:
    from pulse.cli.common import load_model
    from pulse.spec_io import save_spec

    work = tmp_path / "deep" / "er" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    save_spec(replace(load_model("tiny-unet"), name=name), work / "spec.yaml")
    assert main(["train", "--model", "spec.yaml", "--pp", "2", "--schedule", "gpipe", "--plan-only"]) == 0
    runs = list((work / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "plan.yaml").is_file()
    assert sorted(p.name for p in tmp_path.rglob("plan.yaml")) == ["plan.yaml"]
    assert not Path("/tmp/absolute-escape-pp2-dp1").exists()


@pytest.mark.parametrize("flag,value", [("--seed", "1180591620717411303424"), ("--timeout", "inf"),
                                        ("--timeout", "1e-9"), ("--lr", "1e309"), ("--lr", "nan"),
                                        ("--clip", "-1"), ("--steps", "0"), ("--checkpoint-every", "-1"),
                                        ("--checkpoints-total-limit", "0"), ("--emulate-bandwidth", "inf"),
                                        ("--trace", "."), ("--out-dir", __file__), ("--resume-an", None)])
def test_rank_entry_refuses_hostile_flags_in_one_line(flag: str, value: str | None, capsys) -> None:
    from pulse_torch.train import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--plan", "p.yaml", flag, *([value] if value is not None else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and flag in err[0], err


def test_resume_takes_latest_a_step_number_or_a_step_folder(tmp_path: Path) -> None:
    """``--resume``, ``latest``, ``N``, ``DIR``, ``DIR/step-N`` (diffusers' ``--resume_from_checkpoint``
    takes ``latest`` or a folder): each finds what it names; a step that is missing or broken is one line."""
    from types import SimpleNamespace

    from pulse.errors import PulseError
    from pulse.train.run_config import RunConfig

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_step(root, step)
    (root / "step-6" / "rank-0.pt").write_bytes(b"torn")  # the newest is broken

    def found(value: str) -> int:
        config = RunConfig(steps=10, resume=value, checkpoint_dir=str(root))
        plan = SimpleNamespace(pp=2, dp=1, placement=SimpleNamespace(kind="v"), global_batch=4)
        hit, _ = checkpoints.find_resume(config, tmp_path, plan, {}, lead=False)
        return hit.step

    assert found("") == found("latest") == found(str(root)) == 4  # newest complete; step-6 skipped
    assert found("2") == found(str(root / "step-2")) == 2
    with pytest.raises(PulseError, match=r"--resume 3: no checkpoint step-3 in .*steps there: 2, 4, 6"):
        found("3")
    with pytest.raises(PulseError, match=r"--resume 6: .*step-6 is not a complete checkpoint"):
        found("6")
