"""Small hand-made models, random costs and brute-force references for the partition tests."""
from __future__ import annotations

import itertools
import random

from pulse.costs import CostTable
from pulse.partition.priced import PRICED_SCHEDULES
from pulse.schedule.generators import OnLinks, make_schedule
from pulse.sim.engine import simulate
from pulse.sim.step import step_time
from pulse.placement import from_cuts, wave_devices
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import skips_leaving_device


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


def random_skips(rng: random.Random, num_layers: int, num_skips: int, name: str = "rand-any") -> ModelSpec:
    """Skips anywhere: short ones inside an encoder or decoder, long ones, crossing ones."""
    layers = [Layer(f"l{i}", "x", 1, 1.0, rng.randint(1, 50), 0) for i in range(num_layers)]
    spans = set()
    while len(spans) < num_skips:
        s = rng.randrange(num_layers - 1)
        spans.add((s, rng.randrange(s + 1, min(num_layers, s + rng.choice([2, 4, num_layers])))))
    skips = [SkipEdge(f"l{s}", f"l{t}", rng.randint(1, 80)) for s, t in sorted(spans)]
    return ModelSpec(name, layers, skips, [SharedInput("temb", 2, "l0")])


def pair_local_splits(spec: ModelSpec, pairs: int):
    """Every split into 2 * pairs non-empty chunks in which each skip starts and ends in one
    pair (chunk j and its mirror 2 * pairs - 1 - j): found by enumeration, not by cuts."""
    n, chunks = spec.num_layers, 2 * pairs
    spans = [(s, t) for s, t, _ in spec.skip_spans()]
    for split in all_splits(n, chunks):
        chunk = [0] * n
        for c in range(chunks):
            chunk[split[c]:split[c + 1]] = [min(c, chunks - 1 - c)] * (split[c + 1] - split[c])
        if all(chunk[s] == chunk[t] for s, t in spans):
            yield split


def all_chains(spec: ModelSpec, pairs: int) -> list[list[tuple[int, int]]]:
    """Every pair-local split as a chain of cuts (0, L) = c_0 ⊃ ... ⊃ c_pairs (terminal)."""
    return [[(split[j], split[2 * pairs - j]) for j in range(pairs + 1)]
            for split in pair_local_splits(spec, pairs)]


def skip_local_v_splits(spec: ModelSpec, num_devices: int):
    """Every V over ``num_devices`` (2P non-empty chunks, devices 0..P-1, P-1..0) whose skips
    all stay on their device, judged by ``traffic`` alone: the space the V DP must cover."""
    devices = wave_devices(num_devices, 1)
    for split in all_splits(spec.num_layers, 2 * num_devices):
        placement = from_cuts("v", split, devices, num_devices, "direct", "brute")
        if not skips_leaving_device(spec, placement):
            yield split


def chain_loads(costs: CostTable, chain: list[tuple[int, int]], devices: list[int], num_devices: int) -> list[float]:
    loads = [0.0] * num_devices
    for j, dev in enumerate(devices):
        (a0, b0), (a1, b1) = chain[j], chain[j + 1]
        loads[dev] += costs.total(a0, a1) + costs.total(b1, b0)
    return loads


def all_splits(num_layers: int, parts: int):
    for inner in itertools.combinations(range(1, num_layers), parts - 1):
        yield [0, *inner, num_layers]


def independent_step(spec, costs, cluster, placement, num_microbatches):
    """The whole step of ``placement`` with its faster V schedule, priced here without pulse.partition."""
    steps = []
    for name in PRICED_SCHEDULES:
        schedule = make_schedule(name, placement, num_microbatches, costs, OnLinks(spec, cluster))
        result = simulate(spec, placement, schedule, costs, cluster)
        steps.append(step_time(spec, placement, costs, cluster, result).total)
    return min(steps)
