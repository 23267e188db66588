"""Helpers shared by the torch layer test files (imported, so the fixture applies in each)."""
import pytest

torch = pytest.importorskip("torch")

from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.model import build_model  # noqa: E402

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops gain nothing from threads, and OpenMP spin-waits badly on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _model(name, seed=0):
    spec = get_spec(name)
    return spec, build_model(spec, seed=seed)


def _layer(spec, name):
    return spec.layers[spec.index(name)]
