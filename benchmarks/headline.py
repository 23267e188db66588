"""The paper's evaluation, in simulation: PULSE vs every baseline strategy.

For SD v2 UNet, U-ViT and Hunyuan-DiT on the Ascend 910A and V100 clusters,
the tuner finds the best configuration of each strategy under the same
devices, global batch and memory budget, and this prints their throughput,
communication and PULSE's speedup. These are simulated figures from the
analytic cost model and the hardware figures in configs/hardware (each with
its source), not measurements.

    python benchmarks/headline.py [--quick]

Writes benchmarks/results/headline.json and headline.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.tune.space import Candidate
from pulse.tune.tuner import TuneRequest, default_budget, tune
from pulse.zoo import get_spec

CLUSTERS = ("ascend-910a-1x8", "ascend-910a-2x8", "v100-sxm2-1x8", "v100-sxm2-2x8", "v100-pcie-1x8", "v100-pcie-2x8")
ASCEND = CLUSTERS[:2]
# (model, global batch, clusters): the paper's three models on every cluster, plus SD v2 at a small
# batch on Ascend, where data parallelism has little compute to hide its all-reduce behind
RUNS = [("sd2-unet", 256, CLUSTERS), ("uvit", 256, CLUSTERS), ("hunyuan-dit", 64, CLUSTERS),
        ("sd2-unet", 32, ASCEND)]
STRATEGIES = ("pulse", "data-parallel", "sequential-1f1b", "diffusionpipe-1f1b")
OUT = Path(__file__).resolve().parent / "results"


def run_one(model: str, cluster_name: str, global_batch: int) -> dict:
    spec, cluster = get_spec(model), load_cluster(cluster_name)
    started = time.monotonic()
    result = tune(TuneRequest(spec, cluster, global_batch, default_budget(cluster)))
    row = {"model": model, "cluster": cluster_name, "global_batch": global_batch,
           "tune_seconds": round(time.monotonic() - started, 2), "strategies": {}}
    for strategy in STRATEGIES:
        e = result.best_by_strategy.get(strategy)
        if e is None:
            row["strategies"][strategy] = None
            continue
        c = e.candidate
        row["strategies"][strategy] = {
            "pp": c.pp, "dp": c.dp, "microbatch_size": c.microbatch_size, "num_microbatches": c.num_microbatches,
            "folds": c.folds, "schedule": c.schedule, "samples_per_s": e.samples_per_s,
            "iteration_s": e.iteration_time, "peak_memory_gib": e.peak_memory / 2**30,
            "bytes_per_iteration": e.bytes_per_iteration, "p2p_bytes_per_iteration": e.p2p_bytes_per_iteration,
        }
    pulse = row["strategies"]["pulse"]
    baselines = [v for k, v in row["strategies"].items() if k != "pulse" and v]
    best = max(baselines, key=lambda v: v["samples_per_s"]) if baselines else None
    row["speedup_vs_best_baseline"] = pulse["samples_per_s"] / best["samples_per_s"] if pulse and best else None
    row["p2p_reduction_vs_sequential_same_shape"] = _reduction_same_shape(spec, cluster, result) if pulse else None
    row["tuner_pick"] = result.winner.candidate.label
    return row


def _reduction_same_shape(spec, cluster, result) -> float:
    """1 - PULSE's pipeline bytes / a sequential pipeline's with the same PP, DP and microbatching."""
    from pulse.tune.evaluate import evaluate

    pulse = result.best_by_strategy["pulse"]
    c = pulse.candidate
    costs = AnalyticProfiler(cluster.hardware).profile(spec, c.microbatch_size)
    same = Candidate("sequential-1f1b", c.pp, c.dp, c.microbatch_size, c.num_microbatches, 0, "sequential", "1f1b")
    sequential = evaluate(spec, costs, cluster, same, 2**62)
    return 1 - pulse.p2p_bytes_per_iteration / sequential.p2p_bytes_per_iteration


def markdown(rows: list[dict]) -> str:
    head = ("| model | cluster | batch | PULSE samples/s (pp×dp, mbs) | DP | sequential+1F1B | DiffusionPipe+1F1B "
            "| PULSE vs best baseline | pipeline bytes vs sequential, same shape | tuner's pick |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        s = r["strategies"]

        def cell(name: str) -> str:
            v = s[name]
            return "does not fit" if v is None else f"{v['samples_per_s']:.1f}"

        p = s["pulse"]
        pulse_cell = "does not fit" if p is None else (
            f"{p['samples_per_s']:.1f} ({p['pp']}×{p['dp']}, {p['microbatch_size']}, "
            f"{'V' if p['folds'] == 1 else 'wave' + str(p['folds'])})")
        speed = "-" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
        red = r["p2p_reduction_vs_sequential_same_shape"]
        red = "-" if red is None else f"{-red:+.0%}"
        pick = r["tuner_pick"].split(" pp=")[0]
        lines.append(f"| {r['model']} | {r['cluster']} | {r['global_batch']} | {pulse_cell} | {cell('data-parallel')} "
                     f"| {cell('sequential-1f1b')} | {cell('diffusionpipe-1f1b')} | {speed} | {red} | {pick} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Ascend 910A 2x8 only")
    args = parser.parse_args(argv)
    rows = []
    for model, batch, clusters in RUNS:
        for cluster in clusters:
            if args.quick and cluster != "ascend-910a-2x8":
                continue
            print(f"tuning {model} on {cluster} (global batch {batch}) ...", file=sys.stderr, flush=True)
            rows.append(run_one(model, cluster, batch))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "headline.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown(rows)
    (OUT / "headline.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
