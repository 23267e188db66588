"""Finer layers against imbalance: SD v2 with each ResnetBlock2D as one layer and as two halves.

The headline's breakdown shows SD v2's step losing 12-22% to imbalance because a diffusers block
is the smallest unit the partitioner can move. This tunes the same rows twice, on the zoo's
``sd2-unet`` and on ``sd2-unet`` with ``split_resnets=true`` (``pulse.zoo.unet_blocks.resnet_halves``),
every strategy on the same spec (so the baselines get the same finer layers), and prints each
row's step, its imbalance share (``pulse.sim.breakdown``) for PULSE and the strongest baseline,
and PULSE's speedup over that baseline. Simulated figures from the analytic cost model, not
measurements.

    python benchmarks/finer_layers.py [--quick]

Writes benchmarks/results/finer_layers.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pulse.hardware import load_cluster
from pulse.tune.tuner import Evaluation, TuneRequest, default_budget, tune
from pulse.zoo import get_spec

MODEL = "sd2-unet"
# (cluster, global batch): the headline's SD v2 rows where imbalance is largest, and the same
# two clusters at the batches between
ROWS = [("ascend-910a-2x8", 256), ("ascend-910a-2x8", 64), ("ascend-910a-2x8", 32),
        ("v100-pcie-2x8", 256), ("v100-pcie-2x8", 64), ("v100-pcie-2x8", 32)]
QUICK_ROWS = [("ascend-910a-2x8", 32)]
GRANULARITY = {"blocks": {}, "split resnets": {"split_resnets": True}}
OUT = Path(__file__).resolve().parent / "results" / "finer_layers.json"


def summary(e: Evaluation | None) -> dict | None:
    """A tuned strategy's step, its parts and the share imbalance takes."""
    if e is None:
        return None
    parts = e.breakdown.parts() if e.breakdown is not None else {}
    return {"label": e.candidate.label, "iteration_s": e.iteration_time, "samples_per_s": e.samples_per_s,
            "peak_memory_gib": e.peak_memory / 2**30, "step_breakdown_seconds": parts,
            "imbalance_share": parts.get("imbalance", 0.0) / e.iteration_time if parts else None}


def run_row(cluster_name: str, batch: int, options: dict) -> dict:
    spec, cluster = get_spec(MODEL, **options), load_cluster(cluster_name)
    started = time.monotonic()
    result = tune(TuneRequest(spec, cluster, batch, default_budget(cluster)))
    return {"layers": spec.num_layers, "tune_seconds": round(time.monotonic() - started, 1),
            "pulse": summary(result.best_by_strategy.get("pulse")),
            "strongest_baseline": summary(result.strongest_baseline),
            "speedup_vs_strongest": result.speedup_over_strongest()}


def _cell(s: dict | None) -> str:
    if s is None:
        return "does not fit"
    return f"{s['iteration_s'] * 1e3:.1f} ms, {s['imbalance_share']:.0%} imbalance"


def table(rows: list[dict]) -> str:
    lines = ["| cluster | batch | layers | PULSE step, imbalance | strongest baseline step, imbalance "
             "| PULSE vs strongest |", "|---|---|---|---|---|---|"]
    for r in rows:
        for name, g in r["granularity"].items():
            speed = "-" if g["speedup_vs_strongest"] is None else f"{g['speedup_vs_strongest']:.2f}x"
            lines.append(f"| {r['cluster']} | {r['global_batch']} | {name} ({g['layers']}) | {_cell(g['pulse'])} "
                         f"| {_cell(g['strongest_baseline'])} | {speed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one row only (a smoke run)")
    args = parser.parse_args(argv)
    rows = []
    for cluster_name, batch in QUICK_ROWS if args.quick else ROWS:
        rows.append({"model": MODEL, "cluster": cluster_name, "global_batch": batch,
                     "granularity": {name: run_row(cluster_name, batch, options)
                                     for name, options in GRANULARITY.items()}})
        print(f"{cluster_name} batch {batch} done", file=sys.stderr, flush=True)
    print(table(rows))
    if not args.quick:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps({"model": MODEL, "rows": rows}, indent=1) + "\n")
        print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
