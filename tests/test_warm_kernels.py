"""A CPU rank runs each kind of kernel once before its memory baseline (backends/pulse_torch/warm_kernels.py):
that must change nothing the run computes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pulse_torch.warm_kernels import warm_kernels  # noqa: E402


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_warming_the_kernels_draws_nothing_and_leaves_no_state(autocast) -> None:
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    grad_mode, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    warm_kernels(autocast)
    assert torch.equal(torch.rand(4), want)  # the run's generator as the seed left it
    assert torch.is_grad_enabled() == grad_mode and torch.get_default_dtype() == dtype
    assert not torch.is_autocast_enabled("cpu")
