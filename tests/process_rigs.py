"""Each backend's real multi-process check: how to launch it, and how to read what its ranks wrote.

::

    torchrun(nproc, args, out)    tests/torch_worker_check.py under torchrun's agent (gloo, CPU), launched
                                  as `pulse train` launches (pulse_torch.launch)
    msrun(out, args)              tests/mindspore_worker_check.py on 2 msrun workers (mccl all-reduce,
                                  gloo send/recv: ``pulse_mindspore.transport``)
    job_rig("torch").launch(dir)  one job running every (layout, configuration) of JOB_CASES["torch"];
                                  skips the calling test when the framework (or msrun) is missing

A configuration is ``partitioner:schedule[:mode]``: ``:ordered`` matches messages by order per
pair (NCCL's and HCCL's rule; MindSpore's communicator always does), ``:emulated`` puts every
message behind the emulated link (``--emulate-bandwidth``), the ranks booking each other's
inbound links on one board across processes. Each rank writes ``rank<r>.npz`` (its chunks'
gradients) and ``rank<r>.json`` (bytes and headers per peer, the tensors it sent, its loss).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pulse.cli.launchers import launcher_prefix
from pulse.placement import Placement
from pulse.runtime.message_order import CLASS_SPAN, sent_messages
from pulse.runtime.wiring import Wiring
from pulse.schedule.ir import Schedule
from pulse.spec import ModelSpec
from pulse.zoo import get_spec

HERE = Path(__file__).resolve().parent
TORCH_WORKER = HERE / "torch_worker_check.py"
MS_WORKER = HERE / "mindspore_worker_check.py"
MSRUN = Path(sys.executable).parent / "msrun"
MS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_v": "3"}
MODEL, MBS = "tiny-unet", 1
TORCH_TIMEOUT, MS_TIMEOUT = 180, 300  # seconds: a hung job fails its test, not the suite
# backend -> (pp, dp, configuration): what one job of that backend runs (framework-free: collected)
JOB_CASES = {
    "torch": [(pp, dp, config) for pp, dp in [(2, 2), (4, 1)] for config in
              ["pulse:greedy_v_1f1b", "sequential:1f1b", "pulse:greedy_v_1f1b:ordered", "sequential:1f1b:emulated"]],
    "mindspore": [(2, 1, config) for config in ["pulse:greedy_v_1f1b", "sequential:1f1b"]],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], out: Path) -> None:
    """Launch ``torch_worker_check`` as ``pulse train`` launches its ranks (``pulse_torch.launch``: torchrun's
    agent, its store on a port the kernel picked, ranks forked on a CPU build); fail with the ranks'
    errors when one fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    cmd = [*launcher_prefix(nproc), "-m", TORCH_WORKER.stem, "--out", str(out), *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TORCH_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in {TORCH_TIMEOUT} s: {' '.join(cmd)}\n{exc.stderr}")
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
        pytest.fail(f"torchrun failed ({done.returncode}): {' '.join(cmd)}\n" + "\n".join(errors[-20:])
                    + f"\n--- stderr tail ---\n{done.stderr[-3000:]}")


def msrun(out: Path, args: list[str]) -> None:
    """Run ``mindspore_worker_check.py`` on 2 msrun workers; fail with the workers' log tails when it fails."""
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    env = {**MS_ENV, "PULSE_GLOO_PORT": str(free_port()),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [str(MSRUN), "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(free_port()),
           "--log_dir", str(out / "logs"), "--join", "True", "python", str(MS_WORKER), "--out", str(out), *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=MS_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"msrun did not finish in {MS_TIMEOUT} s: {' '.join(cmd)}")
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("worker_*.log")))
    assert done.returncode == 0, logs


def link_boards() -> frozenset[Path]:
    """The emulated links' boards on this host (``pulse_torch.emulation.link_board``)."""
    return frozenset(p for base in (Path("/dev/shm"), Path(tempfile.gettempdir())) for p in base.glob("pulse-links-*"))


@dataclass(frozen=True)
class Job:
    """A finished job: the folder its ranks wrote to, and the link boards that existed before it."""

    out: Path
    boards_before: frozenset[Path]


@dataclass(frozen=True)
class JobRig(ABC):
    """What the backend-parametrized process test needs to know about one backend's job."""

    name: str
    spec: ModelSpec  # tiny-unet, the backend's float type on the wire
    grad_tol: float  # max_relative_error of every replica's gradients against one process
    loss_rel: float
    header_bytes: int  # one message header on the wire
    carrier: str | None  # what carries send/recv, when the record names it
    emulated_bandwidth: float | None  # bytes/s of the ":emulated" link

    @abstractmethod
    def microbatches(self, pp: int) -> int:
        """M, the microbatches of one step at ``pp`` stages."""

    @abstractmethod
    def launch(self, out: Path) -> Job:
        """Run every case of ``JOB_CASES[self.name]`` in one job writing under ``out``."""

    @abstractmethod
    def folder(self, out: Path, pp: int, dp: int, config: str) -> Path:
        """Where the ranks wrote one case's files."""

    @abstractmethod
    def plan(self, config: str, pp: int) -> tuple[Placement, Schedule]:
        """The placement and the lowered schedule the ranks ran for ``config`` at ``pp``."""

    @abstractmethod
    def reference(self, pp: int, dp: int) -> tuple[dict[str, np.ndarray], list[float]]:
        """One process training the whole model on every replica's batches: the mean gradients
        (what each replica holds after the all-reduce) and each replica's loss."""

    @abstractmethod
    def headers(self, wiring: Wiring, program: Schedule, device: int, config: str) -> int:
        """How many message headers ``device`` sends in one step."""

    @abstractmethod
    def ordered(self, config: str) -> bool:
        """Whether messages are matched by order per pair (then some are taken ahead of their turn)."""

    @abstractmethod
    def messages(self, record: dict[str, Any]) -> list[tuple[int, str, int]]:
        """(peer, tensor name, bytes) of every tensor a rank's record says it sent."""


@dataclass(frozen=True)
class TorchJobRig(JobRig):
    """One torchrun of 4 processes (float64, M = 2 x PP) runs every layout and configuration."""

    def microbatches(self, pp: int) -> int:
        return 2 * pp

    def launch(self, out: Path) -> Job:
        before = link_boards()
        args = ["--model", MODEL, "--microbatch-size", str(MBS), "--dtype", "float64", "--timeout", "60"]
        layouts = dict.fromkeys((pp, dp) for pp, dp, _ in JOB_CASES["torch"])
        configs = dict.fromkeys(config for _, _, config in JOB_CASES["torch"])
        args += [a for pp, dp in layouts for a in ("--layout", f"{pp}x{dp}")]
        args += [a for c in configs for a in ("--config", c)]
        torchrun(4, args, out)
        return Job(out, before)

    def folder(self, out: Path, pp: int, dp: int, config: str) -> Path:
        return out / f"pp{pp}xdp{dp}" / config.replace(":", "-")

    def plan(self, config: str, pp: int) -> tuple[Placement, Schedule]:
        from torch_worker_check import plan_case

        return plan_case(self.spec, *config.split(":")[:2], pp, self.microbatches(pp), MBS)

    def reference(self, pp: int, dp: int) -> tuple[dict[str, np.ndarray], list[float]]:
        return _torch_reference(pp, dp)

    def headers(self, wiring: Wiring, program: Schedule, device: int, config: str) -> int:
        if self.ordered(config):  # a header for each message class's first message only
            return len({(m.dst_device, m.key % CLASS_SPAN) for m in sent_messages(wiring, program, device)})
        # matched by tag: one header per transfer (its tensors share one payload)
        return sum(a.kind in ("SF", "SB") for a in program.actions[device])

    def ordered(self, config: str) -> bool:
        return config.endswith(":ordered")

    def messages(self, record: dict[str, Any]) -> list[tuple[int, str, int]]:
        return [(peer, name, nbytes) for peer, _, name, nbytes in record["messages"]]


@dataclass(frozen=True)
class MindSporeJobRig(JobRig):
    """One msrun job of 2 workers (float32, pp 2, M = 2) runs every configuration."""

    def microbatches(self, pp: int) -> int:
        return 2

    def launch(self, out: Path) -> Job:
        configs = [config for _, _, config in JOB_CASES["mindspore"]]
        msrun(out, ["--microbatches", str(self.microbatches(2)), "--timeout", "120",
                    *[a for c in configs for a in ("--config", c)]])
        return Job(out, frozenset())

    def folder(self, out: Path, pp: int, dp: int, config: str) -> Path:
        return out / config.replace(":", "-")

    def plan(self, config: str, pp: int) -> tuple[Placement, Schedule]:
        from mindspore_worker_check import plan_case

        return plan_case(self.spec, *config.split(":"), self.microbatches(pp))

    def reference(self, pp: int, dp: int) -> tuple[dict[str, np.ndarray], list[float]]:
        return _mindspore_reference()

    def headers(self, wiring: Wiring, program: Schedule, device: int, config: str) -> int:
        # each tensor is a message of its own: a header for each tensor class's first message only
        return len({(m.dst_device, key % CLASS_SPAN) for m in sent_messages(wiring, program, device)
                    for key in (t.as_int() for t in m.tags)})

    def ordered(self, config: str) -> bool:
        return True

    def messages(self, record: dict[str, Any]) -> list[tuple[int, str, int]]:
        return [(peer, name, nbytes) for peer, name, nbytes in record["messages"]]


def job_rig(name: str) -> JobRig:
    """The job rig of backend ``name``; skips the calling test when a framework it needs is missing
    (MindSpore's send/recv rides on torch's gloo)."""
    pytest.importorskip(name)
    if name == "torch":
        return _torch_job_rig()
    pytest.importorskip("torch")
    return _mindspore_job_rig()


@lru_cache(maxsize=None)
def _torch_job_rig() -> JobRig:
    from pulse_torch.comm import HEADER_BYTES
    from torch_worker_check import EMULATED_BANDWIDTH

    return TorchJobRig(name="torch", spec=get_spec(MODEL).with_act_bytes(8), grad_tol=1e-5, loss_rel=1e-12,
                       header_bytes=HEADER_BYTES, carrier=None, emulated_bandwidth=EMULATED_BANDWIDTH)


@lru_cache(maxsize=None)
def _mindspore_job_rig() -> JobRig:
    from mindspore_worker_check import spec_of
    from pulse_mindspore.comm import HEADER_BYTES

    # float32: skip and shared-input gradients summed in another order
    return MindSporeJobRig(name="mindspore", spec=spec_of(MODEL), grad_tol=1e-4, loss_rel=1e-6,
                           header_bytes=HEADER_BYTES, carrier="gloo", emulated_bandwidth=None)


@lru_cache(maxsize=None)
def _torch_reference(pp: int, dp: int) -> tuple[dict[str, np.ndarray], list[float]]:
    import torch
    from torch_worker_check import make_batches, reference_gradients

    spec = _torch_job_rig().spec
    return reference_gradients(spec, [make_batches(spec, MBS, r) for r in range(dp)], 2 * pp, torch.float64)


@lru_cache(maxsize=None)
def _mindspore_reference() -> tuple[dict[str, np.ndarray], list[float]]:
    """The whole model in this process (~25 s of PyNative here): the same for every configuration."""
    from mindspore_worker_check import reference_gradients

    rig = _mindspore_job_rig()
    grads, loss = reference_gradients(rig.spec, rig.microbatches(2))
    return grads, [loss]


def losses(out: Path) -> dict[int, float]:
    """Each step's loss, from a run's log.json."""
    import json

    return {s["step"]: s["loss"] for s in json.loads((out / "log.json").read_text())["steps"]}


def final(out: Path) -> dict[str, Any]:
    """The weights a --save-final run wrote (final_weights.pt)."""
    import torch

    return torch.load(out / "final_weights.pt", weights_only=True)


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same tensors under the same names, bit for bit."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
