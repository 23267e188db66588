"""MindSpore launch path: `pulse train --backend mindspore` under msrun, and the MindSpore communicator.

One real msrun job on CPU (mccl): the fine-tune of the tiny diffusers
pipeline's UNet (``pipeline_helpers``) from a ``pulse cache-latents`` folder,
pp 1 x dp 2, one microbatch of one sample, 1 step (MindSpore's PyNative CPU
kernels take seconds per step), ``--ema --save-final --export``: both workers
must end with identical weights, and the exported pipeline must load with
diffusers holding the EMA weights bit for bit (torch and diffusers only to
make the cache and to check; skipped without them). A second msrun job is
started with the wrong worker count and must stop at once with one line.
Pipelines on CPU send over gloo (tests/test_backend_processes.py runs them
on real processes); here, in one process, the refusal where neither Ascend
nor torch exists, and stand-ins for the carriers check the wire protocol
shared by HCCL and gloo (header + payload, out-of-order drains, byte counts,
timeouts, every dtype's bytes through gloo). Skipped without MindSpore.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_helpers import image_folder, pipeline_fixture  # noqa: E402
from pulse.cli.msrun_launch import MsrunOutput, free_port, msrun_command, msrun_env  # noqa: E402
from pulse.launch_env import finished_marks  # noqa: E402
from pulse.cli.launchers import launch  # noqa: E402
from pulse.errors import PlanError, PulseError  # noqa: E402
from pulse.runtime.errors import CommTimeout  # noqa: E402
from pulse.runtime.protocols import Communicator  # noqa: E402
from pulse.runtime.wiring import MessageTag  # noqa: E402
from pulse_mindspore.comm import HEADER_BYTES, MindSporeCommunicator, decode_header, encode_header  # noqa: E402
from pulse_mindspore.msrun_env import MsrunEnv, local_worker  # noqa: E402
from pulse_mindspore.transport import GlooTransport, gloo_rendezvous  # noqa: E402

LAUNCH_TIMEOUT = 240  # a hung job fails its test, not the suite
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MSRUN = Path(sys.executable).parent / "msrun"


def pulse_train(out: Path, *extra: str, model: tuple[str, ...] = ("--model", "tiny-unet")) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--backend", "mindspore", *model,
           "--out-dir", str(out), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


pipeline = pytest.fixture(scope="session")(pipeline_fixture)


@pytest.fixture(scope="module")
def dp_run(pipeline: Path, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    if not MSRUN.exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    pytest.importorskip("diffusers")
    from pulse_torch.cache_latents import main as cache_latents

    root = tmp_path_factory.mktemp("msrun_dp2")
    out, cache = root / "run", root / "cache"
    assert cache_latents(["--pipeline", str(pipeline), "--images", str(image_folder(root / "images", 2)),
                          "--out", str(cache)]) == 0
    # two steps: with diffusers' EMA warm-up the first update copies the weights (decay 0)
    done = pulse_train(out, "--data", str(cache), "--pp", "1", "--dp", "2", "--steps", "2", "--microbatch-size", "1",
                       "--num-microbatches", "1", "--timeout", "120", "--ema", "0.9", "--save-final",
                       "--export", str(root / "exported"), model=("--pipeline", str(pipeline)))
    return out, done


# -- msrun on CPU ---------------------------------------------------------------------------
def test_data_parallel_workers_end_with_identical_weights(dp_run) -> None:
    out, done = dp_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, second = np.load(out / "weights_rank0.npz"), np.load(out / "weights_rank1.npz")
    assert first.files == second.files and len(first.files) > 100  # every parameter, by diffusers name
    different = [k for k in first.files if not np.array_equal(first[k], second[k])]
    assert different == []
    log = json.loads((out / "log.json").read_text())
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert all(s["pipeline_bytes"] == 0 and s["allreduce_bytes"] > 0 for s in log["steps"])
    assert log["run"]["framework"].startswith("mindspore") and log["run"]["dp"] == 2
    assert (out / "loss.png").stat().st_size > 0
    assert "2/2" in done.stdout and "done: loss" in done.stdout  # worker 0's progress, tailed by msrun
    assert "latent cache: 2 images" in log["run"]["data"] and log["run"]["model"].startswith("diffusers:")


def test_the_exported_pipeline_holds_the_ema_weights(dp_run) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    out, done = dp_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ema, final = np.load(out / "final_weights_ema.npz"), np.load(out / "final_weights.npz")
    assert sorted(ema.files) == sorted(final.files) and any(not np.array_equal(ema[k], final[k]) for k in ema.files)
    assert all(np.array_equal(final[k], np.load(out / "weights_rank0.npz")[k]) for k in final.files)
    unet = UNet2DConditionModel.from_pretrained(str(out.parent / "exported" / "unet"), local_files_only=True)
    with torch.no_grad():
        exported = {k: v.numpy() for k, v in unet.state_dict().items()}
    assert sorted(exported) == sorted(ema.files) and all(np.array_equal(exported[k], ema[k]) for k in ema.files)


def test_the_closing_lines_are_the_last_the_run_prints(dp_run) -> None:
    """MindSpore's communicators log ``[INFO] DISTRIBUTED`` lines as the workers exit: not after PULSE's."""
    _, done = dp_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.strip()]
    closing = next(i for i, x in enumerate(lines) if x.startswith("done: loss"))
    assert all(x.startswith(("done: loss", "step:", "peak memory:", "export:")) for x in lines[closing:]), lines[closing:]
    assert not any(x.startswith(("[INFO]", "[WARNING]")) for x in done.stdout.splitlines() + done.stderr.splitlines())


def test_every_worker_of_a_complete_run_leaves_its_finished_mark(dp_run) -> None:
    """What lets `pulse train` tell a MindSpore teardown crash from a failed run (tests/test_msrun_teardown.py)."""
    out, done = dp_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = out / "msrun_logs"
    assert len(finished_marks(logs)) == len(list(logs.glob("worker_*.log"))) == 2


def test_msrun_stdout_drops_mindspores_log_lines_only() -> None:
    output = MsrunOutput()
    noise = ("[INFO] DISTRIBUTED(5648,7f7f0b7fe6c0,python):2026-11-28-22:55:00.569.053 [mindspore/ccsrc/cluster/rpc/"
             "core/communicator/tcp_client.cc:367] Start] Event base dispatch success!\n")
    assert output.feed_stdout(noise) == []
    assert output.feed_stdout(noise.replace("[INFO]", "[WARNING]")) == []
    kept = ["done: loss 1.0 -> 0.9 ...\n", "[ERROR] DISTRIBUTED(1,2,python): it broke\n", "[INFO] my own words\n"]
    assert [line for x in kept for line in output.feed_stdout(x)] == kept


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


def test_pipeline_plans_without_ascend_or_torch_are_refused(tmp_path: Path, monkeypatch) -> None:
    """Here torch exists, so pp 2 runs (tests/test_mindspore_processes.py); without it, one line, exit 2."""
    assert pulse_train(tmp_path, "--pp", "2", "--dp", "1", "--plan-only").returncode == 0
    import pulse.cli.msrun_launch as launcher
    import pulse.launch_env as launch_env
    import pulse_mindspore.comm as comm_module
    from pulse.plan import load_plan
    from pulse_mindspore.train import build_parser, check_inputs

    plan, _ = load_plan(tmp_path / "plan.yaml", None)
    command = msrun_command(plan, tmp_path / "plan.yaml", tmp_path / "run.yaml")
    assert command[-4:] == ["--plan", str(tmp_path / "plan.yaml"), "--config", str(tmp_path / "run.yaml")]
    monkeypatch.setattr(launcher, "gloo_available", lambda: False)
    monkeypatch.setattr(launch_env, "ascend_available", lambda: False)
    with pytest.raises(PulseError, match=r"^--pp 2 with --backend mindspore needs Ascend NPUs \(none found: no "
                                         r"/dev/davinci\*\) or torch \(its gloo carries send/recv on CPU"):
        msrun_command(plan, tmp_path / "plan.yaml", tmp_path / "run.yaml")
    # Started by hand anyway, the entry refuses the pipeline before joining a cluster.
    entry_args = build_parser().parse_args(["--plan", str(tmp_path / "plan.yaml")])
    env = MsrunEnv("MS_WORKER", 2, 0)
    assert check_inputs(entry_args, env)[1].pp == 2  # with torch: accepted
    monkeypatch.setattr(comm_module, "gloo_available", lambda: False)
    with pytest.raises(PlanError, match=r"^this plan pipelines over pp 2 workers, but point-to-point send/recv "
                                        r"needs Ascend \(HCCL\) or, on CPU, torch"):
        check_inputs(entry_args, env)


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


def pair(device: str, **kw) -> tuple[MindSporeCommunicator, MindSporeCommunicator]:
    """Two communicators over stand-in libraries; on CPU without send/recv unless ``kw`` gives a carrier."""
    wire: dict = defaultdict(deque)
    kw = kw or ({"p2p": False} if device == "CPU" else {})
    return tuple(MindSporeCommunicator(device_target=device, lib=FakeLib(wire, r), management=management(r), **kw)
                 for r in (0, 1))


def test_send_and_recv_on_cpu_without_torch_say_what_they_need(monkeypatch) -> None:
    import pulse_mindspore.comm as comm_module

    monkeypatch.setattr(comm_module, "gloo_available", lambda: False)
    sender, receiver = pair("CPU", p2p=True)
    assert isinstance(sender, Communicator) and sender.transport.name == "none"
    with pytest.raises(PlanError, match=r"^rank 0: point-to-point send/recv needs Ascend \(HCCL\) or, on CPU, "
                                        r"torch \(its gloo carries the messages\): MindSpore \S+ on CPU \(mccl\) "
                                        r"has all-reduce but no send/recv and torch is not importable"):
        sender.send(Tensor(np.ones(3, np.float32)), 1, tag=5)
    with pytest.raises(PlanError, match="torch is not importable"):
        receiver.recv(0, tag=5)
    assert sender.lib.calls == receiver.lib.calls == []  # nothing reached the library
    assert sender.bytes_sent == {} and sender._pending == []
    monkeypatch.undo()
    quiet, _ = pair("CPU")  # torch here, but the job asked for no send/recv: no gloo group was joined
    with pytest.raises(PlanError, match=r"^rank 0: this job was set up without point-to-point messages"):
        quiet.send(Tensor(np.ones(3, np.float32)), 1, tag=5)


class FakeDist:
    """torch.distributed's isend/irecv over in-memory queues: gloo's matching (per peer and tag, in order)."""

    def __init__(self, wire: dict, rank: int) -> None:
        self.wire, self.rank = wire, rank

    def isend(self, tensor, dst, tag):
        self.wire[(self.rank, dst, tag)].append(tensor.clone())
        return Done()

    def irecv(self, tensor, src, tag):
        data = self.wire[(src, self.rank, tag)].popleft()
        assert data.dtype == tensor.dtype and data.shape == tensor.shape  # bytes, sized by the header
        tensor.copy_(data)
        return Done()


def test_gloo_carrier_moves_every_dtype_bit_exact_under_the_shared_protocol() -> None:
    torch = pytest.importorskip("torch")
    wire: dict = defaultdict(deque)
    sender, receiver = (MindSporeCommunicator(device_target="CPU", lib=FakeLib(wire, r), management=management(r),
                                              transport=GlooTransport(FakeDist(wire, r), torch)) for r in (0, 1))
    rng = np.random.default_rng(0)
    sent = {1: Tensor(rng.standard_normal((2, 3)).astype(np.float32)),
            2: Tensor(rng.standard_normal(5).astype(np.float32)).astype(ms.bfloat16),
            3: Tensor(np.array([[True, False]])), 4: Tensor(np.arange(4, dtype=np.int64) - 2**40),
            5: Tensor(np.float32(7.5))}
    for tag, t in sent.items():
        sender.send(t, 1, tag)
    sender.wait_sends()
    for tag in (5, 3, 1, 2, 4):  # out of send order: the earlier ones are drained and kept
        got = receiver.recv(0, tag)
        assert got.dtype == sent[tag].dtype and got.shape == sent[tag].shape
        assert np.array_equal(got.asnumpy(), sent[tag].asnumpy()), tag
    assert receiver.peak_early == 4 and receiver.early == {}
    assert sender.bytes_sent == {1: 24 + 10 + 2 + 32 + 4}  # payload bytes only, bfloat16 as 2 bytes
    assert sender.header_bytes == {1: 5 * HEADER_BYTES}
    assert sender.lib.calls == []  # nothing through MindSpore's (CPU-less) isend/irecv


def test_gloo_rendezvous_comes_from_msrun_or_the_launcher() -> None:
    assert gloo_rendezvous({"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}) == ("127.0.0.1", 8119)
    assert gloo_rendezvous({"MS_SCHED_PORT": "8118", "PULSE_GLOO_PORT": "9000"}) == ("127.0.0.1", 9000)
    with pytest.raises(PlanError, match="needs a rendezvous port: run under msrun"):
        gloo_rendezvous({})
    with pytest.raises(PlanError, match=r"^PULSE_GLOO_PORT='70000' is not a TCP port$"):
        gloo_rendezvous({"PULSE_GLOO_PORT": "70000"})
    assert msrun_env({"PATH": "/bin"})["PULSE_GLOO_PORT"].isdigit()  # pulse train exports a free one


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


class MeetingDist(FakeDist):
    """A gloo group whose barriers are logged beside the library's calls (one list: their order); ``broken``
    makes it fail as gloo does when a peer has gone."""

    def __init__(self, log: list, rank: int, broken: bool = False) -> None:
        super().__init__(defaultdict(deque), rank)
        self.log, self.broken, self.made = log, broken, []

    def new_group(self, ranks, timeout):
        self.made.append((tuple(ranks), timeout.total_seconds()))
        return f"gloo{tuple(ranks)}"

    def barrier(self, group=None) -> None:
        if self.broken:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
        self.log.append("gloo barrier" + ("" if group is None else f" {group}"))

    def get_rank(self) -> int:
        return self.rank


def test_every_sum_on_cpu_waits_for_its_groups_ranks_at_a_gloo_barrier_first() -> None:
    """mccl's all-reduce gives up on a peer 30 s late; a pipeline's ranks meet at gloo's barrier (bounded by
    --timeout) before every sum: over the world, or over a registered group at its own gloo group, which
    every rank of the world adds (torch's new_group is collective over the world), members or not."""
    torch = pytest.importorskip("torch")
    log: list = []
    lib = FakeLib(defaultdict(deque), 0)
    lib.calls = log
    lib.stuck = Done()
    dist = MeetingDist(log, 0)
    comm = MindSporeCommunicator(device_target="CPU", lib=lib, management=management(0, 4),
                                 transport=GlooTransport(dist, torch, timeout=45.0))
    comm.sum_values([1.0, 2.0])
    for group in ([0, 2], [1, 3], [0, 1, 2, 3], [2]):  # the world and single ranks need no group
        comm.register_group(group)
    assert dist.made == [((0, 2), 45.0), ((1, 3), 45.0)]  # both, in order; the job's timeout, not gloo's 30 min
    assert list(comm.groups) == [(0, 2)]  # mccl's group on its members only
    comm.all_reduce(Tensor(np.ones(3, np.float32)), [0, 2])
    assert log == ["gloo barrier", "all_reduce:hccl_world_group",
                   "gloo barrier gloo(0, 2)", f"all_reduce:{comm.groups[(0, 2)]}"]
    with pytest.raises(PlanError, match=r"^rank 0: no gloo group for ranks \[0, 3\]; add it on every rank"):
        comm.transport.meet((0, 3))
    gone = MindSporeCommunicator(device_target="CPU", lib=lib, management=management(1, 4),
                                 transport=GlooTransport(MeetingDist(log, 1, broken=True), torch))
    with pytest.raises(CommTimeout, match=r"^rank 1: the gloo barrier before an all-reduce failed "
                                          r"\(\[\S+\] Connection closed by peer\)$"):
        gone.sum_values([1.0])


def test_a_taken_gloo_port_is_one_comm_timeout_line() -> None:
    pytest.importorskip("torch")
    import socket

    with socket.socket() as held:  # somebody else listens on the rendezvous port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(CommTimeout, match=rf"^rank 0: joining the gloo group at 127\.0\.0\.1:{port} failed "
                                              r"\(.*[Aa]ddress already in use"):
            GlooTransport.join(0, 2, 3.0, {"PULSE_GLOO_PORT": str(port), "MS_SCHED_HOST": "127.0.0.1"})


def test_the_gloo_store_listens_on_the_rendezvous_host_only() -> None:
    """TCPStore's own server would listen on every interface; rank 0 serves it on a socket bound to the host."""
    pytest.importorskip("torch")
    import datetime

    import torch.distributed as dist

    from pulse_mindspore.transport import _listen

    sock = _listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    assert host == "127.0.0.1"
    wait = datetime.timedelta(seconds=10)
    server = dist.TCPStore(host, port, 2, is_master=True, timeout=wait, wait_for_workers=False,
                           master_listen_fd=sock.fileno())
    client = dist.TCPStore(host, port, 2, is_master=False, timeout=wait)
    client.set("k", "v")
    assert server.get("k") == b"v"
    sock.close()


def test_the_multi_node_msrun_command_numbers_workers_node_by_node(tmp_path: Path) -> None:
    """`pulse train --backend mindspore --nnodes 2 --node-rank R --master-addr A --master-port P` on each node:
    msrun's multi-node form with this node's share of the workers; the gloo carrier's port is then the
    scheduler's + 1 on every node (no per-node free port, which the nodes could not agree on)."""
    from pulse.cli.launchers import Where
    from pulse.plan import load_plan

    assert pulse_train(tmp_path, "--pp", "2", "--dp", "2", "--plan-only").returncode == 0
    plan, _ = load_plan(tmp_path / "plan.yaml", None)
    where = Where(2, 1, "10.0.0.5", 29500)
    (tmp_path / "msrun_logs").mkdir()
    stale = tmp_path / "msrun_logs" / "finished-4242"  # an earlier run's worker: never this run's
    stale.touch()
    command = msrun_command(plan, tmp_path / "plan.yaml", tmp_path / "run.yaml", where)
    assert not stale.exists() and command[command.index("--log_dir") + 1] == str(tmp_path / "msrun_logs")
    flags = dict(zip(command[1:11:2], command[2:12:2]))
    assert flags == {"--worker_num": "4", "--local_worker_num": "2", "--master_addr": "10.0.0.5",
                     "--master_port": "29500", "--node_rank": "1"}
    assert "PULSE_GLOO_PORT" not in msrun_env({"PATH": "/bin"}, nodes=2)
    # a CPU worker pins itself to its share of its node's cores: 2 of the 4 workers are on its node
    worker = {**msrun_env({"PATH": "/bin"}, nodes=2), "MS_WORKER_NUM": "4", "DEVICE_ID": "1"}
    assert local_worker(worker) == (1, 2) and local_worker({"MS_WORKER_NUM": "3", "DEVICE_ID": "2"}) == (2, 3)
    done = pulse_train(tmp_path / "bad", "--pp", "2", "--dp", "2", "--nnodes", "2", "--node-rank", "0",
                       "--plan-only")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "fixed --master-port" in done.stderr
