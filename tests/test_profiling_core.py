"""``pulse.profiling``'s backend-neutral parts: what the ranks of ``pulse profile`` learn from each
other through the communicator's all-reduce alone (``gather``: MindSpore's CPU collectives have
nothing else), and the figures of a backend whose backward re-runs the forward (``without_forward``)."""
from __future__ import annotations

import pickle
import queue
import threading
from typing import Sequence

import numpy as np
import pytest

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.profiling.gather import Ranks, from_wire, to_wire
from pulse.profiling.layers import without_forward
from pulse.testing.numpy_backend import NumpyBackend


class ThreadedSum:
    """A blocking all-reduce (sum) over ranks that are threads of this process: a stand-in for a
    real communicator that counts its calls."""

    def __init__(self, world: int) -> None:
        self.world, self.calls = world, 0
        self._arrived = threading.Barrier(world)
        self._left = threading.Barrier(world)
        self._inputs: dict[int, np.ndarray] = {}
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def member(self, rank: int) -> "Member":
        return Member(self, rank)

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())


class Member:
    def __init__(self, hub: ThreadedSum, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def all_reduce(self, tensor: np.ndarray, group: Sequence[int], timeout: float | None = None) -> np.ndarray:
        assert list(group) == list(range(self.hub.world))  # gathers span the world
        self.hub._inputs[self.rank] = np.array(tensor, copy=True)
        self.hub._arrived.wait(timeout=10)
        total = sum(self.hub._inputs[r] for r in range(self.hub.world))
        if self.rank == 0:
            self.hub.calls += 1
        self.hub._left.wait(timeout=10)
        return total

    def barrier(self, timeout: float | None = None) -> None:
        self.hub._arrived.wait(timeout=10)

    def send(self, tensor: np.ndarray, peer_rank: int, tag: int, timeout: float | None = None) -> None:
        self.hub.mailbox(self.rank, peer_rank, tag).put(np.array(tensor, copy=True))

    def recv(self, peer_rank: int, tag: int, timeout: float | None = None) -> np.ndarray:
        return self.hub.mailbox(peer_rank, self.rank, tag).get(timeout=10)

    def wait_sends(self, timeout: float | None = None) -> None:
        pass


def on_every_rank(world: int, body, **options) -> list:
    hub, results = ThreadedSum(world), [None] * world

    def run(rank: int) -> None:
        results[rank] = body(Ranks(hub.member(rank), NumpyBackend(), rank, world, **options))
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results), "a rank did not finish"
    return results


def test_every_rank_gets_every_ranks_object_in_rank_order() -> None:
    # objects of different sizes and kinds: what the profile gathers (string keys, None for a rank
    # that measured nothing, floats that must survive bit for bit; JSON: tuples come back as lists)
    objects = [{"F": 0.1 + 1e-17, "encoders": [["vae", 0.5]]}, None, [np.pi, -0.0, 1e-300], "x" * 5000]
    results = on_every_rank(4, lambda ranks: ranks.gather(objects[ranks.rank]))
    for got in results:
        assert got[0] == objects[0] and got[1] is None and got[3] == objects[3]
        assert got[2] == objects[2] and str(got[2][1]) == "-0.0"


def test_max_takes_each_figure_from_whichever_rank_saw_it() -> None:
    figures = {0: [1.0, 0.0, 3.5], 1: [0.5, 2.0, 0.0], 2: [0.0, 0.0, 0.0]}
    results = on_every_rank(3, lambda ranks: ranks.max(figures[ranks.rank]))
    assert results == [[1.0, 2.0, 3.5]] * 3


def test_a_barrier_of_messages_lets_nobody_leave_before_the_last_arrives() -> None:
    """MindSpore on a CPU: the barrier that waits out a slow rank goes over messages, not mccl.
    Rank 2 arrives only once ranks 0 and 1 are in the barrier; the event log's order says who left when."""
    log: list[str] = []
    others_in = threading.Barrier(3)  # ranks 0 and 1 have arrived: rank 2 may come

    def body(ranks: Ranks) -> bool:
        if ranks.rank == 2:
            others_in.wait(timeout=10)
        log.append(f"arrived {ranks.rank}")
        if ranks.rank != 2:
            others_in.wait(timeout=10)
        ranks.barrier()
        log.append(f"left {ranks.rank}")
        return True

    on_every_rank(3, body, barrier_by_messages=True)
    assert sorted(log[:3]) == ["arrived 0", "arrived 1", "arrived 2"] and log[2] == "arrived 2"
    assert sorted(log[3:]) == ["left 0", "left 1", "left 2"]  # nobody left before the last arrived


ran: list[str] = []  # what a payload that runs code would leave behind


def _leave_a_mark(text: str) -> None:
    ran.append(text)


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return _leave_a_mark, ("a peer's bytes ran code here",)


def test_a_peers_bytes_that_would_run_code_are_refused_not_run() -> None:
    """gather's rows come from other processes: a pickle that names a function is refused in one
    line, and the function never runs (the format is JSON: data only)."""
    payload = np.frombuffer(pickle.dumps(RunsCodeWhenUnpickled()), dtype=np.uint8)

    def body(ranks: Ranks):
        if ranks.rank == 0:  # an honest rank
            try:
                return ranks.gather({"fwd": [1.0]})
            except PulseError as exc:
                return str(exc)
        lengths = np.zeros(2, dtype=np.float32)  # rank 1 writes gather's two sums with pickled bytes
        lengths[1] = payload.size
        longest = int(ranks._sum(lengths).max())
        rows = np.zeros((2, longest), dtype=np.float32)
        rows[1, :payload.size] = payload
        ranks._sum(rows)
        return "sent"

    told, _ = on_every_rank(2, body)
    assert ran == []
    assert isinstance(told, str) and told.startswith("rank 1 sent profile figures that are not JSON")


def test_what_could_run_code_cannot_be_sent() -> None:
    with pytest.raises(TypeError, match="RunsCodeWhenUnpickled cannot cross ranks"):
        to_wire({"fwd": RunsCodeWhenUnpickled()})
    assert from_wire(to_wire({"fwd": [np.float32(0.5), np.int64(3)]}), 0) == {"fwd": [0.5, 3]}


def test_one_rank_needs_no_collective() -> None:
    hub = ThreadedSum(1)
    ranks = Ranks(hub.member(0), NumpyBackend(), 0, 1)
    assert ranks.gather({"a": 1}) == [{"a": 1}] and hub.calls == 0



def test_a_recomputing_backends_figures_price_its_chunks_as_measured() -> None:
    """MindSpore's backward re-runs the forward: stored without it, the simulator's rule for a
    recomputing chunk (B + F, each its layers' sums less the per-action share per join) must give
    back the whole backward as the fit saw it: the layers' whole figures less the whole share."""
    fwd, whole_bwd, whole_bi = [1.0, 2.0, 0.5], [3.0, 5.0, 2.0], [2.5, 1.5, 1.0]
    whole_share = {"F": 0.1, "B": 0.5, "Bi": 0.3, "W": 0.2, "O": 0.01}
    columns = {"fwd": fwd, "bwd": whole_bwd, "bwd_input": whole_bi, "bwd_weight": [0.1] * 3, "optimizer": [0.2] * 3}
    stored, share = without_forward(columns, whole_share)
    assert stored["bwd"] == [2.0, 3.0, 1.5] and stored["fwd"] == fwd
    assert stored["bwd_input"][0] == 1.5 and stored["bwd_input"][1] == 1e-9  # 1.5 - 2.0: never below a ns
    assert share == pytest.approx({**whole_share, "B": 0.4, "Bi": 0.2}) and columns["bwd"] == whole_bwd
    table = CostTable("m", 1, ("a", "b", "c"), fwd, stored["bwd"], (0, 0, 0), per_action=tuple(share.items()))
    f, b = table.span(0, 3)
    assert f + b == pytest.approx(sum(whole_bwd) - 2 * whole_share["B"])  # 10 - 1.0


def test_the_per_action_fit_by_hand() -> None:
    """Seven layers cut 0 | 1-3 | 4-6: per kind, (the layers' one-layer sum - the chunk's figure) per
    join, over both multi-layer chunks (F: chunk 1 makes its device's batch, so only chunk 2); D what
    chunk 1's forward takes beyond what the fit gives it."""
    from pulse.profiling.layers import per_action_seconds

    columns = {"fwd": [1.0] * 7, "bwd": [2.0] * 7, "bwd_input": [1.5] * 7, "bwd_weight": [0.5] * 7,
               "optimizer": [0.1] * 7}
    chunked = {False: {("F", 0): 1.0, ("F", 1): 3.5, ("F", 2): 2.6, ("B", 0): 2.0, ("B", 1): 5.0, ("B", 2): 5.4},
               True: {("B", 1): 4.0, ("B", 2): 4.2, ("W", 0): 0.5, ("W", 1): 1.7, ("W", 2): 1.3}}
    got = per_action_seconds([0, 1, 4, 7], columns, chunked, [0.1, 0.25, 0.26])
    assert got == pytest.approx({"F": (3 - 2.6) / 2, "B": (6 - 5.0 + 6 - 5.4) / 4, "Bi": (4.5 - 4.0 + 4.5 - 4.2) / 4,
                                 "W": (1.5 - 1.7 + 1.5 - 1.3) / 4, "O": (0.3 - 0.25 + 0.3 - 0.26) / 4,
                                 "D": 3.5 - (3 - 2 * 0.2)})
