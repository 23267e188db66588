"""Compare the three partitioners on every zoo model.

    /work/venv/bin/python benchmarks/partition.py [--hardware ascend-910a] [--microbatch 1]

For each model and P in {2, 4, 8, 16} (pulse with 1 fold, the V, and 2 folds
where the model has enough layers), prints bytes per microbatch crossing
devices (forward + backward, fp16), the reduction against the balanced
sequential partition, the bottleneck device time and imbalance from the
analytic cost table, and planning time. Pulse rows also show the bytes of the
balance-only chain (no communication pass), which is what the second objective
saves. Writes benchmarks/results/partition.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster, Hardware, load_hardware
from pulse.partition import partition, plan_symmetric
from pulse.partition.report import report
from pulse.partition.symmetric import DEFAULT_SLACK
from pulse.spec import ModelSpec
from pulse.zoo import ZOO_NAMES, get_spec

DEVICE_COUNTS = (2, 4, 8, 16)
RESULTS = Path(__file__).resolve().parent / "results" / "partition.json"


def _timed(fn, repeats: int = 3):
    """(result, median seconds) of ``fn()``."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def _row(spec: ModelSpec, costs: CostTable, name: str, folds: int, placement, seconds: float,
         reference: int | None, balanced_bytes: int | None = None) -> dict:
    rep = report(spec, costs, placement)
    nbytes = rep.bytes_per_microbatch
    return {
        "model": spec.name, "P": placement.num_devices, "partitioner": name, "kind": rep.kind,
        "folds": folds, "bytes_per_microbatch": nbytes,
        "skip_bytes_per_microbatch": rep.forward.skip + rep.backward.skip,
        "reduction_vs_sequential": 0.0 if reference is None else 1 - nbytes / reference,
        "balance_only_bytes_per_microbatch": balanced_bytes,
        "bottleneck_ms": rep.bottleneck * 1e3, "imbalance": rep.imbalance,
        "planning_ms": seconds * 1e3,
    }


def bench_case(spec: ModelSpec, costs: CostTable, hardware: Hardware, num_devices: int) -> tuple[list[dict], list[str]]:
    """Rows for one (model, P); the reasons for any partitioner that cannot plan it."""
    cluster = Cluster(hardware.name, hardware, nodes=math.ceil(num_devices / hardware.devices_per_node))
    rows, skipped = [], []
    try:
        seq, t = _timed(lambda: partition("sequential", spec, costs, num_devices))
    except PlanError as exc:
        return [], [f"{spec.name} P={num_devices}: {exc}"]
    rows.append(_row(spec, costs, "sequential", 1, seq, t, None))
    reference = rows[0]["bytes_per_microbatch"]
    dp, t = _timed(lambda: partition("diffusionpipe", spec, costs, num_devices, cluster=cluster))
    rows.append(_row(spec, costs, "diffusionpipe", 1, dp, t, reference))
    for folds in (1, 2):
        try:
            plan, t = _timed(lambda: plan_symmetric(spec, costs, num_devices, folds=folds))
        except PlanError as exc:
            skipped.append(f"{spec.name} P={num_devices} pulse folds={folds}: {exc}")
            continue
        balanced = 2 * plan.balanced_bytes * costs.microbatch_size
        rows.append(_row(spec, costs, "pulse", folds, plan.placement, t, reference, balanced))
    return rows, skipped


def format_row(r: dict) -> str:
    name = r["partitioner"] if r["partitioner"] != "pulse" else f"pulse/{'V' if r['folds'] == 1 else 'wave2'}"
    balanced = r["balance_only_bytes_per_microbatch"]
    extra = f"{balanced / 1e6:10.2f}" if balanced is not None else f"{'':10}"
    return (f"{r['model']:<13}{r['P']:>3}  {name:<14}{r['bytes_per_microbatch'] / 1e6:>10.2f}{extra}"
            f"{r['reduction_vs_sequential']:>8.1%}{r['bottleneck_ms']:>10.3f}{r['imbalance']:>7.3f}"
            f"{r['planning_ms']:>9.2f}")


HEADER = (f"{'model':<13}{'P':>3}  {'partitioner':<14}{'MB/mb':>10}{'bal-only':>10}{'vs seq':>8}"
          f"{'bneck ms':>10}{'imbal':>7}{'plan ms':>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="ascend-910a")
    parser.add_argument("--microbatch", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=list(ZOO_NAMES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    hardware = load_hardware(args.hardware)
    profiler = AnalyticProfiler(hardware)
    rows, skipped = [], []
    print(HEADER)
    for model in args.models:
        spec = get_spec(model).with_act_bytes(2)  # fp16 activations
        costs = profiler.profile(spec, args.microbatch)
        for num_devices in DEVICE_COUNTS:
            case_rows, case_skipped = bench_case(spec, costs, hardware, num_devices)
            rows += case_rows
            skipped += case_skipped
            for r in case_rows:
                print(format_row(r))
    print("\nnot plannable:\n  " + "\n  ".join(skipped))
    sd2 = _sd2_planning_time(profiler, args.microbatch)
    print(f"\nplanning time, sd2-unet P=16 (pulse V, median of 5): {sd2 * 1e3:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "hardware": hardware.name, "microbatch_size": args.microbatch, "act_bytes": 2,
        "pulse_slack": DEFAULT_SLACK, "bytes": "forward + backward per microbatch",
        "sd2_unet_p16_planning_ms": sd2 * 1e3, "rows": rows, "not_plannable": skipped,
    }, indent=1))
    print(f"wrote {args.out}")
    return 0


def _sd2_planning_time(profiler: AnalyticProfiler, microbatch: int) -> float:
    spec = get_spec("sd2-unet").with_act_bytes(2)
    costs = profiler.profile(spec, microbatch)
    return _timed(lambda: plan_symmetric(spec, costs, 16), repeats=5)[1]


if __name__ == "__main__":
    raise SystemExit(main())
