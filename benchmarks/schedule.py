"""The ILP schedule synthesizer against the baselines on the pulse V placement.

    /work/venv/bin/python benchmarks/schedule.py [--time-limit 10] [--memory-budget GIB|none]

For SD v2 UNet, U-ViT and Hunyuan-DiT (analytic Ascend 910A costs, one node of
8), P in {4, 8} and M in {2P, 4P}: synthesizes a schedule (pulse.synth)
and prints every candidate's simulated makespan, bubble ratio and ratio to the
task-graph lower bound, with the synthesis time. The memory budget defaults to
the tuner's (device memory - 2 GiB). Writes benchmarks/results/schedule.json.

Targets checked: the ILP schedule no slower than the best baseline, within 5%
of the lower bound, and synthesis at P=8, M=32 under 30 s.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster, load_hardware
from pulse.partition import partition
from pulse.synth import ILP_NAME, SynthResult, synthesize
from pulse.tune.tuner import default_budget
from pulse.zoo import get_spec

MODELS = ("sd2-unet", "uvit", "hunyuan-dit")
DEVICE_COUNTS = (4, 8)
RESULTS = Path(__file__).resolve().parent / "results" / "schedule.json"


def run_case(model: str, pp: int, num_mb: int, budget: int | None, time_limit: float) -> tuple[dict, list[dict]]:
    cluster = load_cluster("ascend-910a")
    spec = get_spec(model)
    costs = AnalyticProfiler(load_hardware("ascend-910a")).profile(spec, 1)
    placement = partition("pulse", spec, costs, pp, cluster=cluster)
    began = time.perf_counter()
    result = synthesize(spec, placement, costs, cluster, num_mb, memory_budget=budget, time_limit=time_limit)
    seconds = time.perf_counter() - began
    return _summary(model, pp, num_mb, result, seconds), _rows(model, pp, num_mb, result, seconds)


def _summary(model: str, pp: int, num_mb: int, r: SynthResult, seconds: float) -> dict:
    baselines = {n: m for n, m in r.makespans.items() if n != ILP_NAME}
    best = min(baselines, key=baselines.get) if baselines else None
    ilp = r.makespans.get(ILP_NAME)
    return {
        "model": model, "P": pp, "M": num_mb, "winner": r.winner, "explanation": r.explanation,
        "best_baseline": best, "ilp_over_best_baseline": None if ilp is None or best is None else ilp / baselines[best],
        "ilp_over_lower_bound": None if ilp is None else ilp / r.lower_bound,
        "winner_over_lower_bound": r.makespans[r.winner] / r.lower_bound,
        "lower_bound_ms": r.lower_bound * 1e3, "synthesis_s": seconds, "solve_s": r.solve_seconds,
        "pattern_found": r.pattern_found, "window": r.window, "seed": r.seed, "ilp_gain_on_graph": r.ilp_gain,
        "rejected": r.rejected,
    }


def _rows(model: str, pp: int, num_mb: int, r: SynthResult, seconds: float) -> list[dict]:
    rows = []
    for name in sorted(r.makespans, key=r.makespans.get):
        rows.append({"model": model, "P": pp, "M": num_mb, "schedule": name,
                     "makespan_ms": r.makespans[name] * 1e3, "bubble_ratio": r.bubble_ratios[name],
                     "over_lower_bound": r.makespans[name] / r.lower_bound,
                     "solve_s": seconds if name == ILP_NAME else None, "winner": name == r.winner})
    for name, makespan in sorted(r.variants.items()):  # both ILP routes, for the record
        rows.append({"model": model, "P": pp, "M": num_mb, "schedule": f"  ({name.split('/')[1]} route)",
                     "makespan_ms": makespan * 1e3, "bubble_ratio": None,
                     "over_lower_bound": makespan / r.lower_bound, "solve_s": None, "route": True})
    for name, why in sorted(r.rejected.items()):
        rows.append({"model": model, "P": pp, "M": num_mb, "schedule": name, "rejected": why})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<12}{'P':>3}{'M':>4}  {'schedule':<17}{'makespan ms':>12}{'bubble':>8}{'/LB':>7}{'solve s':>9}")
    for row in rows:
        head = f"{row['model']:<12}{row['P']:>3}{row['M']:>4}  {row['schedule'] + ('*' if row.get('winner') else ''):<17}"
        if "rejected" in row:
            print(f"{head}rejected: {row['rejected']}")
            continue
        solve = f"{row['solve_s']:.1f}" if row["solve_s"] is not None else ""
        bubble = "" if row["bubble_ratio"] is None else f"{row['bubble_ratio']:.1%}"
        print(f"{head}{row['makespan_ms']:>12.2f}{bubble:>8}{row['over_lower_bound']:>7.3f}{solve:>9}")


def check_targets(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        case = f"{s['model']} P={s['P']} M={s['M']}"
        vs_base, vs_lb = s["ilp_over_best_baseline"], s["ilp_over_lower_bound"]
        ok_base = vs_base is not None and vs_base <= 1 + 1e-9
        ok_lb = vs_lb is not None and vs_lb <= 1.05
        base_note = ("ok" if ok_base else "MISS") if s["best_baseline"] else "ok: no baseline fits the budget"
        lines.append(f"{case}: ilp/best-baseline {_fmt(vs_base)} [{base_note}], "
                     f"ilp/LB {_fmt(vs_lb)} [{'ok' if ok_lb else 'MISS'}], synthesis {s['synthesis_s']:.1f} s"
                     + ("" if (s["P"], s["M"]) != (8, 32) else f" [{'ok' if s['synthesis_s'] < 30 else 'MISS'} < 30 s]")
                     + f"; {s['explanation']}")
    return lines


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds of ILP per synthesis")
    parser.add_argument("--memory-budget", default=None, help="GiB per device, or 'none' (default: tuner's)")
    args = parser.parse_args()
    if args.memory_budget is None:
        budget = default_budget(load_cluster("ascend-910a"))
    else:
        budget = None if args.memory_budget == "none" else int(float(args.memory_budget) * 2**30)
    summaries, rows = [], []
    for model in MODELS:
        for pp in DEVICE_COUNTS:
            for num_mb in (2 * pp, 4 * pp):
                summary, case_rows = run_case(model, pp, num_mb, budget, args.time_limit)
                summaries.append(summary)
                rows += case_rows
                print_table(case_rows)
    print()
    for line in check_targets(summaries):
        print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"hardware": "ascend-910a", "time_limit_s": args.time_limit,
                                   "memory_budget_bytes": budget, "summaries": summaries, "rows": rows},
                                  indent=1) + "\n")
    print(f"\nwritten {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
