"""Memory accounting: static state, activations, skip cache, receive buffers."""
from __future__ import annotations

from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.schedule.generators import gpipe, one_f_one_b, zero_bubble_v
from pulse.sim import simulate
from pulse.sim.memory import MemoryModel


def test_static_and_activation_memory_of_1f1b_and_gpipe():
    spec, placement, m = unet(4, out_bytes=0, skip_bytes=0, params=10), sequential(4), 6
    costs = uniform_costs(spec, act=7)
    for schedule, held in ((one_f_one_b(placement, m), [4, 3, 2, 1]), (gpipe(placement, m), [m] * 4)):
        result = simulate(spec, placement, schedule, costs, cluster())
        for d in range(4):
            mem = result.memory[d]
            assert mem.static == 10 * (2 + 2 + 12)
            assert mem.activations == 7 * held[d]
            assert result.peak_memory[d] == mem.total == mem.static + mem.activations


def test_optimizer_precision_and_budget():
    spec, placement = unet(4, out_bytes=0, skip_bytes=0, params=10), sequential(4)
    result = simulate(spec, placement, gpipe(placement, 2), uniform_costs(spec, act=0), cluster(),
                      memory=MemoryModel(param_bytes=4, grad_bytes=4, optimizer_bytes=8), memory_budget=159)
    assert result.peak_memory == (160,) * 4 and not result.fits_memory
    assert simulate(spec, placement, gpipe(placement, 2), uniform_costs(spec, act=0), cluster(),
                    memory_budget=10**6).fits_memory


def test_v_caches_skips_until_the_decoder_backward():
    spec, placement, m = unet(8, skip_bytes=30), wave(4), 4
    result = simulate(spec, placement, gpipe(placement, m), uniform_costs(spec), cluster())
    # gpipe runs every forward before any backward: all m copies of l0->l7 (30 B) sit on device 0
    assert result.peak_skip_cache[0] == 30 * m
    assert result.peak_skip_cache[1] == 31 * m
    assert result.memory[0].skip_cache == 30 * m
    curve = result.skip_cache_curve[0]
    assert curve[-1][1] == 0 and max(level for _, level in curve) == 30 * m


def test_receive_buffers_are_counted():
    spec, placement = unet(2, out_bytes=100, skip_bytes=0, params=0), sequential(2)
    result = simulate(spec, placement, gpipe(placement, 3), uniform_costs(spec, act=0), cluster())
    assert result.memory[1].buffers == 100  # one activation waits while the last F runs
    assert result.peak_memory[1] == 100


def test_split_backward_holds_activations_until_w():
    spec, placement = unet(8), wave(4)
    result = simulate(spec, placement, zero_bubble_v(placement, 4), uniform_costs(spec), cluster())
    assert max(result.peak_inflight) <= 8
    assert all(result.memory[d].activations > 0 for d in range(4))
