"""List schedules ordered on the cluster's links, and in-flight caps per device fitted to memory."""
from __future__ import annotations

import pytest

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.partition.symmetric import plan_symmetric
from pulse.schedule.generators import OnLinks, greedy_v_1f1b, zero_bubble_v
from pulse.schedule.validate import validate
from pulse.sim import simulate
from pulse.sim.breakdown import free_links
from pulse.sim.step import step_time
from pulse.tune.caps_fit import fit_caps
from pulse.tune.evaluate import evaluate
from pulse.tune.space import Candidate
from pulse.zoo import get_spec

GiB = 2**30


def _v(model: str, cluster: str, pp: int, mbs: int = 1):
    spec, net = get_spec(model), load_cluster(cluster)
    costs = AnalyticProfiler(net.hardware).profile(spec, mbs)
    return spec, net, costs, plan_symmetric(spec, costs, pp, strict=False, cluster=net).placement


def _step(spec, net, costs, placement, schedule) -> float:
    return step_time(spec, placement, costs, net, simulate(spec, placement, schedule, costs, net)).total


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v])
def test_free_links_order_as_compute_alone(generator):
    """With every message free, ordering on the links is ordering on compute: the same actions."""
    spec, net, costs, placement = _v("uvit", "ascend-910a-1x8", 4)
    free = free_links(net, placement.num_devices)
    blind = generator(placement, 8, costs)
    on_links = generator(placement, 8, costs, links=OnLinks(spec, free))
    assert on_links.actions == blind.actions


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v])
def test_slow_links_order_around_messages_and_win(generator):
    """Hunyuan-DiT's V over eight servers on 10 Gb/s Ethernet: a boundary takes ~9 ms on the wire.
    Ordered on compute alone a device waits for the gradient it picked next; ordered on the links
    it runs a forward meanwhile. Valid, and the simulated step is shorter."""
    spec, net, costs, placement = _v("hunyuan-dit", "v100-pcie-10gbe-8x1", 8)
    blind = generator(placement, 16, costs)
    on_links = generator(placement, 16, costs, links=OnLinks(spec, net))
    validate(on_links, placement, 16)
    assert on_links.actions != blind.actions
    assert _step(spec, net, costs, placement, on_links) < 0.97 * _step(spec, net, costs, placement, blind)


def _inflight_peaks(schedule, placement) -> dict[int, int]:
    """Per device, the most microbatches begun there (a forward) and not yet finished (their last W)."""
    peaks = {}
    for d, row in schedule.actions.items():
        chunks = len(placement.chunks_of(d))
        done: dict[int, int] = {}
        live, peak = set(), 0
        for a in row:
            if a.kind == "F":
                live.add(a.microbatch)
            elif a.kind == "W":
                done[a.microbatch] = done.get(a.microbatch, 0) + 1
                if done[a.microbatch] == chunks:
                    live.discard(a.microbatch)
            peak = max(peak, len(live))
        peaks[d] = peak
    return peaks


def test_per_device_caps_bound_each_device():
    spec, net, costs, placement = _v("uvit", "ascend-910a-1x8", 4)
    caps = {0: 8, 1: 5, 2: 3, 3: 2}
    schedule = zero_bubble_v(placement, 16, costs, inflight_cap=caps, links=OnLinks(spec, net))
    validate(schedule, placement, 16)
    peaks = _inflight_peaks(schedule, placement)
    assert all(peaks[d] <= caps[d] for d in caps) and peaks[3] == 2 and peaks[0] > 3


def test_fitted_caps_fit_every_device_and_only_speed_the_step_up():
    """Hunyuan-DiT's zero-bubble V on the 10 GbE cluster, one device's worth of memory short of a
    larger uniform cap: fitting caps device by device keeps every device in the budget and is faster."""
    spec, net, costs, _ = _v("hunyuan-dit", "v100-pcie-10gbe-8x1", 8)
    budget = 30 * GiB
    base = evaluate(spec, costs, net, Candidate("pulse", 8, 1, 1, 32, 1, "pulse", "zero_bubble_v"), budget)
    assert base.fits
    fitted = fit_caps(spec, costs, net, base, budget)
    assert fitted.fits and max(fitted.device_peaks) <= budget
    assert fitted.candidate.device_caps and fitted.iteration_time < base.iteration_time
    again = evaluate(spec, costs, net, fitted.candidate, budget, placement=base.placement)  # the label rebuilds it
    assert again.iteration_time == pytest.approx(fitted.iteration_time, rel=1e-12)


def _fit_caps_trying_all(spec, costs, net, e, budget):
    """``fit_caps``'s coordinate ascent simulating every try, a repeated schedule too (the reference)."""
    from dataclasses import replace

    from pulse.tune.caps_fit import MAX_ROUNDS, MIN_GAIN, STEPS
    c, best, links = e.candidate, e, OnLinks(spec, net)
    caps = [len(e.placement.chunks)] * e.placement.num_devices
    for _ in range(MAX_ROUNDS):
        kept = False
        for d in sorted(range(len(caps)), key=lambda d: best.device_peaks[d]):
            for more in STEPS:
                trial = caps[:d] + [caps[d] + more] + caps[d + 1:]
                tried = evaluate(spec, costs, net, replace(c, device_caps=tuple(trial)), budget,
                                 placement=e.placement, links=links)
                if tried.fits and tried.iteration_time < best.iteration_time * (1 - MIN_GAIN):
                    caps, best, kept = trial, tried, True
                    break
        if not kept:
            break
    return best


def test_fitted_caps_simulate_a_schedule_once_and_fit_as_trying_all(monkeypatch):
    """A raise that changes no decision gives the schedule of the caps before it: fit_caps skips its
    simulation (it cannot win) and still ends where simulating every try ends."""
    import pulse.tune.caps_fit as caps_fit

    spec, net = get_spec("sd2-unet"), load_cluster("ascend-910a-2x8")
    costs = AnalyticProfiler(net.hardware).profile(spec, 4)
    cand = Candidate("pulse", 4, 4, 4, 16, 0, "diffusionpipe", "zero_bubble_v", virtual=2, skip_transport="direct")
    base = evaluate(spec, costs, net, cand, 30 * GiB)
    simulated = []
    real = caps_fit.safe_evaluate

    def counted(*args, **kwargs):
        simulated.append(tuple(kwargs["schedule"].actions.items()))
        return real(*args, **kwargs)

    monkeypatch.setattr(caps_fit, "safe_evaluate", counted)
    fitted = fit_caps(spec, costs, net, base, 30 * GiB)
    assert len(set(simulated)) == len(simulated) and tuple(base.schedule.actions.items()) not in simulated
    reference = _fit_caps_trying_all(spec, costs, net, base, 30 * GiB)
    assert fitted.candidate == reference.candidate and fitted.iteration_time == reference.iteration_time
    assert fitted.candidate.device_caps  # the fit did raise a cap
