"""A refusal on any rank of ``pulse profile`` reaches the user, and a rank waits its turn as long as
``--timeout`` says (real processes: torchrun through ``pulse.cli.launchers.launch``, gloo, 2 ranks).

Before: only rank 0 printed its PulseError, so a refusal of rank 1 alone ended in exit 2 and no
word; a rank waiting its turn at the barrier gave up after a fixed 120 s."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse.cli.profile_cmd import job_command  # noqa: E402
from pulse.cli.main import build_parser  # noqa: E402

WORKER = Path(__file__).resolve().parent / "profile_refusal_worker.py"
LAUNCH = ("import sys; from pulse.cli.launchers import launch, launcher_prefix; "
          "sys.exit(launch(launcher_prefix(2) + sys.argv[1:]))")  # what `pulse profile` runs, its filter included
LAUNCH_TIMEOUT = 100  # seconds: less than the 120 s the turn's barrier used to wait


def profile(mode: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    job = ["--model", "tiny-unet", "--pp", "2", "--microbatch-size", "1", "--repeats", "1", "--warmup", "0",
           "--out-costs", str(tmp_path / "costs.yaml"), "--out-cluster", str(tmp_path / "cluster.yaml"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", LAUNCH, str(WORKER), mode, *job], env=env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)


def test_a_refusal_on_rank_1_alone_is_printed(tmp_path: Path) -> None:
    done = profile("refuse", tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines == ["pulse profile: rank 1: error: rank 1 cannot hold this model (planted refusal)"], done.stderr
    assert not (tmp_path / "costs.yaml").exists()


def test_a_rank_waiting_its_turn_waits_the_runs_timeout(tmp_path: Path) -> None:
    done = profile("stall", tmp_path, "--timeout", "3")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("pulse profile: rank 1: error: "), done.stderr
    assert "barrier over all 2 ranks timed out after 3 s" in lines[0] and "--timeout" in lines[0]


def test_pulse_profile_hands_its_timeout_to_every_rank(tmp_path: Path) -> None:
    args = build_parser().parse_args(["profile", "--timeout", "42.5"])
    command = job_command(args, "tiny-unet", [], 2, 1, 1, tmp_path / "c.yaml", tmp_path / "k.yaml")
    assert command[command.index("--timeout") + 1] == "42.5"
    default = build_parser().parse_args(["profile"])
    assert default.timeout == 1800.0
