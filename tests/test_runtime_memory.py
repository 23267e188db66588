"""The executor's memory figures: peak skip-cache bytes and live contexts per device,
against an independent count over the action lists and against the simulator."""
from __future__ import annotations

import pytest

from pulse.costs import CostTable
from pulse.hardware import load_cluster
from pulse.placement import Placement
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import gpipe, greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.ir import Schedule
from pulse.schedule.lower import lower
from pulse.sim import simulate
from pulse.spec import ModelSpec
from pulse.traffic import transfers

M, B = 6, 2
SPEC = toy_unet_spec(depth=7)


def unit_costs(spec: ModelSpec) -> CostTable:
    n = spec.num_layers
    return CostTable(spec.name, B, tuple(l.name for l in spec.layers), (1.0,) * n, (2.0,) * n, (0,) * n)


CASES = {
    "v-greedy": (lambda P: toy_placement(SPEC, "v", P), greedy_v_1f1b),
    "v-gpipe": (lambda P: toy_placement(SPEC, "v", P), gpipe),
    "v-zbv": (lambda P: toy_placement(SPEC, "v", P), zero_bubble_v),
    "wave-greedy": (lambda P: toy_placement(SPEC, "wave", P, folds=2), greedy_v_1f1b),
    "seq-1f1b": (lambda P: toy_placement(SPEC, "sequential", P), one_f_one_b),
    "seq-direct-gpipe": (lambda P: toy_placement(SPEC, "sequential", P, transport="direct"), gpipe),
}


def build(case: str, P: int) -> tuple[Placement, Schedule]:
    make_placement, generator = CASES[case]
    placement = make_placement(P)
    return placement, lower(generator(placement, M), SPEC, placement)


def skip_chunks(placement: Placement) -> list[tuple[str, int, int, int]]:
    """(key, producer chunk, consumer chunk, bytes per microbatch) of every skip."""
    return [(e.key, placement.chunk_of_layer(s), placement.chunk_of_layer(t), e.bytes * B)
            for s, t, e in SPEC.skip_spans()]


def expected_local_skip_peak(placement: Placement, schedule: Schedule, device: int) -> int:
    """Skips whose both ends sit on ``device`` in different chunks: held from the
    producer's F to the consumer's B (its W when the backward is split)."""
    carried = {k for tr in transfers(SPEC, placement) for k in tr.skips}
    row = [a for a in schedule.actions[device] if a.is_compute]
    split = any(a.kind == "W" for a in row)
    level = peak = 0
    for a in row:
        for key, src, dst, nbytes in skip_chunks(placement):
            if key in carried or src == dst or placement.chunks[src].device != device:
                continue
            if a.kind == "F" and a.chunk == src:
                level += nbytes
            if a.kind == ("W" if split else "B") and a.chunk == dst:
                level -= nbytes
        peak = max(peak, level)
    return peak


def expected_cache_total_peak(placement: Placement, schedule: Schedule, device: int) -> int:
    """Everything a rank's cache holds: skip values (local or in transit) and
    pending skip gradients, walked over the full action list."""
    msgs = {}
    for tr in transfers(SPEC, placement):
        msgs.setdefault((tr.src_chunk, tr.dst_chunk), []).append(sum(
            e.bytes * B for e in SPEC.skips if e.key in tr.skips))
    seen: dict = {}
    sizes = {key: (src, dst, n) for key, src, dst, n in skip_chunks(placement)}
    made = lambda c: sum(n for s, d, n in sizes.values() if s == c != d)
    used = lambda c: sum(n for s, d, n in sizes.values() if d == c != s)
    level = peak = 0
    for a in schedule.actions[device]:
        if a.kind in ("SF", "RF", "SB", "RB"):
            pair = (a.chunk, a.peer) if a.kind in ("SF", "RB") else (a.peer, a.chunk)
            k = seen.get((a.kind, pair, a.microbatch), 0)
            seen[(a.kind, pair, a.microbatch)] = k + 1
            level += msgs[pair][k] * (1 if a.kind in ("RF", "RB") else -1)
        elif a.kind == "F":
            level += made(a.chunk)
        elif a.kind == "B":  # produced skips' gradients handed over, consumed skips' gradients added
            level += used(a.chunk) - made(a.chunk)
        elif a.kind == "FREE":  # the consumed skips' values go (after B, or after W when split)
            level -= used(a.chunk)
        peak = max(peak, level)
    return peak


def expected_live_contexts(schedule: Schedule, device: int) -> int:
    split = any(a.kind == "W" for a in schedule.actions[device])
    level = peak = 0
    for a in schedule.actions[device]:
        level += {"F": 1, ("W" if split else "B"): -1}.get(a.kind, 0)
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_peaks_match_independent_count(case: str, P: int) -> None:
    placement, schedule = build(case, P)
    run = local_run(SPEC, placement, schedule, NumpyBackend(), toy_batches(SPEC, B), mse_loss)
    stats = run.step()
    for d in range(P):
        assert stats[d].peak_skip_bytes == expected_local_skip_peak(placement, schedule, d), (case, d)
        assert stats[d].peak_skip_cache_total == expected_cache_total_peak(placement, schedule, d), (case, d)
        assert stats[d].peak_live_contexts == expected_live_contexts(schedule, d), (case, d)
    if case.startswith(("v", "wave")):
        assert all(stats[d].peak_skip_bytes > 0 for d in range(P))
    else:
        assert all(stats[d].peak_skip_bytes == 0 for d in range(P))


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_peaks_and_link_bytes_match_simulator(case: str, P: int) -> None:
    placement, schedule = build(case, P)
    run = local_run(SPEC, placement, schedule, NumpyBackend(), toy_batches(SPEC, B), mse_loss)
    stats = run.step()
    sim = simulate(SPEC, placement, schedule, unit_costs(SPEC), load_cluster("v100-pcie-1x8"))
    assert tuple(stats[d].peak_skip_bytes for d in range(P)) == sim.peak_skip_cache
    assert tuple(stats[d].peak_inflight for d in range(P)) == sim.peak_inflight
    moved = {(s, d): run.network.bytes_between(s, d) for s in range(P) for d in range(P)}
    assert {k: v for k, v in moved.items() if v} == {k: v for k, v in sim.link_bytes.items() if v}
