"""The clipping norm's squared sum on PyTorch: one pass over each gradient, within fp32 rounding of float64."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pulse_torch.backend import NORM_ROW, _square_sum  # noqa: E402


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
