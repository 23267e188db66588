"""The MindSpore backend on the fake network: a pipeline step trains the single-device model.

For tiny-unet and tiny-uvit at P = 2, float32, M = P microbatches of one
sample (MindSpore's PyNative CPU kernels are slow; M = P already runs every
warm-up, steady and cool-down slot of these schedules): one step under the sequential placement (1F1B) and the pulse V
placement (greedy V-1F1B) gives the gradients and the loss of the whole model
built once by ``build_model`` and differentiated with ``mindspore.vjp`` (not
by the backend under test), and the fake network counts exactly the bytes
``pulse.traffic`` predicts. Skipped without MindSpore.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

try:
    import pulse_mindspore  # noqa: F401
except ImportError:  # the package is not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Placement  # noqa: E402
from pulse.train.loop import ScaledLoss, clip_gradients  # noqa: E402
from pulse.train.schedules import DynamicLossScale  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.runtime.protocols import Backend  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.traffic import transfers  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402
from pulse_mindspore.diffusion import eps_loss, make_batches  # noqa: E402
from pulse_mindspore.worker_check import reference_gradients  # noqa: E402
from pulse_mindspore.model import build_model  # noqa: E402

P = 2
M = P
MBS = 1  # samples per microbatch
TOL = 1e-4  # float32: the pipeline sums skip and shared-input gradients in another order
CASES = [("tiny-unet", "sequential", "1f1b"), ("tiny-unet", "pulse", "greedy_v_1f1b"),
         ("tiny-uvit", "sequential", "1f1b"), ("tiny-uvit", "pulse", "greedy_v_1f1b")]


def spec_of(model: str) -> ModelSpec:
    return get_spec(model).with_act_bytes(4)  # float32 on the wire


@lru_cache(maxsize=None)
def placement_for(model: str, partitioner: str) -> Placement:
    spec = spec_of(model)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    return partition(partitioner, spec, costs, P)


@lru_cache(maxsize=None)
def reference(model: str) -> tuple[dict[str, np.ndarray], float]:
    """Gradients and mean loss of the whole model over the M microbatches, loss gradient scaled by 1/M."""
    return reference_gradients(spec_of(model), M, MBS)


def max_relative_error(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], floor: float = 1e-6) -> float:
    """max |got - ref| / max |ref| over tensors, the denominator floored at ``floor`` x the largest entry."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))[:6]
    scale = max(float(np.abs(r).max()) for r in ref.values())
    return max(float(np.abs(got[k] - r).max()) / max(float(np.abs(r).max()), floor * scale) for k, r in ref.items())


@pytest.mark.parametrize("model,partitioner,schedule", CASES, ids=["-".join(c) for c in CASES])
def test_pipeline_step_equals_single_device(model: str, partitioner: str, schedule: str) -> None:
    spec = spec_of(model)
    placement = placement_for(model, partitioner)
    program = lower(make_schedule(schedule, placement, M), spec, placement)
    run = local_run(spec, placement, program, MindSporeBackend(), make_batches(spec, MBS), eps_loss)
    run.step()
    ref_grads, ref_loss = reference(model)
    got = {k: v.asnumpy() for k, v in run.gradients().items()}
    err = max_relative_error(got, ref_grads)
    assert err < TOL, f"{model} {partitioner} {schedule}: gradients differ by {err:.2e} (relative)"
    assert run.loss() == pytest.approx(ref_loss, rel=1e-6)
    expected: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):  # per sample: activations one way, gradients back
        expected[(tr.src_device, tr.dst_device)] += tr.total_bytes * MBS * M
        expected[(tr.dst_device, tr.src_device)] += tr.total_bytes * MBS * M
    moved = {(s, d): run.network.bytes_between(s, d) for s in range(P) for d in range(P)}
    assert {k: v for k, v in moved.items() if v} == dict(expected)


def test_split_backward_accumulates_the_same_gradients() -> None:
    """Zero-bubble V (B then W): the weight half comes from the same vjp call, accumulated at W."""
    spec = spec_of("tiny-uvit")
    placement = placement_for("tiny-uvit", "pulse")
    program = lower(make_schedule("zero_bubble_v", placement, M), spec, placement)
    assert any(a.kind == "W" for acts in program.actions.values() for a in acts)
    run = local_run(spec, placement, program, MindSporeBackend(), make_batches(spec, MBS), eps_loss)
    run.step()
    ref_grads, _ = reference("tiny-uvit")
    assert max_relative_error({k: v.asnumpy() for k, v in run.gradients().items()}, ref_grads) < TOL


def test_chunks_hold_the_reference_weights_and_adamw_is_torchs() -> None:
    """Weights depend on the layer, not the chunk; one AdamW step is PyTorch's update rule."""
    spec = spec_of("tiny-uvit")
    placement = placement_for("tiny-uvit", "pulse")
    backend = MindSporeBackend(lr=1e-2, weight_decay=0.1)
    program = lower(make_schedule("greedy_v_1f1b", placement, M), spec, placement)
    run = local_run(spec, placement, program, backend, make_batches(spec, MBS), eps_loss)
    ref = {n: p.asnumpy() for n, p in build_model(spec, seed=0).params_by_name().items()}
    chunks = [c for ex in run.executors for c in ex.chunks.values()]
    mine = {n: p for c in chunks for n, p in backend.parameters(c).items()}
    assert mine.keys() == ref.keys()
    assert all(np.array_equal(mine[n].asnumpy(), ref[n]) for n in ref)
    grads = {n: np.random.default_rng(i).standard_normal(ref[n].shape).astype(np.float32)
             for i, n in enumerate(sorted(ref))}
    for c in chunks:
        backend.set_gradients(c, {n: grads[n] for n in backend.parameters(c)})
        backend.optimizer_step(c)
    for n, w in ref.items():  # torch.optim.AdamW, first step: bias-corrected m / sqrt(v) = sign(g)
        g = grads[n].astype(np.float64)
        m, v = 0.1 * g / (1 - 0.9), 0.001 * g * g / (1 - 0.999)
        want = w * (1 - 1e-2 * 0.1) - 1e-2 * m / (np.sqrt(v) + 1e-8)
        assert np.allclose(mine[n].asnumpy(), want, rtol=0, atol=1e-6), n


def test_backend_protocol_and_tensor_helpers() -> None:
    backend = MindSporeBackend()
    assert isinstance(backend, Backend)
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = backend.from_numpy(a)
    assert t.dtype == ms.float32 and backend.nbytes(t) == 24
    assert np.array_equal(backend.to_numpy(backend.scale(backend.add(t, t), 0.5)), a)
    assert backend.from_numpy(np.arange(3)).dtype == ms.int64  # integers keep their type
    assert np.array_equal(backend.to_numpy(backend.zeros_like(t)), np.zeros((2, 3)))


def test_clip_gradients_bounds_the_norm_over_all_chunks() -> None:
    spec = spec_of("tiny-uvit")
    placement = placement_for("tiny-uvit", "sequential")
    backend = MindSporeBackend()
    program = lower(make_schedule("1f1b", placement, M), spec, placement)
    run = local_run(spec, placement, program, backend, make_batches(spec, MBS), eps_loss)
    chunks = [c for ex in run.executors for c in ex.chunks.values()]
    rng = np.random.default_rng(0)
    for c in chunks:  # the clipping maths needs gradients, not a step
        backend.set_gradients(c, {n: rng.standard_normal(p.shape) for n, p in backend.parameters(c).items()})
    total = np.sqrt(sum(float(np.square(g.asnumpy().astype(np.float64)).sum())
                        for c in chunks for g in backend.gradients(c).values()))
    before = clip_gradients(backend, chunks, None, (), 1e-3)
    assert before == pytest.approx(total, rel=1e-6)
    after = np.sqrt(sum(float(np.square(g.asnumpy().astype(np.float64)).sum())
                        for c in chunks for g in backend.gradients(c).values()))
    assert after == pytest.approx(1e-3, rel=1e-4)


def test_fp16_mixed_precision_pipeline_equals_single_device_under_the_same_casts() -> None:
    """``--precision fp16`` on MindSpore: cells compute in float16 from float32 parameters (norms in float32).

    Pipelined (pp 2 V) against one device under the same casts and loss scale (2^10, unscaled here
    as the loop does): the same ops, but gradients that several chunks feed are summed in another
    order in float16: measured 1.1e-3 worst tensor (tolerance 5e-3); a wiring error would be O(1).
    The gradients reach the float32 parameters as float32, and the compute did change against
    float32 (1.0e-2).
    """
    spec = spec_of("tiny-uvit")
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)

    def step(pp: int, compute: ms.Type | None) -> tuple[dict[str, np.ndarray], float]:
        placement = partition("pulse" if pp > 1 else "sequential", spec, costs, pp)
        program = lower(make_schedule("greedy_v_1f1b" if pp > 1 else "gpipe", placement, M), spec, placement)
        backend, scaler = MindSporeBackend(compute_dtype=compute), DynamicLossScale(scale=2.0 ** 10)  # as fp16 trains
        run = local_run(spec, placement, program, backend, make_batches(spec, MBS), ScaledLoss(eps_loss, backend, scaler))
        run.step()
        return {k: v.asnumpy() / scaler.scale for k, v in run.gradients().items()}, run.loss()

    single, single_loss = step(1, ms.float16)
    pipelined, pipelined_loss = step(2, ms.float16)
    assert single.keys() == pipelined.keys() and {g.dtype for g in single.values()} == {np.dtype("float32")}
    assert max_relative_error(pipelined, single) < 5e-3
    assert pipelined_loss == pytest.approx(single_loss, rel=1e-6)
    fp32, _ = reference("tiny-uvit")  # float32, the same batches (cached: other tests compute it too)
    assert max_relative_error(single, fp32) > 1e-3  # the casts really changed the compute
