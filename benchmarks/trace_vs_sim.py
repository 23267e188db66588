"""One real step beside the simulator's, action by action: where a prediction starts to drift.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node P -m pulse_torch.train \\
        --plan RUN/plan.yaml --steps 8 --out-dir RUN --trace RUN/trace.json [--emulate-bandwidth B]
    .venv/bin/python benchmarks/trace_vs_sim.py RUN --costs COSTS.yaml --cluster CLUSTER.yaml [--bandwidth B]

``RUN`` holds the plan a run trained and the trace it wrote (``--trace``: the last
step of every rank); costs and cluster are what ``pulse profile`` measured (a
``benchmarks/validate.py`` group directory holds both). Prints, per device and in
measured order, every compute action's measured and simulated start and
duration (and the processor time the rank's thread spent in it) and the lag
between the starts; writes ``RUN/trace_vs_sim.json``. A lag that jumps at one
action names the mechanism to look at; one that grows steadily is durations or
per-action costs; a duration above its processor time is waiting or preemption.
Last, each compute kind's processor time over its back-to-back figure, by what
ran just before it on its rank: the measured twin of the profile's cold start.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from pulse.cli.common import ACT_BYTES
from pulse.planner import memory_of
from pulse.costs import CostTable
from pulse.hardware import load_cluster
from pulse.plan import load_plan
from pulse.sim.engine import simulate
from pulse.zoo.loading import load_model


def simulated_actions(run: Path, costs: CostTable, cluster) -> tuple[dict[tuple[int, str], tuple[float, float]], float]:
    """(device, action name) -> (start, duration) in ms of the simulated step; its makespan in ms."""
    plan, _ = load_plan(run / "plan.yaml")
    spec = load_model(plan.model, plan.model_options).with_act_bytes(ACT_BYTES["fp32"])  # fp32 training sends
    result = simulate(spec, plan.placement, plan.schedule, costs, cluster, memory=memory_of(plan.recompute))
    spans = {(s.device, f"{s.chunk}{s.kind}{s.microbatch}"): (s.start * 1e3, (s.end - s.start) * 1e3)
             for s in result.compute}
    return spans, result.makespan * 1e3


def cold_starts_seen(run: Path, costs: CostTable, cluster) -> dict[str, dict[str, float]]:
    """The measured twin of ``CostTable.cold_start``: per compute kind and what ran just before it on
    its rank (a receive, a send, another compute action), the median of each action's processor time
    less its back-to-back figure (the table's, no cold start, no core shared)."""
    plain = replace(costs, cold_start=())
    alone = replace(cluster, hardware=replace(cluster.hardware, shared_cores=None))
    figure = {key: duration for key, (_, duration) in simulated_actions(run, plain, alone)[0].items()}
    events = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e["cat"] not in ("step", "AR")]
    gaps: dict[str, dict[str, list[float]]] = {}
    for pid in sorted({e["pid"] for e in events}):
        mine = sorted((e for e in events if e["pid"] == pid), key=lambda e: e["ts"])
        for before, e in zip(mine, mine[1:]):
            if (pid, e["name"]) not in figure or "cpu_ms" not in e.get("args", {}):
                continue
            after = "compute" if before["cat"] in ("F", "B", "W", "E") else \
                "receive" if before["cat"].startswith("R") else "send"
            gaps.setdefault(e["cat"], {}).setdefault(after, []).append(e["args"]["cpu_ms"] - figure[(pid, e["name"])])
    return {kind: {after: statistics.median(v) for after, v in by.items()} for kind, by in sorted(gaps.items())}


def compare(run: Path, costs: CostTable, cluster) -> dict:
    """Every traced compute action the simulator also ran: measured beside simulated, per device."""
    simulated, makespan = simulated_actions(run, costs, cluster)
    events = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and (e["pid"], e["name"]) in simulated]
    origin = min(e["ts"] for e in events)
    rows = []
    for e in sorted(events, key=lambda e: (e["pid"], e["ts"])):
        start, duration = simulated[(e["pid"], e["name"])]
        measured = (e["ts"] - origin) / 1e3
        rows.append({"device": e["pid"], "action": e["name"], "measured_start_ms": measured,
                     "measured_ms": e["dur"] / 1e3, "measured_cpu_ms": e.get("args", {}).get("cpu_ms"),
                     "simulated_start_ms": start, "simulated_ms": duration, "lag_ms": measured - start})
    span = max(r["measured_start_ms"] + r["measured_ms"] for r in rows)
    return {"rows": rows, "measured_span_ms": span, "simulated_makespan_ms": makespan,
            "cold_start_ms": {k: t * 1e3 for k, t in costs.cold_start},
            "processor_time_over_figure_ms": cold_starts_seen(run, costs, cluster)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a directory with plan.yaml and trace.json")
    parser.add_argument("--costs", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--bandwidth", type=float, help="the --emulate-bandwidth the run had")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    if args.bandwidth:
        cluster = cluster.with_link_bandwidth(args.bandwidth)
    report = compare(args.run, CostTable.load(args.costs), cluster)
    device = None
    for r in report["rows"]:
        if r["device"] != device:
            device = r["device"]
            print(f"device {device}")
        cpu = f" (cpu {r['measured_cpu_ms']:5.2f})" if r["measured_cpu_ms"] is not None else ""
        print(f"  {r['action']:6s} measured {r['measured_start_ms']:8.1f} +{r['measured_ms']:6.2f} ms{cpu} | "
              f"simulated {r['simulated_start_ms']:8.1f} +{r['simulated_ms']:6.2f} ms | lag {r['lag_ms']:+7.1f}")
    print(f"measured span {report['measured_span_ms']:.1f} ms, simulated makespan {report['simulated_makespan_ms']:.1f} ms")
    print("processor time over the back-to-back figure (median ms), by what ran just before: "
          + "; ".join(f"{kind} after " + ", ".join(f"{after} {t:+.3f}" for after, t in by.items())
                      for kind, by in report["processor_time_over_figure_ms"].items()))
    if report["cold_start_ms"]:
        print("the profile's cold start (ms): " + ", ".join(f"{k} {t:.3f}" for k, t in report["cold_start_ms"].items()))
    out = args.run / "trace_vs_sim.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
