"""Stop signals and restarts in real `pulse train` launches (torchrun, gloo, CPU, tiny-unet, pp 2).

::

    ref:      6 steps ─────────────────────────────────────────────── final weights W, losses L
    stop:     rank 0 held mid-step 3, SIGTERM to `pulse train`, released once rank 0 said it heard it
              ─ step-3 checkpointed (manifest: preempted SIGTERM), exit 143 ─ --resume to 6: W, L bit for bit
    second:   --checkpoint-every 2, the same stop, rank 0 held inside step-3's checkpoint (its file written,
              no manifest) ─ a second SIGTERM: exit 143 at once ─ step-2 whole, step-3 never loaded
    restart:  --max-restarts 1 --checkpoint-every 2, rank 1 held mid-step 4 and SIGKILLed ─ torchrun
              restarts the group, which resumes step-2 by itself ─ completes with W, L

Every wait is for an event (a line, a file the fault injection writes: tests/fault_injection), with a
deadline that only fails a hang; no verdict reads the clock. The one sleep makes the second SIGTERM a
second stop rather than a copy of the first (``DUPLICATE_S``). A launch costs ~10-20 s on a loaded
2-core machine; this file runs five.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fault_injection.pulse_faults import env_with  # noqa: E402  (tests/fault_injection: PULSE_FAULT's hooks)
from pulse.cli.main import main as pulse_main  # noqa: E402
from process_rigs import final, identical, losses  # noqa: E402
from pulse.train import checkpoints  # noqa: E402
from pulse.train.preemption import DUPLICATE_S  # noqa: E402

LAUNCH_S = 240  # a hung launch fails its test after this, instead of hanging the suite
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
ENV.pop("PULSE_FAULT", None)


class Launch:
    """`pulse train --plan PLAN ...` running, its stdout and stderr lines collected as they come."""

    def __init__(self, plan: Path, out: Path, *extra: str, fault: str | None = None, flags: Path | None = None):
        env = env_with(ENV, fault, flags) if fault else ENV
        command = [sys.executable, "-m", "pulse.cli.main", "train", "--plan", str(plan), "--out-dir", str(out),
                   "--timeout", "60", *extra]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(pipe, into), daemon=True)
                        for pipe, into in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, into: list[str]) -> None:
        for line in pipe:
            into.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.out + self.err)

    def wait_until(self, ready, what: str) -> None:
        deadline = time.monotonic() + LAUNCH_S
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"never saw {what}:\n" + "\n".join((self.out + self.err)[-40:]))
            time.sleep(0.1)

    def finish(self) -> int:
        try:
            code = self.process.wait(timeout=LAUNCH_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def tail(self) -> str:
        return "\n".join((self.out + self.err)[-40:])


def run(plan: Path, out: Path, *extra: str) -> Launch:
    launch = Launch(plan, out, *extra)
    assert launch.finish() == 0, launch.tail()
    return launch


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    assert pulse_main(["train", "--model", "tiny-unet", "--pp", "2", "--num-microbatches", "4",
                       "--microbatch-size", "2", "--schedule", "gpipe", "--plan-only", "--out-dir", str(out)]) == 0
    return out / "plan.yaml"


@pytest.fixture(scope="module")
def ref(plan: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    run(plan, out, "--steps", "6", "--save-final")
    return out


def stop_in_step_3(launch: Launch, flags: Path) -> None:
    """Rank 0 is held mid-step 3: SIGTERM to `pulse train`, and once rank 0 said it heard it, go on."""
    launch.wait_until(lambda: (flags / "held-hold-rank-0").exists(), "rank 0 held in step 3")
    launch.process.send_signal(signal.SIGTERM)
    launch.wait_until(lambda: launch.said("pulse: SIGTERM: finishing this step"), "rank 0 hearing SIGTERM")
    (flags / "release-hold").touch()


def test_sigterm_checkpoints_the_step_in_progress_and_resume_ends_as_the_uninterrupted_run(
        plan: Path, ref: Path, tmp_path: Path) -> None:
    out, flags = tmp_path / "run", tmp_path / "flags"
    flags.mkdir()
    launch = Launch(plan, out, "--steps", "6", fault="hold:rank=0:step=3", flags=flags)
    stop_in_step_3(launch, flags)
    assert launch.finish() == 128 + signal.SIGTERM, launch.tail()
    step3 = out / "checkpoints" / "step-3"
    manifest = checkpoints.check_step(step3, 3)  # complete: every file there, sizes and hashes as recorded
    assert manifest["preempted"] == "SIGTERM" and len(manifest["files"]) == 2
    assert sorted(losses(out)) == [0, 1, 2]
    assert launch.said("preempted: SIGTERM after step 3") and launch.said("pulse train: stopped by SIGTERM")
    assert not any("Traceback" in line for line in launch.err), launch.tail()

    resumed = run(plan, out, "--steps", "6", "--resume", "--save-final")
    assert resumed.said("resume: step 3 from") and resumed.said("(written when SIGTERM stopped the run)")
    assert losses(out) == losses(ref)  # exact floats, the first three from before the stop
    assert identical(final(out), final(ref))


def test_a_second_sigterm_during_the_checkpoint_exits_at_once_and_leaves_the_previous_one_whole(
        plan: Path, tmp_path: Path) -> None:
    out, flags = tmp_path / "run", tmp_path / "flags"
    flags.mkdir()
    launch = Launch(plan, out, "--steps", "6", "--checkpoint-every", "2",
                    fault="hold:rank=0:step=3,hold-in-preempt-checkpoint", flags=flags)
    stop_in_step_3(launch, flags)
    launch.wait_until(lambda: (flags / "held-hold-in-preempt-checkpoint-rank-0").exists(),
                      "rank 0 held inside step-3's checkpoint")
    time.sleep(DUPLICATE_S + 1.0)  # a second stop, not the first one delivered twice
    launch.process.send_signal(signal.SIGTERM)
    assert launch.finish() == 128 + signal.SIGTERM, launch.tail()  # never released: it left at once
    root = out / "checkpoints"
    assert (root / "step-3" / "rank-0.pt").is_file() and not (root / "step-3" / "manifest.json").exists()
    found, skipped = checkpoints.find_latest(root)
    assert found.step == 2 and skipped == ["step-3: no manifest (interrupted while writing)"]
    assert "preempted" not in found.manifest  # step-2 is the regular checkpoint, whole (check_step: every hash)


def test_a_rank_killed_under_max_restarts_resumes_by_itself_and_ends_as_the_uninterrupted_run(
        plan: Path, ref: Path, tmp_path: Path) -> None:
    out, flags = tmp_path / "run", tmp_path / "flags"
    flags.mkdir()
    launch = Launch(plan, out, "--steps", "6", "--checkpoint-every", "2", "--max-restarts", "1", "--save-final",
                    fault="hold:rank=1:step=4", flags=flags)
    held = flags / "held-hold-rank-1"
    launch.wait_until(held.exists, "rank 1 held in step 4")
    os.kill(int(held.read_text()), signal.SIGKILL)
    assert launch.finish() == 0, launch.tail()
    resumed = [line for line in launch.out if line.startswith("resume:")]
    assert len(resumed) == 1 and "resume: step 2 from" in resumed[0] and "restart 1: resumed by itself" in resumed[0]
    assert losses(out) == losses(ref)
    assert identical(final(out), final(ref))
