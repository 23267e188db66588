"""MindSpore launch path: `pulse train --backend mindspore` under msrun, and the MindSpore communicator.

One real msrun job on CPU (mccl): tiny-unet, pp 1 x dp 2, one microbatch of
one sample, 3 steps (MindSpore's PyNative CPU kernels take seconds per
step); both workers must end with identical weights. A second msrun job is
started with the wrong worker count and must stop at once with one line.
Point-to-point messages need Ascend (HCCL); here stand-ins for the
communication library check the CPU refusal and the Ascend wire protocol
(header + payload, out-of-order drains, byte counts, timeouts). Skipped
without MindSpore.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Parameter, Tensor  # noqa: E402

from pulse.cli.msrun_launch import MsrunOutput, free_port, msrun_env  # noqa: E402
from pulse.cli.launchers import launch  # noqa: E402
from pulse.errors import PlanError  # noqa: E402
from pulse.runtime.errors import CommTimeout  # noqa: E402
from pulse.runtime.protocols import Communicator  # noqa: E402
from pulse.runtime.wiring import MessageTag  # noqa: E402
from pulse_mindspore.comm import HEADER_BYTES, MindSporeCommunicator, decode_header, encode_header  # noqa: E402

LAUNCH_TIMEOUT = 240  # a hung job fails its test, not the suite
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MSRUN = Path(sys.executable).parent / "msrun"


def pulse_train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--backend", "mindspore", "--model", "tiny-unet",
           "--out-dir", str(out), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    out = tmp_path_factory.mktemp("msrun_dp2")
    done = pulse_train(out, "--pp", "1", "--dp", "2", "--steps", "3", "--microbatch-size", "1",
                       "--num-microbatches", "1", "--timeout", "120")
    return out, done


# -- msrun on CPU ---------------------------------------------------------------------------
def test_data_parallel_workers_end_with_identical_weights(dp_run) -> None:
    out, done = dp_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, second = np.load(out / "weights_rank0.npz"), np.load(out / "weights_rank1.npz")
    assert first.files == second.files and len(first.files) > 100  # every parameter, by checkpoint name
    different = [k for k in first.files if not np.array_equal(first[k], second[k])]
    assert different == []
    log = json.loads((out / "log.json").read_text())
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert all(s["pipeline_bytes"] == 0 and s["allreduce_bytes"] > 0 for s in log["steps"])
    assert log["run"]["framework"].startswith("mindspore") and log["run"]["dp"] == 2
    assert (out / "loss.png").stat().st_size > 0
    assert "3/3" in done.stdout and "done: loss" in done.stdout  # worker 0's progress, tailed by msrun


def test_wrong_worker_count_is_one_line_and_exit_2(tmp_path: Path, capfd) -> None:
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    out = tmp_path
    assert pulse_train(out, "--pp", "1", "--dp", "2", "--plan-only").returncode == 0
    capfd.readouterr()
    command = [str(MSRUN), "--worker_num", "1", "--local_worker_num", "1", "--master_port", str(free_port()),
               "--log_dir", str(out / "wrong_logs"), "--join", "True",
               "python", "-m", "pulse_mindspore.train", "--plan", str(out / "plan.yaml"), "--steps", "1"]  # 1 of 2
    assert launch(command, MsrunOutput(), msrun_env(ENV)) == 2
    seen = capfd.readouterr()
    lines = [x for x in (seen.out + seen.err).splitlines() if "error" in x.lower()]
    assert lines == ["pulse_mindspore.train: error: the plan needs pp x dp = 1 x 2 = 2 workers but msrun "
                     "started 1; launch with msrun --worker_num 2 --local_worker_num 2 (or re-plan for 1)"]
    assert "Traceback" not in seen.err  # msrun's own traceback is summarised away


def test_pipeline_plans_need_ascend(tmp_path: Path) -> None:
    if Path("/dev/davinci0").exists():
        pytest.skip("this machine has Ascend NPUs")
    done = pulse_train(tmp_path, "--pp", "2", "--dp", "1", "--steps", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pulse train: error: --pp 2 with --backend mindspore needs Ascend NPUs (none found: no /dev/davinci*): "
        "MindSpore's CPU collectives (mccl) have no point-to-point send/recv, which pipeline stages need; "
        "use --pp 1 (data parallel) here, or --backend torch"]
    # Started by hand anyway, the entry refuses the pipeline before joining a cluster.
    env = {**ENV, "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "RANK_ID": "0"}
    entry = subprocess.run([sys.executable, "-m", "pulse_mindspore.train", "--plan", str(tmp_path / "plan.yaml")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert entry.returncode == 2
    assert entry.stderr.startswith("pulse_mindspore.train: error: this plan pipelines over pp 2 workers, "
                                   "but point-to-point send/recv needs Ascend (HCCL)")


# -- the communicator with stand-ins for MindSpore's communication library --------------------
class Done:
    def wait(self) -> None:
        pass


class Never:
    """A handle whose operation never completes (a peer that never comes)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self) -> None:
        self.release.wait()


class FakeLib:
    """isend/irecv over in-memory queues (HCCL-like: no tags, order per pair), all_reduce never ends."""

    def __init__(self, wire: dict, rank: int) -> None:
        self.wire, self.rank, self.calls = wire, rank, []
        self.stuck = Never()

    def isend(self, tensor, dst, group, tag):
        self.calls.append("isend")
        self.wire[(self.rank, dst)].append(tensor.asnumpy().copy())
        return Done()

    def irecv(self, tensor, src, group, tag):
        self.calls.append("irecv")
        data = self.wire[(src, self.rank)].popleft()
        assert data.shape == tuple(tensor.shape) and data.dtype == tensor.asnumpy().dtype
        return Tensor(data), Done()  # comm_func's convention; ops.communication's in-place one is a bare handle

    def all_reduce(self, tensor, group, async_op):
        self.calls.append(f"all_reduce:{group}")
        return self.stuck


def management(rank: int, size: int = 2) -> SimpleNamespace:
    made = []
    return SimpleNamespace(get_rank=lambda: rank, get_group_size=lambda: size, made=made,
                           create_group=lambda name, ranks: made.append((name, ranks)),
                           GlobalComm=SimpleNamespace(WORLD_COMM_GROUP="hccl_world_group"))


def pair(device: str) -> tuple[MindSporeCommunicator, MindSporeCommunicator]:
    wire: dict = defaultdict(deque)
    return tuple(MindSporeCommunicator(device_target=device, lib=FakeLib(wire, r), management=management(r))
                 for r in (0, 1))


def test_send_and_recv_on_cpu_say_they_need_ascend() -> None:
    sender, receiver = pair("CPU")
    assert isinstance(sender, Communicator)
    with pytest.raises(PlanError, match=r"^rank 0: point-to-point send/recv needs Ascend \(HCCL\): MindSpore "
                                        r"\S+ on CPU \(mccl\) has all-reduce but no send/recv"):
        sender.send(Tensor(np.ones(3, np.float32)), 1, tag=5)
    with pytest.raises(PlanError, match="needs Ascend"):
        receiver.recv(0, tag=5)
    assert sender.lib.calls == receiver.lib.calls == []  # nothing reached the library
    assert sender.bytes_sent == {}


def test_ascend_wire_protocol_drains_out_of_order_and_counts_payload_bytes() -> None:
    sender, receiver = pair("Ascend")
    tags = [MessageTag("F", 0, mb, 0, "h") for mb in range(3)]
    sent = [np.arange(6, dtype=np.float32).reshape(2, 3) + mb for mb in range(3)]
    for tag, x in zip(tags, sent):
        sender.send(Tensor(x), 1, tag)
    sender.send(Tensor(np.array([[1, 2]], np.int64)), 1, 7)  # integer payloads keep their dtype
    sender.wait_sends()
    got = {mb: receiver.recv(0, tags[mb]).asnumpy() for mb in (2, 0, 1)}  # mb2 first: mb0, mb1 drained early
    assert all(np.array_equal(got[mb], sent[mb]) for mb in range(3))
    assert receiver.peak_early == 2 and receiver.early == {}
    labels = receiver.recv(0, 7)
    assert labels.dtype == ms.int64 and labels.asnumpy().tolist() == [[1, 2]]
    assert sender.bytes_sent == {1: 3 * 24 + 16}  # payloads only; headers apart
    assert sender.header_bytes == {1: 4 * HEADER_BYTES}
    tag, shape, dtype = decode_header(encode_header(Tensor(np.zeros((4, 1, 2), np.float16)), 99))
    assert (tag, shape, dtype) == (99, (4, 1, 2), ms.float16)


def test_collectives_time_out_with_comm_timeout_and_never_touch_weights() -> None:
    comm, _ = pair("CPU")
    weight = Parameter(Tensor(np.ones(4, np.float32)), name="w")
    with pytest.raises(CommTimeout, match=r"rank 0: all-reduce of 4 elements over ranks \[0, 1\] timed out "
                                          r"after 0\.2 s"):
        comm.all_reduce(weight, [0, 1], timeout=0.2)
    assert comm.lib.calls == ["all_reduce:hccl_world_group"]
    assert comm.allreduce_bytes == 0  # nothing was reduced
    single = Tensor(np.ones(2, np.float32))
    assert comm.all_reduce(single, [0]) is single  # a group of one: no call at all
    with pytest.raises(PlanError, match=r"no communication group for ranks \[0, 2\]"):
        MindSporeCommunicator(device_target="CPU", lib=comm.lib, management=management(0, 4)).all_reduce(
            single, [0, 2])
    comm.lib.stuck.release.set()  # let the abandoned helper thread finish
