"""MindSpore's own optimizers (``pulse_mindspore.optimizers``): AdamW and ``nn.AdaFactor`` resumed through a
worker's checkpoint file bit for bit, AdaFactor's state as ``pulse.optimizers`` counts it, and the
learning rate the loop sets reaching AdaFactor. In one process, seeded gradients by parameter name."""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.optimizers import state_bytes  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.train import checkpoints  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_mindspore import checkpoint  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402

SPEC = get_spec("tiny-uvit").with_act_bytes(4)
PLACEMENT = partition("pulse", SPEC, AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 1), 2)
STEPS = 4


class OneRank:
    """The communicator of a world of one: the sum of the file table is the table."""

    def sum_values(self, values, timeout=None):
        return [float(v) for v in values]


def built(optimizer: str, seed: int = 0) -> tuple[MindSporeBackend, list]:
    backend = MindSporeBackend(lr=1e-2, weight_decay=0.1, seed=seed, optimizer=optimizer)
    wiring = Wiring(SPEC, PLACEMENT)
    return backend, [backend.build_chunk(SPEC, wiring.ios[c]) for c in range(len(PLACEMENT.chunks))]


def step_all(backend: MindSporeBackend, chunks: list, step: int) -> None:
    for c in chunks:
        grads = {}
        for n, p in backend.parameters(c).items():
            steady = np.random.default_rng(zlib.crc32(n.encode())).standard_normal(p.shape)
            noise = np.random.default_rng([step, zlib.crc32(n.encode())]).standard_normal(p.shape)
            grads[n] = (steady + 0.3 * noise).astype(np.float32)
        backend.set_gradients(c, grads)
        backend.optimizer_step(c)


def weights(backend: MindSporeBackend, chunks: list) -> dict[str, np.ndarray]:
    return {n: p.asnumpy().copy() for c in chunks for n, p in backend.parameters(c).items()}


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_a_resumed_worker_equals_the_uninterrupted_one(optimizer: str, tmp_path: Path) -> None:
    straight, chunks = built(optimizer)
    for step in range(1, STEPS + 1):
        step_all(straight, chunks, step)
    first, first_chunks = built(optimizer)
    for step in range(1, STEPS // 2 + 1):
        step_all(first, first_chunks, step)
    shard = checkpoint.Shard(first, first_chunks, 0, 1, 0)
    info = {"identity": {}, "data": {"step": STEPS // 2}, "optimizer": optimizer}
    checkpoint.save(tmp_path, STEPS // 2, shard, OneRank(), info, {0: shard.layers()})
    found, _ = checkpoints.find_latest(tmp_path)
    resumed, resumed_chunks = built(optimizer, seed=5)  # other initial weights: all from the file
    checkpoint.load(found, checkpoint.Shard(resumed, resumed_chunks, 0, 1, 0))
    for step in range(STEPS // 2 + 1, STEPS + 1):
        step_all(resumed, resumed_chunks, step)
    want, got = weights(straight, chunks), weights(resumed, resumed_chunks)
    assert want.keys() == got.keys() and all(np.array_equal(want[n], got[n]) for n in want), optimizer
    untrained = weights(*built(optimizer))
    assert not all(np.array_equal(want[n], untrained[n]) for n in want)


def test_adafactors_state_and_learning_rate() -> None:
    """nn.AdaFactor keeps the factored second moment ``pulse.optimizers`` counts (its placeholders aside: a
    (1,) array per unused slot, one shared 0-d first moment), and takes the loop's learning rate."""
    backend, chunks = built("adafactor")
    step_all(backend, chunks, 1)
    for c in chunks:
        opt = c.opt.optimizer
        for i, p in enumerate(c.params.values()):
            held = sum(getattr(opt, k)[i].asnumpy().nbytes for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"))
            placeholders = 4 * 2 if len(p.shape) < 2 else 4
            assert held - placeholders == state_bytes("adafactor", tuple(p.shape)) - 4  # less transformers' 0-d RMS
    backend.set_learning_rate(chunks, 3e-4)
    assert all(float(c.opt.optimizer.learning_rate.asnumpy()) == pytest.approx(3e-4) for c in chunks)


def test_adamw_is_torchs_update() -> None:
    """The backend's AdamW against torch.optim.AdamW over steps whose learning rate the loop changes: the same
    weights to float32 rounding (a bias-correction or decay slip is off by 1e-3 or more)."""
    torch = pytest.importorskip("torch")
    from pulse_mindspore.optimizers import build_optimizer, set_learning_rate, step_of

    rng = np.random.default_rng(3)
    start = [rng.standard_normal(shape).astype(np.float32) for shape in ((6, 5), (5,))]
    grads = [[rng.standard_normal(a.shape).astype(np.float32) for a in start] for _ in range(4)]
    ours = [ms.Parameter(ms.Tensor(a.copy()), name=f"p{i}") for i, a in enumerate(start)]
    theirs = [torch.nn.Parameter(torch.tensor(a.copy())) for a in start]
    settings = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ms_adamw = build_optimizer("adamw", ours, *(settings[k] for k in ("lr", "betas", "eps", "weight_decay")))
    torch_adamw = torch.optim.AdamW(theirs, **settings)
    for step, (g, lr) in enumerate(zip(grads, (1e-2, 1e-2, 3e-3, 5e-2)), 1):
        set_learning_rate(ms_adamw, lr)
        torch_adamw.param_groups[0]["lr"] = lr
        ms_adamw(tuple(ms.Tensor(x) for x in g))
        for p, x in zip(theirs, g):
            p.grad = torch.tensor(x)
        torch_adamw.step()
        assert step_of(ms_adamw) == step
    for p, q, a in zip(ours, theirs, start):
        assert np.abs(p.asnumpy() - a).max() > 1e-2  # it moved
        np.testing.assert_allclose(p.asnumpy(), q.detach().numpy(), rtol=2e-6, atol=2e-7)
