"""Data-parallel buckets: an AR action right after a chunk's gradients become final, as the simulator prices."""
from __future__ import annotations

import numpy as np
import pytest

from pulse.errors import PlanError
from pulse.runtime.grad_sync import BucketedGradientSync
from pulse.testing.numpy_backend import NumpyBackend
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.passes import add_memory_and_sync, final_gradient_positions


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t, device=0) for t in text.split())


def test_last_b_without_split_last_w_with_split() -> None:
    # chunk 0: plain backward, its last B is 0B1 (position 8); chunk 3: split, its last W is 3W1 (7)
    actions = acts("0F0 0F1 3F0 3B0 3W0 0B0 3B1 3W1 0B1")
    assert final_gradient_positions(actions) == {0: 8, 3: 7}


def test_the_lowering_puts_each_bucket_and_free_right_after_that_compute():
    program = add_memory_and_sync(Schedule("t", 2, {0: acts("0F0 0F1 3F0 3B0 3W0 0B0 3B1 3W1 0B1")}))
    assert " ".join(a.text for a in program.actions[0]) == (
        "0F0 0F1 3F0 3B0 3W0 3FREE0 0B0 0FREE0 3B1 3W1 3AR1 3FREE1 0B1 0AR1 0FREE1")
    assert add_memory_and_sync(program) == program  # replaced, not doubled


class _Recorder:
    """A communicator that records when buckets launch and sums over a fake 2-rank group."""

    def __init__(self) -> None:
        self.launched: list[int] = []

    def all_reduce_async(self, flat, group, timeout=None):
        self.launched.append(flat.size)
        return type("Done", (), {"wait": lambda _self: flat * len(group)})()


def test_buckets_launch_at_final_gradient_and_average() -> None:
    backend = NumpyBackend()
    grads = {0: {"a.w": np.ones((2, 3)), "a.b": np.full(2, 4.0)}, 3: {"z.w": np.arange(5.0)}}

    class Chunk:
        def __init__(self, g):
            self.g = dict(g)

    chunks = {c: Chunk(g) for c, g in grads.items()}
    backend.gradients = lambda ch: ch.g  # type: ignore[method-assign]
    backend.parameters = lambda ch: ch.g  # type: ignore[method-assign]
    backend.parameter_layers = None  # one bucket per chunk: the layers are unknown
    backend.set_gradients = lambda ch, g: ch.g.update(g)  # type: ignore[method-assign]
    comm = _Recorder()
    sync = BucketedGradientSync(backend, comm, [0, 1], chunks)
    assert comm.launched == []
    sync.launch(3)  # chunk 3's AR
    assert comm.launched == [5]
    with pytest.raises(PlanError, match=r"launched twice"):
        sync.launch(3)
    with pytest.raises(PlanError, match=r"chunks \[0\] were never launched"):
        sync.finish()
    sync.launch(0)
    sync.finish()
    # the recorder sums two identical replicas: the average equals the original gradient
    assert np.array_equal(chunks[0].g["a.w"], np.ones((2, 3)))
    assert np.array_equal(chunks[3].g["z.w"], np.arange(5.0))
