"""The runtime's guarantees, checked for every backend through one pytest parameter.

For each backend (PyTorch, MindSpore; a missing framework skips its cases)
and each placement and schedule at P = 2 and 4, one training step over the
fake in-process network must give:
  - the parameter gradients and loss of single-device training (the same
    backend running the whole model as one chunk on one device),
  - exactly the bytes per device pair that pulse.traffic predicts,
  - no skip tensor on the wire under the skip-local (pulse) placements,
  - the simulator's peak skip-cache bytes on every device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import pytest

from pulse.costs import AnalyticProfiler
from pulse.errors import PlanError
from pulse.hardware import Cluster, load_hardware
from pulse.partition import partition
from pulse.partition.interleaved import interleaved_placement
from pulse.placement import Chunk, Placement
from pulse.testing.local import local_run
from pulse.schedule.generators import make_schedule
from pulse.schedule.lower import lower
from pulse.sim.engine import simulate
from pulse.traffic import transfers
from pulse.zoo import get_spec

MBS = 1


@dataclass(frozen=True)
class Harness:
    name: str
    make_backend: Callable[[], Any]
    batches: Callable[[Any], Callable[[int], dict]]
    loss_fn: Callable
    to_numpy: Callable[[Any], np.ndarray]
    tolerance: float


@lru_cache(maxsize=None)
def harness(name: str) -> Harness:
    if name == "torch":
        pytest.importorskip("torch")
        from pulse_torch.backend import TorchBackend
        from pulse_torch.diffusion import eps_loss
        from torch_worker_check import make_batches

        return Harness(name, TorchBackend, lambda spec: make_batches(spec, MBS), eps_loss,
                       lambda t: t.detach().cpu().numpy(), 1e-5)
    pytest.importorskip("mindspore")
    from pulse_mindspore.backend import MindSporeBackend
    from mindspore_worker_check import make_batches
    from pulse_mindspore.diffusion import eps_loss

    return Harness(name, MindSporeBackend, lambda spec: make_batches(spec, MBS), eps_loss,
                   lambda t: t.asnumpy(), 1e-4)


CLUSTER = Cluster("cpu", load_hardware("cpu-local"), nodes=1)
# (model, partitioner, folds, schedule, P): every placement kind and schedule family at P = 2 and 4
CASES = [
    ("tiny-uvit", "sequential", 1, "1f1b", 2),
    ("tiny-uvit", "sequential", 1, "1f1b", 4),
    ("tiny-uvit", "sequential", 1, "gpipe", 4),
    ("tiny-uvit", "pulse", 1, "greedy_v_1f1b", 2),
    ("tiny-uvit", "pulse", 1, "greedy_v_1f1b", 4),
    ("tiny-uvit", "pulse", 1, "zero_bubble_v", 4),
    ("tiny-uvit", "pulse", 2, "greedy_v_1f1b", 2),
    ("tiny-unet", "pulse", 1, "greedy_v_1f1b", 2),
]
# MindSpore 2.10's CPU convolutions take seconds even at tiny-unet's size (over two minutes for one
# P = 4 step here), so the UNet at P = 4 runs on PyTorch only; the U-ViT cases cover P = 4 for both.
TORCH_ONLY = [
    ("tiny-unet", "sequential", 1, "1f1b", 4),
    ("tiny-unet", "pulse", 1, "zero_bubble_v", 4),
    # schedules the tuner offers the sequential baselines: zero-bubble on one chunk per device,
    # interleaved 1F1B and zero-bubble on two (folds here: chunks per device)
    ("tiny-uvit", "sequential", 1, "zero_bubble_v", 4),
    ("tiny-uvit", "interleaved", 2, "interleaved_1f1b", 4),
    ("tiny-uvit", "interleaved", 2, "zero_bubble_v", 2),
]


def spec_of(model: str):
    return get_spec(model).with_act_bytes(4)  # float32 on the wire


@lru_cache(maxsize=None)
def reference(backend_name: str, model: str, microbatches: int) -> tuple[dict[str, np.ndarray], float]:
    """Single-device training: the whole model as one chunk on one device."""
    h = harness(backend_name)
    spec = spec_of(model)
    whole = Placement("sequential", 1, (Chunk(0, spec.num_layers, 0),), "relay", "single")
    program = lower(make_schedule("1f1b", whole, microbatches), spec, whole)
    run = local_run(spec, whole, program, h.make_backend(), h.batches(spec), h.loss_fn)
    run.step()
    return {k: h.to_numpy(v) for k, v in run.gradients().items()}, run.loss()


def max_relative_error(got: dict, ref: dict, floor: float = 1e-6) -> float:
    assert got.keys() == ref.keys()
    scale = max(float(np.abs(r).max()) for r in ref.values())
    return max(float(np.abs(got[k] - r).max()) / max(float(np.abs(r).max()), floor * scale) for k, r in ref.items())


# tests/test_backends.py runs these on MindSpore already (with its byte counts): not twice
MINDSPORE_ELSEWHERE = {("tiny-unet", "pulse", 1, "greedy_v_1f1b", 2), ("tiny-uvit", "sequential", 1, "1f1b", 2),
                       ("tiny-uvit", "pulse", 1, "greedy_v_1f1b", 2)}
# MindSpore's P = 4 steps cost 20-100 s each on two cores; the executor that orders them is shared, so P = 4
# runs the V placements on MindSpore (they exercise its skip cache and chunk pairs) and the sequential
# relays at P = 4 on PyTorch only (MindSpore's sequential relay is checked at P = 2 above)
MINDSPORE_ELSEWHERE |= {("tiny-uvit", "sequential", 1, "1f1b", 4), ("tiny-uvit", "sequential", 1, "gpipe", 4)}
PARAMS = ([(b, *case) for case in CASES for b in ("torch", "mindspore")
           if not (b == "mindspore" and case in MINDSPORE_ELSEWHERE)] + [("torch", *case) for case in TORCH_ONLY])


@pytest.mark.parametrize("backend_name,model,partitioner,folds,schedule,P", PARAMS,
                         ids=[f"{b}-{m}-{p}{'' if k == 1 else k}-{s}-P{n}" for b, m, p, k, s, n in PARAMS])
def test_one_step_equals_single_device(backend_name, model, partitioner, folds, schedule, P):
    h = harness(backend_name)
    spec = spec_of(model)
    costs = AnalyticProfiler(CLUSTER.hardware).profile(spec, MBS)
    try:
        placement = (interleaved_placement(spec, costs, P, virtual=folds) if partitioner == "interleaved"
                     else partition(partitioner, spec, costs, P, folds=folds))
    except PlanError as exc:
        pytest.skip(f"{model} cannot hold this placement: {exc}")
    M = P
    compute = make_schedule(schedule, placement, M, costs)
    run = local_run(spec, placement, lower(compute, spec, placement), h.make_backend(), h.batches(spec),
                    h.loss_fn)
    stats = run.step()

    ref_grads, ref_loss = reference(backend_name, model, M)
    got = {k: h.to_numpy(v) for k, v in run.gradients().items()}
    assert max_relative_error(got, ref_grads) < h.tolerance
    assert run.loss() == pytest.approx(ref_loss, rel=1e-5)

    expected: dict[tuple[int, int], int] = {}
    for tr in transfers(spec, placement):  # activations one way, gradients back
        for pair in ((tr.src_device, tr.dst_device), (tr.dst_device, tr.src_device)):
            expected[pair] = expected.get(pair, 0) + tr.total_bytes * MBS * M
    moved = {(s, d): run.network.bytes_between(s, d) for s in range(P) for d in range(P)}
    assert {k: v for k, v in moved.items() if v} == expected

    skip_keys = {e.key for e in spec.skips}
    sent_skips = {m.tag.name for m in run.network.log if m.tag.name in skip_keys}
    if partitioner == "pulse":
        assert sent_skips == set()
    elif spec.skips:
        assert sent_skips  # the relaying baseline really does send them: the check can fail

    sim = simulate(spec, placement, compute, costs, CLUSTER)
    assert [stats[r].peak_skip_bytes for r in range(P)] == list(sim.peak_skip_cache)
