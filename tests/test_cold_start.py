"""The cold-start probe of `pulse profile`: an exchange before every compute action, and the figure
it reads off, checked against a penalty injected into the backend's compute calls. The executor's
clock is a virtual one that only the penalty moves: the figures are the probe's arithmetic on
known spans, not the host's time."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse.profiling.cold_start import _before_compute, cold_start_seconds  # noqa: E402
from pulse.profiling.layers import one_chunk_per_layer  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
import pulse.runtime.executor as executor_module  # noqa: E402
from virtual_clock import VirtualClock  # noqa: E402

SPEC = load_model("tiny-unet")
PENALTY = {"forward": 0.004, "backward": 0.006, "backward_input": 0.003, "backward_weight": 0.005}


class ColdAfterExchange:
    """A backend whose next compute call after ``exchange`` sleeps its kind's PENALTY: a known cold start."""

    def __init__(self, sleep=lambda seconds: None) -> None:
        self.cold = False
        self.exchanges = 0
        self.sleep = sleep

    def exchange(self) -> None:
        self.exchanges += 1
        self.cold = True

    def backend(self) -> TorchBackend:
        backend = TorchBackend(seed=0, lr=1e-12)
        for name, seconds in PENALTY.items():
            setattr(backend, name, self._slowed(getattr(backend, name), seconds))
        return backend

    def _slowed(self, call, seconds: float):
        def slowed(*args, **kwargs):
            if self.cold:
                self.cold = False
                self.sleep(seconds)
            return call(*args, **kwargs)
        return slowed


def make_run_of(probe: ColdAfterExchange):
    return lambda split: one_chunk_per_layer(SPEC, probe.backend(), eps_loss, 1, split=split, seed=0)


def test_the_exchange_runs_before_every_compute_action_and_is_undone() -> None:
    probe = ColdAfterExchange()
    run = make_run_of(probe)(False)
    _before_compute(run, probe.exchange)
    run.step()
    assert probe.exchanges == 2 * SPEC.num_layers  # an F and a B per one-layer chunk, nothing else
    _before_compute(run, None)
    run.step()
    assert probe.exchanges == 2 * SPEC.num_layers


def virtual_probe(monkeypatch) -> ColdAfterExchange:
    """A probe whose penalties move the executor's clock, and nothing else does."""
    clock = VirtualClock()
    monkeypatch.setattr(executor_module, "time", clock.as_time_module())
    return ColdAfterExchange(sleep=clock.sleep)


def test_the_probe_reads_the_injected_cold_start_of_every_kind(monkeypatch) -> None:
    probe = virtual_probe(monkeypatch)
    cold = cold_start_seconds(make_run_of(probe), probe.exchange, steps=3, warmup=1)
    assert set(cold) == {"F", "B", "Bi", "W"}
    expected = {"F": PENALTY["forward"], "B": PENALTY["backward"], "Bi": PENALTY["backward_input"],
                "W": PENALTY["backward_weight"]}
    assert cold == pytest.approx(expected, abs=1e-9)  # the injected penalty, each kind its own


def test_without_a_cold_start_the_probe_reads_nothing(monkeypatch) -> None:
    probe = virtual_probe(monkeypatch)
    cold = cold_start_seconds(make_run_of(probe), lambda: None, steps=3, warmup=1)
    assert set(cold) == {"F", "B", "Bi", "W"} and all(t == 0.0 for t in cold.values()), cold
