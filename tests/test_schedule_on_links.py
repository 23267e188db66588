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
