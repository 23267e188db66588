"""Predicted vs measured step time on MindSpore: ``pulse profile --backend mindspore``'s twin.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_mindspore.py [--model tiny-uvit]
        [--model-option depth=3] [--pp 2] [--steps 30] [--workdir DIR]

1. ``pulse profile --backend mindspore`` on P msrun workers at once: every layer's forward and
   backward through MindSpore's own cells and executor, the links through its communicator
   (on a CPU: mccl all-reduce, gloo send/recv) into a cost table and a cluster YAML;
2. each configuration (sequential + 1F1B, V + greedy, V + ZB-V, 2-fold wave + greedy) is planned
   on them (``benchmarks/validate.py``'s planner, link-aware), with every chunk recomputing (a
   MindSpore backward re-runs its forward, ``BackendTraits.always_recomputes``), predicted by
   ``pulse.sim`` (program engine + step model; the profile's table and cluster say how MindSpore's
   split backward and communicator work: ``whole_backward_in_b``, ``tensor_messages``,
   ``deferred_buckets``), and trained for real with ``pulse train --backend mindspore --plan``
   (msrun): mean step time after two warm-up steps, every configuration twice in mirrored order
   (A B C D D C B A); run-to-run spread printed. 30 steps a run by default: this host slows down
   for a second now and then, and 8-step runs of the same plan differed by up to 12.6%.

Free link only: the link emulation wraps the PyTorch communicator. Writes
benchmarks/results/validate_mindspore.json and .md (rows as ``validate.py``'s).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import validate as v  # noqa: E402
from pulse.args.model_args import parse_options  # noqa: E402
from pulse.cli.common import ACT_BYTES  # noqa: E402
from pulse.costs import CostTable  # noqa: E402
from pulse.errors import PlanError  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402

STRATEGIES = ["seq+1f1b", "V+greedy", "V+zbv", "wave2+greedy"]


def recomputing(plan: Plan) -> Plan:
    """The plan as MindSpore runs it: every chunk's backward re-runs its forward."""
    return replace(plan, recompute=tuple(range(len(plan.placement.chunks))))


def profile(args: argparse.Namespace, workdir: Path) -> tuple[CostTable, object]:
    costs, cluster = workdir / "costs.yaml", workdir / "cluster.yaml"
    if not costs.exists():
        v.run([str(v.BIN / "pulse"), "profile", "--backend", "mindspore", "--model", args.model,
               *[a for o in args.model_option for a in ("--model-option", o)], "--pp", str(args.pp),
               "--microbatch-size", str(v.MICROBATCH), "--out-costs", str(costs), "--out-cluster", str(cluster)],
              workdir / "profile.log")
    return CostTable.load(costs), load_cluster(str(cluster))


def measure(plan: Plan, spec, workdir: Path, name: str, steps: int) -> list[float]:
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.yaml", spec)
    v.run([str(v.BIN / "pulse"), "train", "--backend", "mindspore", "--plan", str(out / "plan.yaml"),
           "--steps", str(steps + v.WARMUP_STEPS), "--out-dir", str(out / "run")], out / "run.log")
    log = json.loads((out / "run" / "log.json").read_text())
    return [s["seconds"] for s in log["steps"][v.WARMUP_STEPS:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-uvit")
    parser.add_argument("--model-option", action="append", default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after two warm-up steps)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    args = parser.parse_args(argv)
    args.model_option = ["depth=3"] if args.model_option is None and args.model == "tiny-uvit" else \
        (args.model_option or [])
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pulse-validate-ms-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec = load_model(args.model, parse_options(args.model_option)).with_act_bytes(ACT_BYTES["fp32"])
    costs, cluster = profile(args, workdir)
    plans = []
    for strategy in args.strategies:
        try:
            plan = v.build_plan(spec, args.model, costs, cluster, args.pp, strategy, 2 * args.pp)
            plans.append((strategy, recomputing(replace(plan, model_options=parse_options(args.model_option)))))
        except PlanError as exc:
            print(f"  {strategy}: skipped ({exc})".splitlines()[0], flush=True)
    predicted = [v.predict(spec, plan, costs, cluster) for _, plan in plans]  # prices plan.recompute
    runs: dict[int, list[list[float]]] = {i: [] for i in range(len(plans))}  # each run's step seconds
    for i in [*range(len(plans)), *reversed(range(len(plans)))]:  # mirrored: a linear drift falls on all
        strategy, plan = plans[i]
        runs[i].append(measure(plan, spec, workdir, f"{strategy}-run{len(runs[i])}", args.steps))
    rows, label = [], f"{args.model}{''.join(' ' + o for o in args.model_option)} (MindSpore)"
    for i, (strategy, plan) in enumerate(plans):
        rows.append(v.measured_row(label, "free", strategy, plan, predicted[i], runs[i]))
        print(v.format_row(rows[-1]), flush=True)
    write_results(rows, v.rankings(rows))
    return 0


def write_results(rows: list, ranks: list[dict]) -> None:
    v.RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "code": v.CODE, "cores": os.cpu_count(), "rows": [asdict(r) for r in rows],
           "rankings": ranks, "max_abs_error": max((abs(r.error) for r in rows), default=None)}
    (v.RESULTS / "validate_mindspore.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["| model | P | configuration | predicted ms | measured ms | error | run-to-run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.model} | {r.pp} | {r.config} | {r.predicted_s * 1e3:.1f} | {r.measured_s * 1e3:.1f} | "
              f"{r.error:+.1%} | {r.spread:.1%} |" for r in rows]
    group = ranks[0]
    lines += ["", f"ranking equal: {'yes' if group['same'] else 'no'}; order of means equal: "
              f"{'yes' if group['same_order_of_means'] else 'no'} (predicted {' < '.join(group['predicted_order'])}; "
              f"measured {' < '.join(group['measured_order'])})"]
    lines += [f"pair measured against the prediction: {v.inversion_text(i)}" for i in group["inversions"]]
    (v.RESULTS / "validate_mindspore.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
