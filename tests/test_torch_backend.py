"""The torch backend on the fake network: every placement and schedule trains the single-device model.

For tiny-unet, tiny-uvit and tiny-dit at P = 2 and 4, float64, M = 2P
microbatches of one sample: one step under every placement (sequential,
interleaved with 2 chunks per device, pulse V, pulse wave with 2 folds) and
every schedule that accepts it gives the gradients and the loss of the whole
model built once by ``build_model`` (not by the backend under test), and the
fake network counts exactly the bytes ``pulse.traffic`` predicts.
"""
from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import PlanError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.partition.common import prefix_times  # noqa: E402
from pulse.partition.sequential import balanced_cuts  # noqa: E402
from pulse.placement import Placement, from_cuts, interleaved_devices  # noqa: E402
from pulse.train.loop import clip_gradients  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.runtime.protocols import Backend  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.schedule.generators import applicable_baselines, make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.traffic import transfers  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.model import build_model  # noqa: E402
from pulse_torch.worker_check import make_batches, max_relative_error, reference_gradients  # noqa: E402

torch.set_num_threads(1)
MODELS = ["tiny-unet", "tiny-uvit", "tiny-dit"]
PLACEMENTS = ["sequential", "interleaved", "v", "wave"]
DTYPE = torch.float64
MBS = 1  # samples per microbatch
TOL = 1e-5


def spec_of(model: str) -> ModelSpec:
    return get_spec(model).with_act_bytes(8)  # float64 on the wire


@lru_cache(maxsize=None)
def placement_for(model: str, kind: str, P: int) -> Placement:
    """Raises PlanError when the partitioner cannot place the model that way."""
    spec = spec_of(model)
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
    for model in MODELS:
        for P in (2, 4):
            for kind in PLACEMENTS:
                try:
                    placement = placement_for(model, kind, P)
                except PlanError as exc:
                    if not _cannot_hold(exc):
                        raise
                    out.append(pytest.param(model, P, kind, None, id=f"{model}-P{P}-{kind}",
                                            marks=pytest.mark.skip(reason=str(exc))))
                    continue
                for name in applicable_baselines(placement, 2 * P):
                    out.append(pytest.param(model, P, kind, name, id=f"{model}-P{P}-{kind}-{name}"))
    return out


@lru_cache(maxsize=None)
def reference(model: str, P: int) -> tuple[dict[str, np.ndarray], float]:
    spec = spec_of(model)
    grads, losses = reference_gradients(spec, [make_batches(spec, MBS)], 2 * P, DTYPE)
    return grads, losses[0]


@pytest.mark.parametrize("model,P,kind,schedule", cases())
def test_pipeline_step_equals_single_device(model: str, P: int, kind: str, schedule: str) -> None:
    spec, M = spec_of(model), 2 * P
    placement = placement_for(model, kind, P)
    program = lower(make_schedule(schedule, placement, M), spec, placement)
    run = local_run(spec, placement, program, TorchBackend(dtype=DTYPE), make_batches(spec, MBS), eps_loss)
    run.step()
    ref_grads, ref_loss = reference(model, P)
    got = {k: v.numpy() for k, v in run.gradients().items()}
    err = max_relative_error(got, ref_grads)
    assert err < TOL, f"{model} {kind} {schedule} P={P}: gradients differ by {err:.2e} (relative)"
    assert run.loss() == pytest.approx(ref_loss, rel=1e-12)
    expected: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):  # per sample: activations one way, gradients back
        expected[(tr.src_device, tr.dst_device)] += tr.total_bytes * MBS * M
        expected[(tr.dst_device, tr.src_device)] += tr.total_bytes * MBS * M
    moved = {(s, d): run.network.bytes_between(s, d) for s in range(P) for d in range(P)}
    assert {k: v for k, v in moved.items() if v} == dict(expected)


def test_skip_local_placements_send_no_skip_tensor() -> None:
    spec, P = spec_of("tiny-unet"), 2
    placement = placement_for("tiny-unet", "v", P)
    program = lower(make_schedule("zero_bubble_v", placement, 2 * P), spec, placement)
    run = local_run(spec, placement, program, TorchBackend(dtype=DTYPE), make_batches(spec, MBS), eps_loss)
    run.step()
    sent = {m.tag.name for m in run.network.log}
    assert sent and not sent & {e.key for e in spec.skips}


def test_chunks_hold_the_reference_weights_and_adamw_matches() -> None:
    """Weights depend on the layer, not the chunk; one AdamW step per chunk equals one over the model."""
    spec, P = spec_of("tiny-uvit"), 2
    placement = placement_for("tiny-uvit", "v", P)
    program = lower(make_schedule("greedy_v_1f1b", placement, 2 * P), spec, placement)
    backend = TorchBackend(dtype=DTYPE, lr=1e-2, weight_decay=0.1)
    run = local_run(spec, placement, program, backend, make_batches(spec, MBS), eps_loss)
    model = build_model(spec, seed=0, dtype=DTYPE)
    params = {n[len("layers."):]: p for n, p in model.named_parameters()}
    mine = {n: p for ex in run.executors for c in ex.chunks.values() for n, p in backend.parameters(c).items()}
    assert mine.keys() == params.keys()
    assert all(torch.equal(mine[n], params[n]) for n in params)
    run.step(optimize=True)
    grads = run.gradients()
    for n, p in params.items():
        p.grad = grads[n].clone()
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    assert all(torch.allclose(mine[n], params[n], rtol=0, atol=1e-12) for n in params)


def test_backend_protocol_and_tensor_helpers() -> None:
    backend = TorchBackend(dtype=DTYPE)
    assert isinstance(backend, Backend)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = backend.from_numpy(a)
    assert t.dtype == DTYPE and backend.nbytes(t) == 48
    assert np.array_equal(backend.to_numpy(backend.scale(backend.add(t, t), 0.5)), a)
    assert backend.from_numpy(np.arange(3)).dtype == torch.int64  # integers keep their type


def test_clip_gradients_bounds_the_norm_over_all_chunks() -> None:
    spec, P = spec_of("tiny-uvit"), 2
    placement = placement_for("tiny-uvit", "sequential", P)
    backend = TorchBackend(dtype=DTYPE)
    program = lower(make_schedule("1f1b", placement, 2), spec, placement)
    run = local_run(spec, placement, program, backend, make_batches(spec, MBS), eps_loss)
    run.step()
    chunks = [c for ex in run.executors for c in ex.chunks.values()]
    before = clip_gradients(backend, chunks, None, (), 1e-3)
    after = np.sqrt(sum(float(g.pow(2).sum()) for c in chunks for g in backend.gradients(c).values()))
    assert before > 1e-3 and after == pytest.approx(1e-3, rel=1e-4)


def test_wiring_of_a_dit_chunk_runs_alone() -> None:
    """A chunk that starts after the conditioning layer reads 'c' and 'context' from its inputs."""
    spec = spec_of("tiny-dit")
    placement = placement_for("tiny-dit", "sequential", 2)
    io = Wiring(spec, placement).ios[1]
    assert set(io.shared_in) == {"c", "context"}
    chunk = TorchBackend(dtype=DTYPE).build_chunk(spec, io)
    assert list(chunk.layers) == [layer.name for layer in spec.layers[io.start:io.end]]
