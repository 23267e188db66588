"""What layers finer than a block's halves would give SD v2's 16-device V at batch 32 (910A 2x8).

    python benchmarks/granularity_whatif.py [--pieces 1:0 2:0.5 4:0.3 ...]

At pp 16 and 32 microbatches of one sample (the headline's PULSE pick for SD v2 on 2x8 at batch 32,
1.30x its compute floor) each of the V's 32 chunks should hold a 32nd of the work, about 0.96 ms of
forward and backward on this cluster's analytic costs, while SD v2's 64x64 layers take up to 1.05 ms even
in halves (``split_resnets``, ``split_transformers``). This asks what layers cut finer still (a transformer
block by heads, a convolution by output channels) would give, without building them: every layer of the
halves spec above a threshold of forward + backward is replaced by ``k`` synthetic pieces, each with a
``k``-th of its parameters, FLOPs and saved activations, the whole output passed on, skips leaving its last
piece and entering the first (priced like any layer, with its launch cost). The 32 chunks are then the
least-max contiguous cut of the chain's work (every chunk about equal: each device's encoder chunk as
heavy as its decoder chunk, so that it has forwards to run while the pipeline fills), placed as a V on
16 devices, scheduled zero-bubble V and simulated; the step is split into its parts
(``pulse.sim.breakdown``) beside the compute floor of the model's blocks (``pulse.sim.floor``).

Writes benchmarks/results/granularity_whatif.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pulse.costs import AnalyticProfiler, CostTable
from pulse.hardware import load_cluster
from pulse.placement import from_cuts, wave_devices
from pulse.sim.breakdown import step_breakdown
from pulse.sim.floor import compute_floor
from pulse.spec import ModelSpec, SkipEdge
from pulse.tune.evaluate import evaluate
from pulse.tune.space import Candidate
from pulse.tune.tuner import default_budget
from pulse.zoo import get_spec

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTER, PP, MICROBATCHES = "ascend-910a-2x8", 16, 32
HALVES = {"split_resnets": True, "split_transformers": True}


def in_pieces(spec: ModelSpec, costs: CostTable, k: int, threshold: float) -> ModelSpec:
    """``spec`` with every layer whose forward + backward exceeds ``threshold`` seconds as ``k`` equal pieces."""
    layers, first, last = [], {}, {}
    for i, layer in enumerate(spec.layers):
        forward, backward = costs.span(i, i + 1)
        count = k if forward + backward > threshold else 1
        names = [layer.name] if count == 1 else [f"{layer.name}_p{j}" for j in range(count)]
        layers += [replace(layer, name=name, params=layer.params // count, flops=layer.flops / count,
                           saved_bytes=layer.saved_bytes // count) for name in names]
        first[layer.name], last[layer.name] = names[0], names[-1]
    skips = [SkipEdge(last[e.src], first[e.dst], e.bytes) for e in spec.skips]
    shared = [replace(s, producer=None if s.producer is None else last[s.producer]) for s in spec.shared_inputs]
    return ModelSpec(spec.name, tuple(layers), tuple(skips), tuple(shared), spec.act_bytes, spec.meta)


def least_max_cuts(work: list[float], chunks: int) -> list[int]:
    """Boundaries [0, ..., L] of ``chunks`` contiguous chunks with the least largest sum of ``work``."""
    n, prefix = len(work), np.concatenate([[0.0], np.cumsum(work)])
    best = np.full((chunks + 1, n + 1), np.inf)
    back = np.zeros((chunks + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for c in range(1, chunks + 1):
        for end in range(c, n + 1):
            starts = np.arange(c - 1, end)
            cost = np.maximum(best[c - 1, starts], prefix[end] - prefix[starts])
            pick = int(np.argmin(cost))
            best[c, end], back[c, end] = cost[pick], starts[pick]
    cuts = [n]
    for c in range(chunks, 0, -1):
        cuts.append(int(back[c, cuts[-1]]))
    return cuts[::-1]


def one_case(k: int, threshold: float) -> dict:
    cluster = load_cluster(CLUSTER)
    profiler = AnalyticProfiler(cluster.hardware)
    halves = get_spec("sd2-unet", **HALVES)
    spec = in_pieces(halves, profiler.profile(halves, 1), k, threshold) if k > 1 else halves
    costs = profiler.profile(spec, 1)
    work = [f + b for f, b in zip(costs.fwd, costs.bwd)]
    cuts = least_max_cuts(work, 2 * PP)
    placement = from_cuts("v", cuts, wave_devices(PP, 1), PP, "direct", "pulse")
    cand = Candidate(strategy="pulse", pp=PP, dp=1, microbatch_size=1, num_microbatches=MICROBATCHES, folds=1,
                     partitioner="pulse", schedule="zero_bubble_v", skip_transport="direct")
    e = evaluate(spec, costs, cluster, cand, default_budget(cluster), placement=placement)
    parts = step_breakdown(spec, placement, e.schedule, costs, cluster, e.step).parts()
    floor = compute_floor(profiler.profile(get_spec("sd2-unet"), 1), PP, MICROBATCHES)
    chunk_work = [sum(work[a:b]) for a, b in zip(cuts, cuts[1:])]
    return {"pieces": k, "threshold_ms": threshold * 1e3, "layers": spec.num_layers,
            "largest_layer_ms": max(work) * 1e3, "largest_chunk_ms": max(chunk_work) * 1e3,
            "mean_chunk_ms": sum(chunk_work) / len(chunk_work) * 1e3, "step_ms": e.iteration_time * 1e3,
            "floor_ms": floor * 1e3, "step_over_floor": e.iteration_time / floor,
            "breakdown_ms": {name: value * 1e3 for name, value in parts.items()}}


def markdown(rows: list[dict]) -> str:
    lines = ["| pieces (layers above) | layers | largest layer / chunk / mean chunk (ms) | step (ms) | vs floor | "
             "compute | bubble | imbalance | exposed p2p |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = r["breakdown_ms"]
        what = "halves" if r["pieces"] == 1 else f"{r['pieces']} (> {r['threshold_ms']:.1f} ms)"
        lines.append(f"| {what} | {r['layers']} | {r['largest_layer_ms']:.2f} / {r['largest_chunk_ms']:.2f} / "
                     f"{r['mean_chunk_ms']:.2f} | {r['step_ms']:.1f} | {r['step_over_floor']:.3f}x | "
                     f"{b['compute']:.1f} | {b['bubble']:.1f} | {b['imbalance']:.1f} | {b['exposed_p2p']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", nargs="+", default=["1:0", "2:0.5", "2:0.3", "4:0.5", "4:0.3", "3:0.2"],
                        help="K:MS: layers above MS ms of forward + backward cut into K pieces (1:0: the halves)")
    parser.add_argument("--out", type=Path, default=RESULTS / "granularity_whatif.json")
    args = parser.parse_args(argv)
    rows = []
    for text in args.pieces:
        k, threshold = text.split(":")
        started = time.monotonic()
        rows.append(one_case(int(k), float(threshold) * 1e-3))
        print(f"{text}: {rows[-1]['step_ms']:.1f} ms ({time.monotonic() - started:.1f} s)", flush=True)
    print(markdown(rows))
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
