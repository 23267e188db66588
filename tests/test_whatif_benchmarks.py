"""The what-if benchmarks' own pieces: the least-max contiguous cut against brute force, the synthetic
layer pieces keeping the model's work, skips and shared inputs."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_hardware
from pulse.zoo import get_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from granularity_whatif import in_pieces, least_max_cuts  # noqa: E402


@pytest.mark.parametrize("seed", range(6))
def test_least_max_cuts_is_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    work = list(rng.uniform(0.1, 2.0, size=int(rng.integers(4, 10))))
    chunks = int(rng.integers(2, len(work) + 1))
    cuts = least_max_cuts(work, chunks)
    assert cuts[0] == 0 and cuts[-1] == len(work) and len(cuts) == chunks + 1
    assert all(a < b for a, b in zip(cuts, cuts[1:])), "every chunk holds a layer"
    got = max(sum(work[a:b]) for a, b in zip(cuts, cuts[1:]))
    best = min(max(sum(work[a:b]) for a, b in zip((0, *inner), (*inner, len(work))))
               for inner in itertools.combinations(range(1, len(work)), chunks - 1))
    assert got == pytest.approx(best)


def test_pieces_keep_the_work_and_rewire_skips_to_the_ends() -> None:
    spec = get_spec("tiny-unet")
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    work = [f + b for f, b in zip(costs.fwd, costs.bwd)]
    threshold = sorted(work)[len(work) // 2]  # about half the layers cut
    cut = in_pieces(spec, costs, 3, threshold)
    heavy = sum(1 for w in work if w > threshold)
    assert 0 < heavy < spec.num_layers
    assert cut.num_layers == spec.num_layers + 2 * heavy
    assert sum(layer.flops for layer in cut.layers) == pytest.approx(sum(layer.flops for layer in spec.layers))
    assert abs(cut.total_params - spec.total_params) <= 2 * heavy  # integer thirds
    names = {layer.name for layer in cut.layers}
    for old, new in zip(spec.skips, cut.skips):
        assert new.src in names and new.dst in names and new.bytes == old.bytes
        assert new.src in (old.src, f"{old.src}_p2") and new.dst in (old.dst, f"{old.dst}_p0")
    assert in_pieces(spec, costs, 1, 0.0) == spec
