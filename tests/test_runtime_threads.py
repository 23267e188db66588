"""The blocking path (``run_step``), as a real communicator drives it: one thread per
rank over a minimal queue-based communicator with timeouts."""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from pulse.runtime import CommTimeout, StageExecutor
from pulse.runtime.protocols import CommunicatorDefaults
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import greedy_v_1f1b
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower

SPEC = toy_unet_spec(depth=3)


class ThreadWorld:
    def __init__(self, size: int) -> None:
        self.cond = threading.Condition()
        self.mailbox: dict[tuple, np.ndarray] = {}
        self.sums: dict[tuple, list] = defaultdict(list)
        self.size = size


class ThreadComm(CommunicatorDefaults):
    """Blocking send/recv/all_reduce between threads; gives up after ``timeout`` seconds."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.bytes_sent: dict[int, int] = defaultdict(int)
        self.allreduce_bytes = 0
        self.seq: dict[tuple, int] = defaultdict(int)

    def send(self, tensor: Any, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        with self.world.cond:
            self.world.mailbox[(self.rank, peer_rank, tag.as_int())] = np.array(tensor)
            self.bytes_sent[peer_rank] += tensor.nbytes
            self.world.cond.notify_all()

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Any:
        key = (peer_rank, self.rank, tag.as_int())
        with self.world.cond:
            if not self.world.cond.wait_for(lambda: key in self.world.mailbox, timeout):
                raise CommTimeout(f"rank {self.rank}: no {tag} from rank {peer_rank} within {timeout}s")
            return self.world.mailbox.pop(key)

    def all_reduce(self, tensor: Any, group: Sequence[int], timeout: float | None = None) -> Any:
        key = (tuple(sorted(group)), self.seq[tuple(group)])
        self.seq[tuple(group)] += 1
        self.allreduce_bytes += tensor.nbytes
        with self.world.cond:
            self.world.sums[key].append((self.rank, np.array(tensor)))
            self.world.cond.notify_all()
            if not self.world.cond.wait_for(lambda: len(self.world.sums[key]) == len(group), timeout):
                raise CommTimeout(f"rank {self.rank}: all-reduce over {list(group)} timed out")
            return sum(t for _, t in sorted(self.world.sums[key], key=lambda p: p[0]))

    def barrier(self, timeout: float | None = None) -> None:
        self.all_reduce(np.zeros(1), range(self.world.size), timeout)


def run_threads(executors: list[StageExecutor]) -> list[BaseException]:
    errors: list[BaseException] = []

    def work(ex: StageExecutor) -> None:
        try:
            ex.run_step()
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(ex,)) for ex in executors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def make_executors(schedule: Schedule, placement, dp: int, timeout: float) -> list[StageExecutor]:
    world, backend, pp = ThreadWorld(2 * dp), NumpyBackend(), placement.num_devices
    return [StageExecutor(device=d, spec=SPEC, placement=placement, schedule=schedule, backend=backend,
                          comm=ThreadComm(world, r * pp + d), batches=toy_batches(SPEC, 2, seed=r),
                          loss_fn=mse_loss, pipeline_ranks=[r * pp + q for q in range(pp)],
                          dp_group=[q * pp + d for q in range(dp)] if dp > 1 else [], timeout=timeout)
            for r in range(dp) for d in range(pp)]


def test_threaded_ranks_match_the_cooperative_run() -> None:
    placement = toy_placement(SPEC, "v", 2)
    schedule = lower(greedy_v_1f1b(placement, 4), SPEC, placement)
    executors = make_executors(schedule, placement, dp=2, timeout=10.0)
    assert run_threads(executors) == []
    local = local_run(SPEC, placement, schedule, NumpyBackend(), [toy_batches(SPEC, 2, seed=r) for r in range(2)],
                      mse_loss, dp=2)
    local.step()
    expected = local.gradients()
    for replica in range(2):
        got = {n: g for ex in executors[2 * replica:2 * replica + 2] for n, g in ex.gradients().items()}
        assert all(np.array_equal(got[k], expected[k]) for k in expected)
    assert dict(executors[0].comm.bytes_sent) == dict(local.network.comms[0].bytes_sent)


def test_a_real_deadlock_surfaces_as_a_timeout() -> None:
    placement = toy_placement(SPEC, "sequential", 2)
    rows = {0: "0RB0:1 0F0 0SF0:1 0B0 0AR0 0FREE0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"}
    broken = Schedule("hand", 1, {d: tuple(Action.parse(t, d) for t in r.split()) for d, r in rows.items()})
    errors = run_threads(make_executors(broken, placement, dp=1, timeout=0.2))
    assert len(errors) == 2 and all(isinstance(e, CommTimeout) for e in errors)
    assert any(str(e).startswith("rank 1 (device 1), action #0 1RF0:0 of schedule 'hand': rank 1: no activation")
               for e in errors)
