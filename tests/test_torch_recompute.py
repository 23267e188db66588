"""PyTorch activation recomputation: the same gradients as without, on the in-process fake network.

tiny-unet on the pulse V over 2 devices, 4 microbatches, float32: every chunk
recomputing gives bit-identical gradients and loss (the recomputed forward runs the
same kernels on the same inputs), with the whole backward and the zero-bubble split
one (B rebuilds the graph, W walks it), under bf16 autocast (the recomputation runs
under the forward's autocast), and with dropout (the recomputation draws the
forward's masks).
"""
from __future__ import annotations

from functools import lru_cache

import pytest

torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.placement import Placement  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.job import with_autocast  # noqa: E402
from torch_worker_check import make_batches  # noqa: E402

M = 4


@lru_cache(maxsize=None)
def _setup() -> tuple[ModelSpec, Placement]:
    spec = get_spec("tiny-unet").with_act_bytes(4)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    return spec, partition("pulse", spec, costs, 2, folds=1)


def _step(schedule: str, recompute: tuple[int, ...], autocast: bool = False, dropout: bool = False,
          seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    spec, placement = _setup()
    backend = TorchBackend(dtype=torch.float32, recompute=recompute)
    if autocast:
        backend = with_autocast(backend, torch.bfloat16)
    if dropout:  # no zoo layer draws at forward time (their Dropout has p = 0): a user's model may
        build = backend.build_chunk

        def build_with_dropout(spec_, io):
            chunk = build(spec_, io)
            for layer in chunk.layers.values():
                layer.register_forward_hook(lambda m, i, out: (torch.nn.functional.dropout(out[0], 0.3), *out[1:]))
            return chunk

        backend.build_chunk = build_with_dropout
    program = lower(make_schedule(schedule, placement, M), spec, placement)
    run = local_run(spec, placement, program, backend, make_batches(spec, 1), eps_loss)
    torch.manual_seed(seed)
    run.step()
    return {k: v.clone() for k, v in run.gradients().items()}, run.loss()


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule", ["greedy_v_1f1b", "zero_bubble_v"])
def test_recomputed_gradients_are_bit_identical(schedule: str) -> None:
    chunks = tuple(range(len(_setup()[1].chunks)))
    plain, loss = _step(schedule, ())
    for recompute in (chunks, (0, 2)):
        grads, again = _step(schedule, recompute)
        assert _identical(grads, plain), f"{schedule} recomputing {recompute}"
        assert again == loss


def test_recomputation_runs_under_the_forwards_autocast() -> None:
    plain, _ = _step("zero_bubble_v", (), autocast=True)
    fp32, _ = _step("zero_bubble_v", ())
    assert not _identical(plain, fp32)  # autocast changes the numbers, so the check below can see it
    assert _identical(_step("zero_bubble_v", (0, 1, 2, 3), autocast=True)[0], plain)


def test_recomputation_draws_the_forwards_dropout_masks() -> None:
    plain, _ = _step("greedy_v_1f1b", (), dropout=True)
    assert not _identical(_step("greedy_v_1f1b", (), dropout=True, seed=1)[0], plain)  # the masks matter
    assert _identical(_step("greedy_v_1f1b", (0, 1, 2, 3), dropout=True)[0], plain)


def test_a_recomputing_forward_keeps_its_inputs_and_no_graph() -> None:
    spec, placement = _setup()
    backend = TorchBackend(recompute=(1, 2))
    kept = []
    forward = backend.forward

    def recording(chunk, inputs, grad_names):
        out, ctx = forward(chunk, inputs, grad_names)
        kept.append((chunk.io.index, out, ctx))
        return out, ctx

    backend.forward = recording
    program = lower(make_schedule("greedy_v_1f1b", placement, M), spec, placement)
    local_run(spec, placement, program, backend, make_batches(spec, 1), eps_loss).step()
    assert len(kept) == M * len(placement.chunks)
    for index, out, ctx in kept:
        recomputing = index in (1, 2)
        assert (ctx.outputs is None) == recomputing
        if recomputing:  # no autograd graph from F to B: the outputs and the kept inputs carry none
            assert not any(v.requires_grad or v.grad_fn is not None for v in (*out.values(), *ctx.leaves.values()))
