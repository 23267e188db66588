"""The paper's evaluation, in simulation: PULSE vs every baseline strategy.

For SD v2 UNet, U-ViT and Hunyuan-DiT on the Ascend 910A and V100 clusters,
the tuner finds the best configuration of each strategy under the same
devices, global batch and memory budget (each baseline with every schedule
the runtime runs on its placement: 1F1B, GPipe, zero-bubble and greedy list
schedules, interleaved 1F1B on two chunks per device), and this prints their
throughput, communication, PULSE's speedup over the strongest of them, and how far each best
step is above its compute floor (``pulse.sim.floor``). These are simulated figures from the
analytic cost model and the hardware figures in configs/hardware (each with
its source), not measurements.

    python benchmarks/headline.py [--quick] [--floors-only] [--model M]

``--floors-only`` tunes nothing: it adds the compute-floor figures to the rows headline.json holds.
``--model M`` tunes M's rows again and keeps the others' as headline.json holds them.

Writes benchmarks/results/headline.json and headline.md. The column "PULSE vs
best 1F1B-only baseline" is the comparison the search space used to make
(baselines with 1F1B on one chunk per device), from the same run.

PULSE's search contains the baselines' placements (``pulse.tune.space``): besides its V and
waves, every sequential and interleaved shape with its skips sent direct and kept local where
producer and consumer share a device. The last column says how PULSE's best V or wave alone
compares, so a row won by a direct-skip sequential shape is visible as such. The last three
rows are a communication-bound cluster (``configs/clusters/v100-pcie-10gbe-8x1.yaml``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.sim.breakdown import PARTS
from pulse.sim.floor import compute_floor
from pulse.tune.space import Candidate
from pulse.tune.tuner import TuneRequest, default_budget, tune
from pulse.zoo import get_spec

CLUSTERS = ("ascend-910a-1x8", "ascend-910a-2x8", "v100-sxm2-1x8", "v100-sxm2-2x8", "v100-pcie-1x8", "v100-pcie-2x8")
ASCEND = CLUSTERS[:2]
COMM_BOUND = ("v100-pcie-10gbe-8x1",)  # every link slower than compute: eight 1-GPU servers on 10 Gb/s Ethernet
# (model, global batch, clusters): the paper's three models on every cluster, plus SD v2 at a small
# batch on Ascend, where data parallelism has little compute to hide its all-reduce behind, and the
# three on a communication-bound cluster
RUNS = [("sd2-unet", 256, CLUSTERS), ("uvit", 256, CLUSTERS), ("hunyuan-dit", 64, CLUSTERS),
        ("sd2-unet", 32, ASCEND), ("sd2-unet", 64, COMM_BOUND), ("uvit", 64, COMM_BOUND),
        ("hunyuan-dit", 64, COMM_BOUND)]
STRATEGIES = ("pulse", "data-parallel", "sequential", "diffusionpipe")
# How finely each model is cut into layers. SD v2 is tuned twice, on diffusers' blocks and with every ResNet
# and transformer block in halves (split_resnets, split_transformers; each strategy's best then keeps only the
# halves its cuts fall between: "fitted" layers), and every strategy keeps its faster result, so the
# baselines get the same finer layers. U-ViT's and Hunyuan-DiT's zoo specs already cut each
# block into its attention and MLP halves.
LAYERINGS = {"sd2-unet": {"blocks": {}, "finer": {"split_resnets": True, "split_transformers": True}}}
OUT = Path(__file__).resolve().parent / "results"


def run_one(model: str, cluster_name: str, global_batch: int) -> dict:
    """The row: each strategy's best over every layering of the model (``LAYERINGS``)."""
    rows = [tuned_row(model, cluster_name, global_batch, name, options)
            for name, options in LAYERINGS.get(model, {"blocks": {}}).items()]
    return rows[0] if len(rows) == 1 else best_of(rows)


def best_of(rows: list[dict]) -> dict:
    """One row from the same row tuned on several layerings: every strategy its fastest, the comparisons
    taken again over those; the columns of PULSE's own search (its V or wave, bytes against a sequential
    shape) from the layering PULSE's best came from."""
    def sps(v: dict | None) -> float:
        return -1.0 if v is None else v["samples_per_s"]

    pulse_row = max(rows, key=lambda r: sps(r["strategies"]["pulse"]))
    merged = {**pulse_row, "tune_seconds": round(sum(r["tune_seconds"] for r in rows), 2),
              "strategies": {s: max((r["strategies"][s] for r in rows), key=sps) for s in STRATEGIES}}
    baselines = [v for s, v in merged["strategies"].items() if s != "pulse" and v is not None]
    strongest = max(baselines, key=sps) if baselines else None
    pulse = merged["strategies"]["pulse"]
    merged["strongest_baseline"] = None if strongest is None else strongest["label"]
    merged["speedup_vs_best_baseline"] = (pulse["samples_per_s"] / strongest["samples_per_s"]
                                          if pulse and strongest else None)
    old = max((r for r in rows if r.get("best_1f1b_baseline_sps")), key=lambda r: r["best_1f1b_baseline_sps"],
              default=None)
    merged["best_1f1b_baseline"] = None if old is None else old["best_1f1b_baseline"]
    merged["best_1f1b_baseline_sps"] = None if old is None else old["best_1f1b_baseline_sps"]
    merged["speedup_vs_best_1f1b_baseline"] = pulse["samples_per_s"] / old["best_1f1b_baseline_sps"] \
        if pulse and old else None
    merged["tuner_pick"] = max(merged["strategies"].values(), key=sps)["label"]
    skip_local = pulse_row.get("pulse_v_or_wave_sps")
    merged["v_or_wave_vs_strongest"] = (skip_local / strongest["samples_per_s"]
                                        if skip_local is not None and strongest is not None else None)
    return merged


def tuned_row(model: str, cluster_name: str, global_batch: int, layering: str = "blocks",
              options: dict | None = None) -> dict:
    spec, cluster = get_spec(model, **(options or {})), load_cluster(cluster_name)
    floor_spec = get_spec(model)  # the floor is the work, priced at the model's blocks whatever the cut
    started = time.monotonic()
    # finer layers are kept only where each strategy's best cuts (pulse.tune.fitted)
    fit = (lambda split: get_spec(model, **{**options, **split})) if options else None
    result = tune(TuneRequest(spec, cluster, global_batch, default_budget(cluster)), keep_best_of=one_f_one_b_only,
                  fit_layers=fit)
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
            "folds": c.folds, "shape": c.shape, "schedule": c.schedule, "inflight_cap": c.inflight_cap,
            "label": c.label, "samples_per_s": e.samples_per_s,
            "iteration_s": e.iteration_time, "peak_memory_gib": e.peak_memory / 2**30,
            "bytes_per_iteration": e.bytes_per_iteration, "p2p_bytes_per_iteration": e.p2p_bytes_per_iteration,
            "step_breakdown_seconds": e.breakdown.parts() if e.breakdown is not None else None,
            "layers": "fitted" if e.fitted else layering,
            "num_layers": e.fitted.spec.num_layers if e.fitted else spec.num_layers,
            "split_options": e.fitted.options if e.fitted else (options or {}),
            **floor_figures(floor_spec, cluster, e),
        }
    strongest = result.strongest_baseline
    row["strongest_baseline"] = None if strongest is None else strongest.candidate.label
    row["speedup_vs_best_baseline"] = result.speedup_over_strongest()
    # the search space before every baseline got every schedule: 1F1B on one chunk per device
    old = [e for e in result.ranked if e.candidate.strategy != "pulse" and e.candidate.schedule == "1f1b"
           and e.candidate.virtual == 1]
    pulse = row["strategies"]["pulse"]
    row["best_1f1b_baseline"] = old[0].candidate.label if old else None
    row["best_1f1b_baseline_sps"] = old[0].samples_per_s if old else None
    row["speedup_vs_best_1f1b_baseline"] = pulse["samples_per_s"] / old[0].samples_per_s if pulse and old else None
    row["p2p_reduction_vs_sequential_same_shape"] = _reduction_same_shape(spec, cluster, result) if pulse else None
    row["tuner_pick"] = result.winner.candidate.label
    skip_local = next((e for e in result.ranked if e.candidate.strategy == "pulse" and e.candidate.folds), None)
    row["pulse_v_or_wave"] = None if skip_local is None else skip_local.candidate.label
    row["pulse_v_or_wave_sps"] = None if skip_local is None else skip_local.samples_per_s
    row["v_or_wave_vs_strongest"] = (skip_local.samples_per_s / strongest.samples_per_s
                                     if skip_local is not None and strongest is not None else None)
    return row


def floor_figures(spec, cluster, e) -> dict:
    """The step's distance from its compute floor (``pulse.sim.floor``: every device its equal share of
    the work, no bubble, no exposed communication), on the costs the tuner priced it with."""
    c = e.candidate
    return _floor_of(spec, cluster, c.microbatch_size, c.pp, c.num_microbatches, e.iteration_time)


def _floor_of(spec, cluster, microbatch_size: int, pp: int, num_microbatches: int, step: float) -> dict:
    floor = compute_floor(AnalyticProfiler(cluster.hardware).profile(spec, microbatch_size), pp, num_microbatches)
    return {"compute_floor_s": floor, "step_over_floor": step / floor, "above_floor_s": step - floor}


def with_floors(rows: list[dict]) -> list[dict]:
    """``--floors-only``: the floor figures added to rows an earlier run wrote (their best configurations
    and steps as they were; the floor needs only the shape and the analytic costs)."""
    for row in rows:
        spec, cluster = get_spec(row["model"]), load_cluster(row["cluster"])
        for v in row["strategies"].values():
            if v is not None:
                v.update(_floor_of(spec, cluster, v["microbatch_size"], v["pp"], v["num_microbatches"],
                                   v["iteration_s"]))
    return rows


def one_f_one_b_only(c: Candidate) -> str | None:
    """The search space before every baseline got every schedule (1F1B on one chunk per device):
    the tuner keeps its best exact, for the column that compares with it."""
    return "1f1b-only baseline" if c.strategy != "pulse" and c.schedule == "1f1b" and c.virtual == 1 else None


def _reduction_same_shape(spec, cluster, result) -> float | None:
    """1 - PULSE's pipeline bytes / a sequential pipeline's with the same PP, DP and microbatching;
    None where PULSE's best is data parallelism alone (no pipeline)."""
    from pulse.tune.evaluate import evaluate

    pulse = result.best_by_strategy["pulse"]
    c = pulse.candidate
    if c.pp == 1:
        return None
    spec = pulse.fitted.spec if pulse.fitted else spec
    costs = AnalyticProfiler(cluster.hardware).profile(spec, c.microbatch_size)
    same = Candidate("sequential", c.pp, c.dp, c.microbatch_size, c.num_microbatches, 0, "sequential", "1f1b")
    sequential = evaluate(spec, costs, cluster, same, 2**62)
    return 1 - pulse.p2p_bytes_per_iteration / sequential.p2p_bytes_per_iteration


def markdown(rows: list[dict]) -> str:
    head = ("| model | cluster | batch | PULSE samples/s (pp×dp, mbs, shape, schedule) | DP | sequential | "
            "DiffusionPipe | strongest baseline | PULSE vs strongest | PULSE vs best 1F1B-only baseline "
            "| pipeline bytes vs sequential, same shape | tuner's pick | PULSE's best V / wave vs strongest "
            "| PULSE vs compute floor | strongest baseline vs compute floor |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        s = r["strategies"]

        def cell(name: str, detail: bool = False) -> str:
            v = s[name]
            if v is None:
                return "does not fit"
            layers = "" if v.get("layers", "blocks") == "blocks" else f", {v['layers']} layers"
            extra = f" ({v['pp']}×{v['dp']}, {v['microbatch_size']}, {v['shape']}, {_schedule(v)}{layers})" if detail \
                else f" ({v['shape']} {_schedule(v)}{layers})"
            return f"{v['samples_per_s']:.1f}" + extra

        speed = "-" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
        old = "-" if r["speedup_vs_best_1f1b_baseline"] is None else f"{r['speedup_vs_best_1f1b_baseline']:.2f}x"
        red = r["p2p_reduction_vs_sequential_same_shape"]
        red = "-" if red is None else f"{-red:+.0%}"
        strongest = "-" if r["strongest_baseline"] is None else r["strongest_baseline"].split(" pp=")[0]
        pick = r["tuner_pick"].split(" pp=")[0]
        lines.append(f"| {r['model']} | {r['cluster']} | {r['global_batch']} | {cell('pulse', True)} "
                     f"| {cell('data-parallel')} | {cell('sequential')} | {cell('diffusionpipe')} | {strongest} "
                     f"| {speed} | {old} | {red} | {pick} | {_ratio(r.get('v_or_wave_vs_strongest'))} "
                     f"| {_floor(s['pulse'])} | {_floor(_strongest(r))} |")
    return "\n".join(lines) + "\n"


def breakdown_markdown(rows: list[dict]) -> str:
    """Where PULSE's best step and the strongest baseline's go (pulse.sim.breakdown, ms), and the
    parts where PULSE pays more."""
    head = ("| model | cluster | batch | PULSE ms: compute / bubble / imbalance / p2p / all-reduce | strongest "
            "baseline ms: the same | PULSE pays more in |\n|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        pulse = r["strategies"]["pulse"]
        rival = _strongest(r)
        if pulse is None or rival is None or pulse["step_breakdown_seconds"] is None:
            continue
        mine, theirs = pulse["step_breakdown_seconds"], rival["step_breakdown_seconds"]
        worse = sorted(((mine[k] - theirs[k]) * 1e3, k) for k in mine if mine[k] - theirs[k] >= 5e-5)[::-1]
        cells = ", ".join(f"{k.replace('_', ' ')} +{d:.1f}" for d, k in worse) or "-"
        lines.append(f"| {r['model']} | {r['cluster']} | {r['global_batch']} | {_parts(mine)} | {_parts(theirs)} "
                     f"| {cells} |")
    return "\n".join(lines) + "\n"


def _strongest(row: dict) -> dict | None:
    return next((v for v in row["strategies"].values() if v is not None and v["label"] == row["strongest_baseline"]),
                None)


def _floor(v: dict | None) -> str:
    """``1.04x (+12.3 ms)``: the step over its compute floor."""
    if v is None or v.get("step_over_floor") is None:
        return "-"
    return f"{v['step_over_floor']:.2f}x (+{v['above_floor_s'] * 1e3:.1f} ms)"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _parts(parts: dict) -> str:
    return " / ".join(f"{parts[k] * 1e3:.1f}" for k in PARTS)


def _schedule(v: dict) -> str:
    return v["schedule"] if v["inflight_cap"] is None else f"{v['schedule']}/{v['inflight_cap']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Ascend 910A 2x8 only")
    parser.add_argument("--floors-only", action="store_true",
                        help="tune nothing: add the compute-floor figures to results/headline.json's rows")
    parser.add_argument("--model", choices=sorted({m for m, _, _ in RUNS}), default=None,
                        help="tune this model's rows again; the others are kept as results/headline.json has them")
    args = parser.parse_args(argv)
    rows = with_floors(json.loads((OUT / "headline.json").read_text())) if args.floors_only else []
    kept = {} if args.model is None else {(r["model"], r["cluster"], r["global_batch"]): r
                                          for r in json.loads((OUT / "headline.json").read_text())}
    for model, batch, clusters in ([] if args.floors_only else RUNS):
        for cluster in clusters:
            if args.quick and cluster != "ascend-910a-2x8":
                continue
            if args.model not in (None, model) and (model, cluster, batch) in kept:
                rows.append(kept[(model, cluster, batch)])
                continue
            print(f"tuning {model} on {cluster} (global batch {batch}) ...", file=sys.stderr, flush=True)
            rows.append(run_one(model, cluster, batch))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "headline.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown(rows) + "\nWhere each step goes (pulse.sim.breakdown; the parts sum to the step):\n\n" + \
        breakdown_markdown(rows)
    (OUT / "headline.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
