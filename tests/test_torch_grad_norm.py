"""The clipping norm's squared sum on PyTorch: one pass over each gradient, within fp32 rounding of float64."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pulse_torch.backend import FOREACH_PIECE, NORM_ROW, _square_sum, foreach_squares, squares_of  # noqa: E402


@pytest.mark.parametrize("numel", [7, NORM_ROW, 3 * NORM_ROW + 5, 3_000_001])
def test_fp32_rows_sum_equals_the_float64_sum(numel: int) -> None:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3.0
    exact = float(g.double().square().sum())
    got = _square_sum(g)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(exact, rel=3e-7)  # fp32 rounding: the all-reduce after it is fp32


def test_strided_and_other_dtypes_equal_the_float64_sum() -> None:
    g = torch.randn(300, 700, generator=torch.Generator().manual_seed(1))
    assert float(_square_sum(g.t())) == pytest.approx(float(g.double().square().sum()), rel=3e-7)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        h = g.to(dtype)
        assert float(_square_sum(h)) == pytest.approx(float(h.double().square().sum()), rel=1e-12)


def mixed_gradients() -> list:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(3_000_001, generator=gen), torch.randn(40, 30, generator=gen).t(),
            torch.randn(5, generator=gen).to(torch.bfloat16), torch.randn(FOREACH_PIECE, generator=gen)]


def test_a_cpu_sums_the_gradients_in_rows(monkeypatch) -> None:
    grads = mixed_gradients()
    monkeypatch.setattr(torch, "_foreach_norm", None)  # never the foreach norm on a CPU
    exact = sum(float(g.double().square().sum()) for g in grads)
    got = squares_of(grads, torch.device("cpu"))
    assert got.dtype == torch.float64 and float(got) == pytest.approx(exact, rel=3e-7)


def test_an_accelerator_sums_the_gradients_in_one_foreach_norm_over_pieces(monkeypatch) -> None:
    """One foreach call over every fp32 gradient cut into pieces of at most FOREACH_PIECE elements
    (views: nothing copied), other dtypes through fp64; the same sum. Run on a CPU here, whose fp32
    norm of a million elements adds along running sums (2.5e-5 off); an accelerator's adds in trees."""
    grads = mixed_gradients()
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda pieces: (calls.append([p.numel() for p in pieces]),
                                                                 real(pieces))[1])
    exact = sum(float(g.double().square().sum()) for g in grads)
    got = foreach_squares(grads, torch.device("cpu"))
    assert got.dtype == torch.float64 and float(got) == pytest.approx(exact, rel=1e-4)
    (sizes,) = calls
    assert sizes == [FOREACH_PIECE, FOREACH_PIECE, 3_000_001 - 2 * FOREACH_PIECE, 1200, FOREACH_PIECE]


def test_scaling_the_gradients_is_each_gradient_times_the_factor_bit_for_bit() -> None:
    from pulse_torch.backend import TorchBackend

    gen = torch.Generator().manual_seed(5)
    chunk = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3, bias=False))
    for p in chunk.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    chunk[1].weight.grad = None  # a parameter without a gradient stays without one
    want = [None if p.grad is None else p.grad * 0.37 for p in chunk.parameters()]
    TorchBackend(seed=0).scale_gradients([chunk], 0.37)
    for p, w in zip(chunk.parameters(), want):
        assert (p.grad is None and w is None) or torch.equal(p.grad, w)
