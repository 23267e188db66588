"""Small hand-made models, random costs and brute-force references for the partition tests."""
from __future__ import annotations

import itertools
import random

from pulse.costs import CostTable
from pulse.partition.cuts import is_valid
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge


def nested_unet(rng: random.Random, num_layers: int, num_skips: int, name: str = "rand-u") -> ModelSpec:
    """A U: sources before the middle, mirrored destinations after it, properly nested.

    Sources may repeat (one layer feeding two decoder layers), as in real UNets.
    """
    middle = num_layers // 2
    sources = sorted(rng.choice(range(middle)) for _ in range(num_skips))
    dests = sorted(rng.sample(range(middle + 1, num_layers), num_skips), reverse=True)
    layers = [Layer(f"l{i}", "x", 1, 1.0, rng.randint(1, 50), 0) for i in range(num_layers)]
    skips = [SkipEdge(f"l{s}", f"l{t}", rng.randint(1, 80)) for s, t in zip(sources, dests)]
    return ModelSpec(name, layers, skips, [SharedInput("temb", 2, "l0"), SharedInput("ctx", 9)])


def random_costs(rng: random.Random, spec: ModelSpec, microbatch_size: int = 1) -> CostTable:
    fwd = [rng.uniform(0.5, 3.0) for _ in spec.layers]
    return CostTable(spec.name, microbatch_size, tuple(l.name for l in spec.layers), fwd,
                     [f * rng.uniform(1.5, 2.5) for f in fwd], [0] * spec.num_layers, "test")


def all_chains(spec: ModelSpec, pairs: int) -> list[list[tuple[int, int]]]:
    """Every chain of ``pairs`` strictly nested valid cuts ending at a terminal cut."""
    n = spec.num_layers
    spans = [(s, t) for s, t, _ in spec.skip_spans()]
    valid = [(a, b) for a in range(1, n) for b in range(a, n) if is_valid((a, b), spans)]

    def extend(chain: list[tuple[int, int]], left: int):
        a, b = chain[-1]
        for c in valid:
            if c[0] > a and c[1] < b and (left > 1 or c[0] == c[1]) and (left == 1 or c[0] < c[1]):
                yield from extend(chain + [c], left - 1) if left > 1 else [chain + [c]]

    return list(extend([(0, n)], pairs))


def chain_loads(costs: CostTable, chain: list[tuple[int, int]], devices: list[int], num_devices: int) -> list[float]:
    loads = [0.0] * num_devices
    for j, dev in enumerate(devices):
        (a0, b0), (a1, b1) = chain[j], chain[j + 1]
        loads[dev] += costs.total(a0, a1) + costs.total(b1, b0)
    return loads


def all_splits(num_layers: int, parts: int):
    for inner in itertools.combinations(range(1, num_layers), parts - 1):
        yield [0, *inner, num_layers]
