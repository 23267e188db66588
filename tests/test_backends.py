"""Every backend on the fake network trains the single-device model: one test per behaviour, one
pytest parameter per backend (``backend_rigs``; a missing framework skips its cases).

The pipeline step: M = (2 on PyTorch, 1 on MindSpore) x P microbatches of one
sample, one step under a placement (sequential, interleaved with 2 chunks per
device, pulse V, pulse wave with 2 folds) and a schedule that accepts it gives
the gradients and the loss of the whole model built once by ``build_model``
(not by the backend under test), the fake network counts exactly the bytes
``pulse.traffic`` predicts, and the skip-local placements send no skip tensor.
PyTorch (float64) runs tiny-unet, tiny-uvit and tiny-dit at P = 2 and 4 under
every placement and every schedule it accepts; MindSpore (float32, PyNative
CPU kernels are slow) runs tiny-unet and tiny-uvit at P = 2 under the
sequential placement (1F1B) and the V one (greedy V-1F1B; zero-bubble V for
the split backward).

``tests/test_backends_runtime.py`` checks the same step against the backend's
own one-device run, with the simulator's skip-cache peaks.
"""
from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import numpy as np
import pytest

from backend_rigs import BACKENDS, MBS, max_relative_error, rig, spec_of
from pulse.costs import AnalyticProfiler
from pulse.errors import PlanError
from pulse.hardware import load_hardware
from pulse.partition import partition
from pulse.partition.common import prefix_times
from pulse.partition.sequential import balanced_cuts
from pulse.placement import Placement, from_cuts, interleaved_devices
from pulse.runtime.protocols import Backend
from pulse.runtime.wiring import Wiring
from pulse.schedule.generators import applicable_baselines, make_schedule
from pulse.schedule.lower import lower
from pulse.testing.local import local_run
from pulse.train.loop import clip_gradients
from pulse.traffic import transfers

MODELS = ["tiny-unet", "tiny-uvit", "tiny-dit"]
PLACEMENTS = ["sequential", "interleaved", "v", "wave"]
SKIP_LOCAL = {"v", "wave"}  # the pulse placements: every skip stays on its device
# backend -> (model, P, placement, schedule); None: every schedule the placement accepts
GRID = {
    "torch": [(model, P, kind, None) for model in MODELS for P in (2, 4) for kind in PLACEMENTS],
    "mindspore": [("tiny-unet", 2, "sequential", "1f1b"), ("tiny-unet", 2, "v", "greedy_v_1f1b"),
                  ("tiny-uvit", 2, "sequential", "1f1b"), ("tiny-uvit", 2, "v", "greedy_v_1f1b"),
                  ("tiny-uvit", 2, "v", "zero_bubble_v")],
}
LR, WEIGHT_DECAY = 1e-2, 0.1


@lru_cache(maxsize=None)
def placement_for(backend: str, model: str, kind: str, P: int) -> Placement:
    """Raises PlanError when the partitioner cannot place the model that way."""
    spec = spec_of(backend, model)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    if kind == "interleaved":  # Megatron's virtual stages: balanced cuts, chunk c on device c % P
        prefix = prefix_times(costs)
        _, cuts = balanced_cuts(spec.num_layers, 2 * P, lambda p, s, e: prefix[e] - prefix[s])
        return from_cuts("interleaved", cuts, interleaved_devices(P, 2), P, "relay", "test")
    if kind == "sequential":
        return partition("sequential", spec, costs, P)
    return partition("pulse", spec, costs, P, folds=1 if kind == "v" else 2)


def _cannot_hold(exc: PlanError) -> bool:
    """The partitioner's own words for 'too few layers / cut points for that many chunks'."""
    text = str(exc)
    return "too few for" in text or ("at most" in text and "devices with" in text)


def cases() -> list:
    out = []
    for backend, grid in GRID.items():
        for model, P, kind, schedule in grid:
            name = f"{backend}-{model}-P{P}-{kind}"
            try:
                placement = placement_for(backend, model, kind, P)
            except PlanError as exc:
                if not _cannot_hold(exc):
                    raise
                out.append(pytest.param(backend, model, P, kind, None, id=name,
                                        marks=pytest.mark.skip(reason=str(exc))))
                continue
            for s in [schedule] if schedule else applicable_baselines(placement, 2 * P):
                out.append(pytest.param(backend, model, P, kind, s, id=f"{name}-{s}"))
    return out


@pytest.mark.parametrize("backend,model,P,kind,schedule", cases())
def test_pipeline_step_equals_single_device(backend: str, model: str, P: int, kind: str, schedule: str) -> None:
    r = rig(backend)
    spec, M = r.spec(model), r.stage_microbatches * P
    placement = placement_for(backend, model, kind, P)
    program = lower(make_schedule(schedule, placement, M), spec, placement)
    if schedule.startswith("zero_bubble"):  # B then W: the weight half is accumulated at W
        assert any(a.kind == "W" for acts in program.actions.values() for a in acts)
    run = local_run(spec, placement, program, r.make_backend(), r.make_batches(spec), r.loss_fn)
    run.step()
    ref_grads, ref_loss = r.reference(spec, M)
    got = {k: r.to_numpy(v) for k, v in run.gradients().items()}
    err = max_relative_error(got, ref_grads)
    assert err < r.grad_tol, f"{model} {kind} {schedule} P={P}: gradients differ by {err:.2e} (relative)"
    assert run.loss() == pytest.approx(ref_loss, rel=r.loss_rel)
    expected: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):  # per sample: activations one way, gradients back
        expected[(tr.src_device, tr.dst_device)] += tr.total_bytes * MBS * M
        expected[(tr.dst_device, tr.src_device)] += tr.total_bytes * MBS * M
    moved = {(s, d): run.network.bytes_between(s, d) for s in range(P) for d in range(P)}
    assert {k: v for k, v in moved.items() if v} == dict(expected)
    sent, skip_keys = {m.tag.name for m in run.network.log}, {e.key for e in spec.skips}
    if kind in SKIP_LOCAL:
        assert sent and not sent & skip_keys, f"skip tensors crossed devices: {sent & skip_keys}"
    elif kind == "sequential" and skip_keys:  # the baseline relays skips: the check can fail
        assert sent & skip_keys


def adamw_first_step(w: np.ndarray, g: np.ndarray, lr: float, weight_decay: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> np.ndarray:
    """``torch.optim.AdamW``'s first update of weights ``w`` under gradients ``g`` (float64): decoupled
    decay, then the bias-corrected moments m / (sqrt(v) + eps)."""
    g = g.astype(np.float64)
    m = (1 - betas[0]) * g / (1 - betas[0])
    v = (1 - betas[1]) * g * g / (1 - betas[1])
    return w * (1 - lr * weight_decay) - lr * m / (np.sqrt(v) + eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_hold_the_reference_weights_and_adamw_matches(backend: str) -> None:
    """Weights depend on the layer, not the chunk; the step's AdamW update on every chunk is
    PyTorch's rule applied to the whole model with the pipeline's gradients."""
    r = rig(backend)
    spec, P = r.spec("tiny-uvit"), 2
    placement = placement_for(backend, "tiny-uvit", "v", P)
    program = lower(make_schedule("greedy_v_1f1b", placement, r.stage_microbatches * P), spec, placement)
    b = r.make_backend(lr=LR, weight_decay=WEIGHT_DECAY)
    run = local_run(spec, placement, program, b, r.make_batches(spec), r.loss_fn)
    ref = r.initial_weights(spec)
    mine = {n: p for ex in run.executors for c in ex.chunks.values() for n, p in b.parameters(c).items()}
    assert mine.keys() == ref.keys()
    assert all(np.array_equal(r.to_numpy(mine[n]), ref[n]) for n in ref)
    run.step(optimize=True)
    grads = {n: r.to_numpy(g) for n, g in run.gradients().items()}
    for n, w in ref.items():
        want = adamw_first_step(w, grads[n], LR, WEIGHT_DECAY)
        assert np.allclose(r.to_numpy(mine[n]), want, rtol=0, atol=r.adamw_atol), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_protocol_and_tensor_helpers(backend: str) -> None:
    r = rig(backend)
    b = r.make_backend()
    assert isinstance(b, Backend)
    other = np.float32 if r.act_bytes == 8 else np.float64  # the other float width: converted on the way in
    a = np.arange(6, dtype=other).reshape(2, 3)
    t = b.from_numpy(a)
    assert t.dtype == r.float_dtype and b.nbytes(t) == 6 * r.act_bytes
    assert np.array_equal(b.to_numpy(b.scale(b.add(t, t), 0.5)), a)
    assert b.from_numpy(np.arange(3)).dtype == r.int64_dtype  # integers keep their type
    assert np.array_equal(b.to_numpy(b.zeros_like(t)), np.zeros((2, 3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_gradients_bounds_the_norm_over_all_chunks(backend: str) -> None:
    r = rig(backend)
    spec, P = r.spec("tiny-uvit"), 2
    placement = placement_for(backend, "tiny-uvit", "sequential", P)
    b = r.make_backend()
    program = lower(make_schedule("1f1b", placement, 2), spec, placement)
    run = local_run(spec, placement, program, b, r.make_batches(spec), r.loss_fn)
    run.step()
    chunks = [c for ex in run.executors for c in ex.chunks.values()]

    def norm() -> float:  # float64 on the host, apart from the backend's own sum
        return float(np.sqrt(sum(np.square(r.to_numpy(g).astype(np.float64)).sum()
                                 for c in chunks for g in b.gradients(c).values())))

    total = norm()
    before = clip_gradients(b, chunks, None, (), 1e-3)
    assert before == pytest.approx(total, rel=1e-6) and before > 1e-3
    assert norm() == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wiring_of_a_dit_chunk_runs_alone(backend: str) -> None:
    """A chunk that starts after the conditioning layer reads 'c' and 'context' from its inputs."""
    r = rig(backend)
    spec = r.spec("tiny-dit")
    placement = placement_for(backend, "tiny-dit", "sequential", 2)
    io = Wiring(spec, placement).ios[1]
    assert set(io.shared_in) == {"c", "context"}
    chunk = r.make_backend().build_chunk(spec, io)
    assert list(chunk.layers) == [layer.name for layer in spec.layers[io.start:io.end]]
