"""A pipelined training step gives the single-device gradients, and moves exactly
the bytes ``traffic.transfers()`` predicts (numpy backend, float64, fake network)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from pulse.costs import CostTable
from pulse.partition import partition
from pulse.partition.interleaved import interleaved_placement
from pulse.placement import Placement, from_cuts
from pulse.testing.local import LocalRun, local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.runtime.wiring import MAIN
from pulse.schedule.generators import gpipe, greedy_v_1f1b, interleaved_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.ir import Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.traffic import skips_leaving_device, transfers

M, B = 4, 2  # microbatches, samples per microbatch
SPEC = toy_unet_spec(depth=7)  # 18 layers: enough for 16 chunks (wave, P=4)


def unit_costs(spec: ModelSpec) -> CostTable:
    n = spec.num_layers
    return CostTable(spec.name, B, tuple(l.name for l in spec.layers), (1.0,) * n, (2.0,) * n, (0,) * n)


def placement_for(case: str, P: int) -> Placement:
    if case.startswith("interleaved-balanced"):  # what the tuner builds for the baselines
        return interleaved_placement(SPEC, unit_costs(SPEC), P)
    if case.startswith("seq-direct"):
        return toy_placement(SPEC, "sequential", P, transport="direct")
    if case.startswith("interleaved-direct"):
        return toy_placement(SPEC, "interleaved", P, folds=2, transport="direct")
    if case.startswith("v-crossing"):  # the V's outer encoder cut one layer deeper: its skips leave
        return crossing_v(P)
    if case.startswith("v-relay"):
        return toy_placement(SPEC, "v", P, transport="relay")
    if case.startswith("seq"):
        return toy_placement(SPEC, "sequential", P)
    if case.startswith("interleaved"):
        return toy_placement(SPEC, "interleaved", P, folds=2)
    if case.startswith("v-"):
        return toy_placement(SPEC, "v", P)
    if case.startswith("wave"):
        return toy_placement(SPEC, "wave", P, folds=2)
    if case == "pulse-v":
        return partition("pulse", SPEC, unit_costs(SPEC), P, folds=1)
    if case == "pulse-wave":
        return partition("pulse", SPEC, unit_costs(SPEC), P, folds=2)
    raise ValueError(case)


def crossing_v(P: int) -> Placement:
    """The toy V with its first encoder cut one layer deeper, so skips cross devices (sent directly):
    the V the priced partitioner may choose on a fast link (``pulse.partition.crossing``)."""
    v = toy_placement(SPEC, "v", P)
    cuts = [c.start for c in v.chunks] + [SPEC.num_layers]
    cuts[1] += 1
    return from_cuts("v", cuts, [c.device for c in v.chunks], P, "direct", "test")


def schedule_for(case: str, placement: Placement) -> Schedule:
    if case.endswith("gpipe"):
        compute = gpipe(placement, M)
    elif case.endswith("zbv"):  # B/W split on any placement, the baselines' zero-bubble schedule too
        compute = zero_bubble_v(placement, M)
    elif case.endswith("greedy"):
        compute = greedy_v_1f1b(placement, M)
    elif case.startswith("interleaved"):
        compute = interleaved_1f1b(placement, M)
    elif case.endswith("1f1b") and case.startswith("seq"):
        compute = one_f_one_b(placement, M)
    else:
        compute = greedy_v_1f1b(placement, M)
    return lower(compute, SPEC, placement)


CASES = ["seq-1f1b", "seq-gpipe", "seq-direct-1f1b", "interleaved", "interleaved-direct", "v-greedy",
         "v-gpipe", "v-zbv", "v-relay-greedy", "v-crossing-greedy", "v-crossing-zbv", "wave-greedy", "wave-zbv", "pulse-v", "pulse-wave",
         # every schedule the tuner offers the sequential baselines
         "seq-zbv", "seq-greedy", "interleaved-balanced", "interleaved-balanced-zbv", "interleaved-balanced-greedy",
         "interleaved-balanced-gpipe"]


def run(placement: Placement, schedule: Schedule) -> LocalRun:
    r = local_run(SPEC, placement, schedule, NumpyBackend(), toy_batches(SPEC, B), mse_loss)
    r.step()
    return r


@pytest.fixture(scope="module")
def reference() -> LocalRun:
    """One chunk holding the whole model on one device."""
    single = from_cuts("sequential", [0, SPEC.num_layers], [0], 1, "relay", "single")
    return run(single, lower(gpipe(single, M), SPEC, single))


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_gradients_match_single_device(case: str, P: int, reference: LocalRun) -> None:
    placement = placement_for(case, P)
    got = run(placement, schedule_for(case, placement))
    ref_grads, grads = reference.gradients(), got.gradients()
    assert grads.keys() == ref_grads.keys()
    worst = max(float(np.max(np.abs(grads[k] - ref_grads[k]))) for k in ref_grads)
    assert worst < 1e-10, f"{case} P={P}: gradients differ by {worst}"
    assert got.loss() == pytest.approx(reference.loss(), abs=1e-12)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_bytes_per_peer_equal_traffic_prediction(case: str, P: int) -> None:
    placement = placement_for(case, P)
    got = run(placement, schedule_for(case, placement))
    expected: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(SPEC, placement):  # per sample: forward one way, gradient back
        expected[(tr.src_device, tr.dst_device)] += tr.total_bytes * B * M
        expected[(tr.dst_device, tr.src_device)] += tr.total_bytes * B * M
    for src in range(P):
        for dst in range(P):
            assert got.network.bytes_between(src, dst) == expected.get((src, dst), 0), (case, src, dst)
    assert len(got.network.log) == 2 * M * sum(len(got.executors[0].wiring.payload(t))
                                               for t in range(len(transfers(SPEC, placement))))


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", ["v-greedy", "v-zbv", "wave-greedy", "pulse-v", "pulse-wave"])
def test_skip_local_placements_send_no_skip(case: str, P: int) -> None:
    placement = placement_for(case, P)
    assert skips_leaving_device(SPEC, placement) == []
    got = run(placement, schedule_for(case, placement))
    skip_keys = {e.key for e in SPEC.skips}
    sent = {m.tag.name for m in got.network.log}
    assert sent and not sent & skip_keys, f"skip tensors crossed devices: {sorted(sent & skip_keys)}"
    assert sent == {MAIN, "temb"}


@pytest.mark.parametrize("case", ["seq-1f1b", "seq-direct-1f1b", "interleaved", "v-crossing-greedy"])
def test_sequential_placements_do_send_skips(case: str) -> None:
    """The check above has teeth: the baselines' logs do carry skip tensors, and so does a V whose
    cuts leave skips off their device; exactly those skips."""
    placement = placement_for(case, 2)
    got = run(placement, schedule_for(case, placement))
    sent = {m.tag.name for m in got.network.log} & {e.key for e in SPEC.skips}
    assert sent
    if placement.skip_transport == "direct":
        assert sent == set(skips_leaving_device(SPEC, placement))


def test_training_steps_follow_single_device(reference: LocalRun) -> None:
    """Three SGD steps under V and on one device leave the same parameters."""
    placement = placement_for("v-greedy", 2)
    single = from_cuts("sequential", [0, SPEC.num_layers], [0], 1, "relay", "single")
    runs = [local_run(SPEC, p, lower(g(p, M), SPEC, p), NumpyBackend(lr=0.5),
                      toy_batches(SPEC, B), mse_loss)
            for p, g in ((single, gpipe), (placement, greedy_v_1f1b))]
    losses = [[], []]
    for _ in range(3):
        for i, r in enumerate(runs):
            r.step(optimize=True)
            losses[i].append(r.loss())
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    assert losses[0][-1] < losses[0][0]
    params = [{n: p for ex in r.executors for h in ex.chunks.values()
               for n, p in ex.backend.parameters(h).items()} for r in runs]
    assert max(float(np.max(np.abs(params[0][k] - params[1][k]))) for k in params[0]) < 1e-10
