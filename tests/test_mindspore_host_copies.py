"""MindSpore keeps a step on the device: counted host reads, helper threads and bucket launches.

* clipping and EMA: the gradient norm is summed on the device and read once a step; the EMA
  stays a float32 device tensor updated in place (read only when saved), with the numbers of
  the host computation it replaced (numpy float64 norm, numpy float32 average);
* bounded waits share one long-lived helper thread (another only after a timeout);
* data-parallel buckets: on Ascend the all-reduce is launched at the AR action (and overlaps
  what follows), on CPU at the wait, and the simulator's trait says which.

Counts, never time. Skipped without MindSpore.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

try:
    import pulse_mindspore  # noqa: F401
except ImportError:  # the package is not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from mindspore import Tensor  # noqa: E402

from pulse_mindspore.traits import traits  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.runtime.errors import CommTimeout  # noqa: E402
from pulse.runtime.grad_sync import DeferredAllReduce  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import StepSettings, optimizer_update  # noqa: E402
from pulse.train.schedules import ema_decay  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402
from pulse_mindspore.comm import MindSporeCommunicator  # noqa: E402
from mindspore_worker_check import make_batches  # noqa: E402
from pulse_mindspore.diffusion import eps_loss  # noqa: E402
from pulse_mindspore.train import ema_state  # noqa: E402

HOST_READS = ("asnumpy", "_item", "tolist")  # every way a MindSpore tensor reaches the host


class HostReads:
    """Counts host reads of MindSpore tensors while installed (``Tensor`` methods wrapped)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in HOST_READS:
            original = getattr(Tensor, name)

            def counted(t, *args, _original=original, **kwargs):
                self.count += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(Tensor, name, counted)


def chunks_with_gradients(backend: MindSporeBackend, seed: int) -> list:
    """tiny-uvit over two in-process stages, random gradients on every parameter (no step needed)."""
    spec = get_spec("tiny-uvit").with_act_bytes(4)
    placement = partition("sequential", spec, AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1), 2)
    run = local_run(spec, placement, lower(make_schedule("1f1b", placement, 2), spec, placement), backend,
                    make_batches(spec, 1), eps_loss)
    chunks = [c for ex in run.executors for c in ex.chunks.values()]
    set_random_gradients(backend, chunks, seed)
    return chunks


def set_random_gradients(backend: MindSporeBackend, chunks: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for c in chunks:
        backend.set_gradients(c, {n: rng.standard_normal(p.shape) for n, p in backend.parameters(c).items()})


def host_weights(backend: MindSporeBackend, chunks: list) -> dict[str, np.ndarray]:
    return {n: p.asnumpy().astype(np.float32).copy() for c in chunks for n, p in backend.parameters(c).items()}


def test_clipping_and_ema_read_the_device_once_a_step_with_the_host_numbers(monkeypatch) -> None:
    backend = MindSporeBackend(lr=1e-2)
    chunks = chunks_with_gradients(backend, 0)
    params = sum(len(backend.parameters(c)) for c in chunks)
    assert params > 20  # per-parameter host copies would show
    settings = StepSettings(clip=1e-3, lr=1e-2, lr_schedule="constant", total_steps=4, ema=0.9)
    # Step 0 builds the AdamW optimizers (MindSpore deep-copies every parameter into its moments
    # through the host, and compiles a cast): once per job, not per step, so not counted.
    optimizer_update(backend, chunks, 0, replace(settings, ema=None))
    want_ema: dict[str, np.ndarray] = {}
    reads = []
    for step in range(1, 4):
        set_random_gradients(backend, chunks, step)
        grads = [g.asnumpy().astype(np.float64) for c in chunks for g in backend.gradients(c).values()]
        want_norm = np.sqrt(sum(float(np.square(g).sum()) for g in grads))  # the host computation it replaced
        before = host_weights(backend, chunks)
        counter = HostReads(monkeypatch)
        norm, skipped = optimizer_update(backend, chunks, step, settings)
        reads.append(counter.count)
        monkeypatch.undo()
        after = host_weights(backend, chunks)
        assert not skipped and norm == pytest.approx(want_norm, rel=1e-6)
        decay = ema_decay(0.9, step)  # update `step` of the EMA (diffusers' warm-up: the first copies)
        for name, w in after.items():  # the average starts from the weights before its first update
            start = want_ema.get(name, before[name])
            want_ema[name] = decay * start + (1.0 - decay) * w
    assert reads == [1, 1, 1]  # the norm, read once; not one read per parameter (x2 with EMA)
    assert all(isinstance(e, Tensor) and e.dtype == ms.float32 for e in backend.ema.values())
    got = {n: e.asnumpy() for n, e in backend.ema.items()}
    assert got.keys() == want_ema.keys()
    for name, want in want_ema.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    weights = host_weights(backend, chunks)
    assert sum(not np.array_equal(got[n], weights[n]) for n in got) > params // 2  # its own memory
    cells = {name: cell for c in chunks for name, cell in c.layers.items()}
    saved = ema_state(get_spec("tiny-uvit"), cells, backend.ema)  # the host copy, at save time only
    assert len(saved) == params and all(isinstance(v, np.ndarray) for v in saved.values())


# -- the communicator over a stand-in library -----------------------------------------------------
class Done:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")


class Never:
    """A handle whose operation never completes (a peer that never comes) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self) -> None:
        self.release.wait()


class SummingLib:
    """``mindspore.ops.communication``'s in-place all_reduce between two equal ranks: the buffer doubles."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.stuck: Never | None = None

    def all_reduce(self, tensor, group, async_op):
        assert async_op
        self.log.append(f"all_reduce:{group}")
        if self.stuck is not None:
            return self.stuck
        tensor.copy_(tensor * 2)
        return Done(self.log)


def communicator(device: str, lib: SummingLib) -> MindSporeCommunicator:
    mgmt = SimpleNamespace(get_rank=lambda: 0, get_group_size=lambda: 2, create_group=lambda name, ranks: None,
                           GlobalComm=SimpleNamespace(WORLD_COMM_GROUP="hccl_world_group"))
    return MindSporeCommunicator(device_target=device, lib=lib, management=mgmt, p2p=False)


class CountedThread(threading.Thread):
    made = 0

    def __init__(self, *args, **kwargs) -> None:
        CountedThread.made += 1
        super().__init__(*args, **kwargs)


@pytest.mark.parametrize("device", ["CPU", "Ascend"])
def test_bounded_waits_share_one_helper_thread(device: str, monkeypatch) -> None:
    monkeypatch.setattr(threading, "Thread", CountedThread)
    CountedThread.made = 0
    lib = SummingLib()
    comm = communicator(device, lib)
    for i in range(40):
        out = comm.all_reduce(Tensor(np.full(3, i, np.float32)), [0, 1], timeout=30.0)
        assert out.asnumpy().tolist() == [2.0 * i] * 3
    assert comm.sum_values([1.5, 2.0], timeout=30.0) == [3.0, 4.0]
    comm.barrier(timeout=30.0)
    assert lib.log.count("wait") == 42 and CountedThread.made == 1  # 42 waits, one thread
    stuck = lib.stuck = Never()
    with pytest.raises(CommTimeout, match=r"^rank 0: all-reduce of 2 elements over ranks \[0, 1\] timed out "
                                          r"after 0\.2 s"):
        comm.all_reduce(Tensor(np.ones(2, np.float32)), [0, 1], timeout=0.2)
    lib.stuck = None  # the stuck worker is abandoned: the next waits get one fresh thread
    for _ in range(10):
        comm.all_reduce(Tensor(np.ones(2, np.float32)), [0, 1], timeout=30.0)
    assert CountedThread.made == 2 and comm.waiter.started == 2
    stuck.release.set()  # the abandoned thread ends once its operation returns


def test_ascend_buckets_start_at_their_ar_and_cpu_buckets_at_the_wait() -> None:
    for device, launched_at_ar in (("Ascend", True), ("CPU", False)):
        lib = SummingLib()
        comm = communicator(device, lib)
        bucket = Tensor(np.arange(4, dtype=np.float32))
        work = comm.all_reduce_async(bucket, [0, 1], timeout=30.0)
        lib.log.append("backward goes on")  # the rank's next actions
        total = work.wait()
        assert total.asnumpy().tolist() == [0.0, 2.0, 4.0, 6.0]
        want = (["all_reduce:hccl_world_group", "backward goes on", "wait"] if launched_at_ar
                else ["backward goes on", "all_reduce:hccl_world_group", "wait"])
        assert lib.log == want, device
        assert isinstance(work, DeferredAllReduce) is not launched_at_ar
        assert comm.allreduce_bytes == 16  # counted once, launched or deferred
        # what the simulator prices for this device: deferred buckets on CPU only, and on both every
        # bucket of a chunk at its AR (its vjp gives no gradient before it ends)
        assert traits(ascend=device == "Ascend").communicator() == {"deferred_buckets": not launched_at_ar,
                                                                    "tensor_messages": True,
                                                                    "buckets_at_chunk_end": True}


def test_a_launched_ascend_bucket_that_never_completes_is_one_comm_timeout_line() -> None:
    lib = SummingLib()
    lib.stuck = Never()
    comm = communicator("Ascend", lib)
    work = comm.all_reduce_async(Tensor(np.ones(5, np.float32)), [0, 1], timeout=0.2)
    assert lib.log == ["all_reduce:hccl_world_group"]  # launched, not waited for
    with pytest.raises(CommTimeout, match=r"^rank 0: data-parallel bucket of 5 elements over ranks \[0, 1\] "
                                          r"timed out after 0\.2 s"):
        work.wait()
    lib.stuck.release.set()  # let the abandoned helper thread finish
