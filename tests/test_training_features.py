"""What the training loop adds to a step: learning-rate schedules, mixed precision, fp16 loss scaling, EMA.

References are independent: diffusers' ``get_scheduler`` for the schedules, one device
training the whole model for the pipelined mixed-precision step, hand formulas for EMA
(diffusers' EMAModel itself: tests/test_ema.py).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pulse.partition import partition  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.placement import Placement  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import ScaledLoss, StepSettings, optimizer_update  # noqa: E402
from pulse.train.schedules import DynamicLossScale, learning_rate  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.job import with_autocast  # noqa: E402
from torch_worker_check import make_batches, max_relative_error  # noqa: E402

SPEC = get_spec("tiny-unet")


@pytest.mark.parametrize("schedule, warmup", [("constant", 0), ("constant", 3), ("linear", 2), ("cosine", 0),
                                              ("cosine", 4)])
def test_learning_rates_match_diffusers(schedule: str, warmup: int) -> None:
    diffusers = pytest.importorskip("diffusers.optimization")
    total, base = 12, 3e-4
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base)
    name = "constant_with_warmup" if schedule == "constant" else schedule
    sched = diffusers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [learning_rate(base, s, total, schedule, warmup) for s in range(total)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def test_loss_scale_backs_off_on_overflow_and_grows_after_good_steps() -> None:
    scaler = DynamicLossScale(scale=1024.0, growth_interval=3)
    scaler.update(False)
    assert (scaler.scale, scaler.skipped) == (512.0, 1)
    for _ in range(3):
        scaler.update(True)
    assert (scaler.scale, scaler.skipped, scaler.good_steps) == (1024.0, 1, 0)


def placement(kind: str, pp: int) -> Placement:
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 1)
    return partition(kind, SPEC, costs, pp)


def run_steps(pp: int, kind: str, precision: str, steps: int, settings: StepSettings,
              scaler: DynamicLossScale | None = None) -> tuple[list[float], dict, TorchBackend]:
    """``steps`` in-process optimizer steps (fake network) on fixed microbatches; (losses, gradients of
    the last step before its update, the backend)."""
    place = placement(kind, pp)
    backend = TorchBackend(dtype=torch.float32)
    if precision != "fp32":
        backend = with_autocast(backend, {"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    loss = eps_loss if scaler is None else ScaledLoss(eps_loss, backend, scaler)
    program = lower(make_schedule("1f1b" if kind == "sequential" else "greedy_v_1f1b", place, 2),
                            SPEC, place)
    run = local_run(SPEC, place, program, backend, make_batches(SPEC, 2), loss)
    losses, grads = [], {}
    for step in range(steps):
        stats = run.step()
        losses.append(float(np.mean([v for s in stats.values() for v in s.losses.values()])))
        chunks = [c for ex in run.executors for c in ex.chunks.values()]
        grads = {n: g.detach().float().numpy().copy() for c in chunks for n, g in backend.gradients(c).items()}
        optimizer_update(backend, chunks, step, settings, scaler)
    return losses, grads, backend


def test_pipelined_bf16_step_matches_single_device_under_the_same_autocast() -> None:
    settings = StepSettings(lr=1e-3)
    _, single, _ = run_steps(1, "sequential", "bf16", 1, settings)
    _, pipelined, _ = run_steps(2, "pulse", "bf16", 1, settings)
    assert single.keys() == pipelined.keys()
    # Same ops on the same inputs under the same autocast, but gradients that several chunks feed
    # (skips, shared inputs) are summed in another order, in bf16 (8 bits of mantissa): measured
    # 2.3% worst tensor, 1.0% median; a wiring error would be O(1). In fp32 the same comparison
    # gives 5e-7 (tests/test_runtime_equivalence.py checks that in float64).
    assert max_relative_error(pipelined, single) < 5e-2
    _, fp32, _ = run_steps(1, "sequential", "fp32", 1, settings)
    assert max_relative_error(single, fp32) > 1e-3  # autocast really changed the compute


def test_bf16_training_follows_the_fp32_run() -> None:
    """10 steps here; the 50-step comparison (within 5%) is benchmarks/precision.py's."""
    settings = StepSettings(lr=2e-3, lr_schedule="cosine", warmup_steps=2, total_steps=10)
    fp32, _, _ = run_steps(1, "sequential", "fp32", 10, settings)
    bf16, _, _ = run_steps(1, "sequential", "bf16", 10, settings)
    assert fp32[-1] < 0.8 * fp32[0]  # it trains
    assert abs(bf16[-1] - fp32[-1]) <= 0.05 * fp32[-1]


def one_device_run(loss, backend: TorchBackend):
    """The whole model on one device, 1F1B over 2 microbatches: (backend, run, its chunks)."""
    place = placement("sequential", 1)
    run = local_run(SPEC, place, lower(make_schedule("1f1b", place, 2), SPEC, place), backend,
                    make_batches(SPEC, 2), loss)
    return backend, run, [c for ex in run.executors for c in ex.chunks.values()]


def test_fp16_overflow_skips_the_step_and_keeps_the_weights() -> None:
    scaler = DynamicLossScale(scale=1024.0)
    settings = StepSettings(lr=1e-2)
    backend = TorchBackend(dtype=torch.float32)
    _, run, chunks = one_device_run(ScaledLoss(eps_loss, backend, scaler), backend)
    run.step()
    next(p for p in chunks[0].parameters() if p.grad is not None).grad[0] = float("inf")  # an fp16 overflow
    before = {n: p.detach().clone() for c in chunks for n, p in backend.parameters(c).items()}
    norm, skipped = optimizer_update(backend, chunks, 0, settings, scaler)
    after = {n: p.detach() for c in chunks for n, p in backend.parameters(c).items()}
    assert skipped and not math.isfinite(norm) and scaler.skipped == 1 and scaler.scale == 512.0
    assert all(torch.equal(before[n], after[n]) for n in before)
    run.step()  # the next step's gradients are finite again: it updates
    norm, skipped = optimizer_update(backend, chunks, 1, settings, scaler)
    assert not skipped and math.isfinite(norm)
    assert any(not torch.equal(before[n], p.detach()) for c in chunks for n, p in backend.parameters(c).items())


def test_fp16_scaled_gradients_unscale_to_the_unscaled_ones() -> None:
    settings = StepSettings(lr=0.0 + 1e-12)
    _, plain, _ = run_steps(1, "sequential", "fp32", 1, settings)
    scaler = DynamicLossScale(scale=1024.0)
    backend = TorchBackend(dtype=torch.float32)
    _, run, chunks = one_device_run(ScaledLoss(eps_loss, backend, scaler), backend)
    run.step()
    scaled = {n: g.detach().numpy() / 1024.0 for c in chunks for n, g in backend.gradients(c).items()}
    assert max_relative_error(scaled, plain) < 1e-6


def test_ema_follows_the_weights_by_its_formula() -> None:
    settings = StepSettings(lr=1e-2, ema=0.9)
    backend, run, chunks = one_device_run(eps_loss, TorchBackend(dtype=torch.float32))
    expected = {n: p.detach().clone() for c in chunks for n, p in backend.parameters(c).items()}
    for step in range(3):
        run.step()
        optimizer_update(backend, chunks, step, settings)
        decay = min(0.9, (1 + step) / (10 + step)) if step else 0.0  # diffusers' warm-up: update 1 copies
        for c in chunks:
            for n, p in backend.parameters(c).items():
                expected[n] = decay * expected[n] + (1 - decay) * p.detach()
    assert max_relative_error({n: t.numpy() for n, t in backend.ema.items()},
                              {n: t.numpy() for n, t in expected.items()}) < 1e-6


class _Setup:
    """Stands for what a rank builds before its first step (modules, the model, the data)."""


def test_launchers_take_setup_objects_out_of_the_collectors_walk() -> None:
    import gc
    from types import SimpleNamespace

    from pulse.train.loop import LoopHooks, run_steps as loop_run_steps

    job = SimpleNamespace(layout=SimpleNamespace(rank=1))  # no steps: only what happens before the first
    built = [_Setup() for _ in range(100)]
    try:
        walked = lambda: [o for g in range(3) for o in gc.get_objects(generation=g) if type(o) is _Setup]  # type(): no weak proxy dereferenced
        loop_run_steps(job, steps=0, hooks=LoopHooks())
        assert len(walked()) == len(built)
        loop_run_steps(job, steps=0, hooks=LoopHooks(freeze_gc=True))
        assert gc.get_freeze_count() >= len(built)
        assert walked() == []
    finally:
        gc.unfreeze()
