"""Data-parallel buckets layer group by layer group (pulse.grad_buckets), as DDP's: cut from the
chunk's last layer, launched inside its last backward as their gradients become final, and
priced there by the simulator."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from pulse.costs import CostTable
from pulse.grad_buckets import bucket_layers
from pulse.hardware import load_cluster
from pulse.placement import from_cuts
from pulse.schedule.generators import greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.lower import lower
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, bucket_spans, step_time
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec

M, B = 4, 2
SPEC = toy_unet_spec(depth=3)


def test_buckets_are_cut_from_the_last_layer_whole_layers_each() -> None:
    assert bucket_layers([10, 10, 10, 10], cap=20) == [(2, 4), (0, 2)]
    assert bucket_layers([10, 10, 10, 10], cap=25) == [(1, 4), (0, 1)]  # closes once it holds the cap
    assert bucket_layers([5, 100, 5], cap=50) == [(1, 3), (0, 1)]  # a layer over the cap is never split
    assert bucket_layers([1, 2, 3], cap=10 ** 9) == [(0, 3)]
    assert bucket_layers([0, 0], cap=1) == [(0, 2)]  # nothing to reduce: still one all-reduce to meet in
    assert bucket_layers([]) == []
    with pytest.raises(ValueError, match="cap must be positive"):
        bucket_layers([1], cap=0)


def test_buckets_cover_every_layer_once_in_backward_order() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 7, 30, 100]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([1, 10, 50, 1000])
        buckets = bucket_layers(sizes, cap)
        assert buckets[0][1] == len(sizes) and buckets[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(buckets, buckets[1:]))  # contiguous, last layers first
        # every bucket but the last holds at least the cap; none holds a layer more than it needs
        assert all(sum(sizes[s:e]) >= cap and sum(sizes[s + 1:e]) < cap for s, e in buckets[:-1])


class _Recorder:
    """Wraps a rank's communicator: each bucket's elements, and the action its rank was running
    when it launched (B or W: inside the backward; AR: after it)."""

    def __init__(self, executor) -> None:
        self.inner, self.executor, self.launches = executor.comm, executor, []
        self.known = []  # (chunk, its gradients the backend had reported final) at each launch
        executor.grad_sync.comm = executor.comm = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce_async(self, flat, group, timeout=None):
        action = self.executor.actions[self.executor.position]
        self.launches.append((int(np.prod(flat.shape)), action.kind))
        self.known.append((action.chunk, len(self.executor.grad_sync._final.get(action.chunk, ()))))
        return self.inner.all_reduce_async(flat, group, timeout)


def _expected_average(dp: int) -> dict[str, np.ndarray]:
    single = from_cuts("sequential", [0, SPEC.num_layers], [0], 1, "relay", "single")
    grads = []
    for r in range(dp):
        run = local_run(SPEC, single, lower(one_f_one_b(single, M), SPEC, single), NumpyBackend(),
                        toy_batches(SPEC, B, seed=r), mse_loss)
        run.step()
        grads.append(run.gradients())
    return {k: sum(g[k] for g in grads) / dp for k in grads[0]}


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v], ids=["whole-backward", "split-backward"])
def test_buckets_launch_inside_the_last_backward_and_average_exactly(generator) -> None:
    placement = toy_placement(SPEC, "v", 2)
    program = lower(generator(placement, M), SPEC, placement)
    dp = 2
    run = local_run(SPEC, placement, program, NumpyBackend(), [toy_batches(SPEC, B, seed=r) for r in range(dp)],
                    mse_loss, dp=dp, overlap_dp=True)
    for ex in run.executors:
        ex.grad_sync.cap = 1  # every layer a bucket of its own
        _Recorder(ex)
    run.step()
    expected = _expected_average(dp)
    for r in range(dp):
        grads = run.gradients(replica=r)
        assert max(float(np.max(np.abs(grads[k] - expected[k]))) for k in expected) < 1e-12
    for ex in run.executors:
        # one bucket per layer, the chunks in their ARs' order, each from its last layer to its first
        finals = [a.chunk for a in ex.actions if a.kind == "AR"]
        expected_sizes = [sum(p.size for p in layer.params.values())
                          for c in finals for layer in reversed(ex.chunks[c].layers)]
        assert [size for size, _ in ex.comm.launches] == expected_sizes
        # every one launched while the chunk's last backward still ran, none waiting for the AR
        assert {kind for _, kind in ex.comm.launches} == {"B" if generator is greedy_v_1f1b else "W"}
    for a, b in zip(run.replica(0), run.replica(1)):  # the same order on the other replica, as NCCL needs
        assert a.comm.launches == b.comm.launches


def _toy_costs(spec, per_layer: float = 1e-3) -> CostTable:
    n = spec.num_layers
    return CostTable(spec.name, 1, tuple(l.name for l in spec.layers), (per_layer,) * n, (2 * per_layer,) * n,
                     (0,) * n)


def test_the_simulator_starts_each_bucket_where_the_backward_has_passed_its_layers() -> None:
    spec = toy_unet_spec(depth=3)
    placement = from_cuts("sequential", [0, spec.num_layers], [0], 1, "relay", "single")
    costs = _toy_costs(spec)
    cluster = load_cluster("v100-pcie-2x8")
    result = simulate(spec, placement, lower(one_f_one_b(placement, 2), spec, placement), costs, cluster)
    terms = StepTerms(dp=2, bucket_cap=1)  # one bucket per layer
    spans = bucket_spans(spec, placement, result, cluster, terms, costs)
    last_b = max((s for s in result.compute if s.kind == "B"), key=lambda s: s.end)
    n = spec.num_layers
    # equal layers: layer l's bucket is final once the walk from the last layer has done n - l of n
    assert [round(s.ready, 12) for s in spans] == \
        [round(last_b.start + (n - l) / n * (last_b.end - last_b.start), 12) for l in range(n - 1, -1, -1)]
    assert all(b.start >= a.end for a, b in zip(spans, spans[1:]))  # one after another on the rank
    assert [s.nbytes for s in spans] == [spec.layers[l].params * 4 for l in range(n - 1, -1, -1)]
    # a backend whose backward yields nothing before its end launches them all at the AR
    at_end = bucket_spans(spec, placement, result, replace(cluster, buckets_at_chunk_end=True), terms, costs)
    assert {s.ready for s in at_end} == {last_b.end}


def test_layer_buckets_hide_more_of_the_all_reduce_than_one_per_chunk() -> None:
    spec = toy_unet_spec(depth=3, width=64)
    placement = toy_placement(spec, "v", 2)
    costs = _toy_costs(spec, per_layer=2e-4)
    cluster = load_cluster("v100-pcie-2x8")
    slow = replace(cluster.hardware, intra_node_bandwidth=2e6, inter_node_bandwidth=2e6)
    cluster = replace(cluster, hardware=slow)  # all-reduces as long as the backwards they hide behind
    result = simulate(spec, placement, lower(greedy_v_1f1b(placement, 4), spec, placement), costs, cluster)
    whole = step_time(spec, placement, costs, cluster, result, StepTerms(dp=8, bucket_cap=10 ** 12))
    layered = step_time(spec, placement, costs, cluster, result, StepTerms(dp=8, bucket_cap=1))
    assert layered.allreduce_bytes(8) == whole.allreduce_bytes(8)  # the same gradients on the wire
    assert 0 < layered.exposed_allreduce < whole.exposed_allreduce


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v], ids=["whole-backward", "split-backward"])
def test_torch_buckets_launch_inside_the_last_backward_and_average_as_after_the_step(generator) -> None:
    from backend_rigs import rig

    r = rig("torch")
    spec = r.spec("tiny-unet")
    placement = _v_placement(spec)
    program = lower(generator(placement, 2), spec, placement)

    def run(overlap: bool):
        job = local_run(spec, placement, program, r.make_backend(lr=1e-2, weight_decay=0.0),
                        [r.make_batches(spec)] * 2, r.loss_fn, dp=2, overlap_dp=overlap)
        for ex in job.executors if overlap else ():
            ex.grad_sync.cap = 1
            _Recorder(ex)
        job.step()
        return job

    layered, after = run(True), run(False)
    for replica in (0, 1):
        got, want = layered.gradients(replica), after.gradients(replica)
        assert got.keys() == want.keys()
        assert all(np.array_equal(r.to_numpy(got[k]), r.to_numpy(want[k])) for k in want)
    for ex in layered.executors:
        layers = sum(placement.chunks[c].end - placement.chunks[c].start for c in placement.chunks_of(ex.device))
        assert len(ex.comm.launches) == layers  # a bucket per layer
        # each launched while the chunk's last backward ran (W when split), none waiting for the AR,
        # the first of each chunk before all its gradients were made: the walk goes last layer first
        assert {kind for _, kind in ex.comm.launches} == {"B" if generator is greedy_v_1f1b else "W"}
        for chunk in placement.chunks_of(ex.device):
            first = next(known for c, known in ex.comm.known if c == chunk)
            assert first < len(ex.backend.parameters(ex.chunks[chunk]))  # not all of them yet


def _v_placement(spec):
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_hardware
    from pulse.partition import partition

    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    return partition("pulse", spec, costs, 2)


def test_the_bucket_flag_reaches_the_ranks_and_the_prediction(monkeypatch) -> None:
    """``--bucket-cap-mb``: the run's ranks cut their buckets by it, and the plan is priced with it."""
    from pulse.costs import AnalyticProfiler
    from pulse.planner import PlanRequest, make_plan
    from pulse.runtime.from_plan import executor_for_rank
    from pulse.train.run_config import RunConfig
    from pulse.zoo import get_spec

    assert RunConfig(bucket_cap_mb=0.5).bucket_bytes == 2 ** 19
    spec = get_spec("tiny-unet")
    cluster = load_cluster("v100-pcie-2x8")
    slow = replace(cluster, hardware=replace(cluster.hardware, intra_node_bandwidth=2e5, inter_node_bandwidth=2e5))
    costs = AnalyticProfiler(slow.hardware).profile(spec, 1)
    request = PlanRequest("tiny-unet", "v100-pcie-2x8", pp=2, dp=8, microbatch_size=1, schedule="greedy_v_1f1b")
    whole = make_plan(spec, costs, slow, request)
    layered = make_plan(spec, costs, slow, replace(request, bucket_cap=1))
    # a bucket per layer: each its own all-reduce, with its own latency, priced where the backward makes it
    assert layered.predicted["step_seconds"] != whole.predicted["step_seconds"]
    import pulse.runtime.from_plan as from_plan

    built = {}
    monkeypatch.setattr(from_plan, "StageExecutor", lambda **kwargs: built.update(kwargs))
    executor_for_rank(layered, spec, 0, None, None, None, None, overlap_dp=True,
                      bucket_cap=RunConfig(bucket_cap_mb=0.5).bucket_bytes)
    assert built["bucket_cap"] == 2 ** 19 and built["overlap_dp"]


def test_torch_reports_each_gradient_once_last_layers_first_frozen_ones_at_once() -> None:
    from backend_rigs import rig

    r = rig("torch")
    spec = r.spec("tiny-unet")
    single = from_cuts("sequential", [0, spec.num_layers], [0], 1, "relay", "single")
    backend = r.make_backend(lr=1e-2, weight_decay=0.0)
    run = local_run(spec, single, lower(one_f_one_b(single, 1), spec, single), backend, r.make_batches(spec),
                    r.loss_fn)
    chunk = run.executors[0].chunks[0]
    frozen = {n for n, p in backend.parameters(chunk).items() if backend.parameter_layers(chunk)[n] == 1}
    for name, p in backend.parameters(chunk).items():
        p.requires_grad_(name not in frozen)
    seen: list[str] = []
    unwatch = backend.watch_gradients(chunk, lambda name, grad: seen.append(name))
    assert set(seen) == frozen  # no gradient will come: final from the start
    run.step()
    unwatch()
    assert sorted(seen) == sorted(backend.parameters(chunk))  # each once
    layer = backend.parameter_layers(chunk)
    walked = [layer[n] for n in seen[len(frozen):]]
    assert walked == sorted(walked, reverse=True)  # the backward's walk: the last layers first
    run.step()
    assert len(seen) == len(backend.parameters(chunk))  # unwatched: nothing more
