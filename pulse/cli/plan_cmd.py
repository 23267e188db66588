"""`pulse plan`: partition a model over pipeline devices and compare partitioners."""
from __future__ import annotations

import argparse
import json

from pulse.cli.common import (Setup, add_model_arguments, add_pipeline_arguments, check_positive, fmt_bytes,
                              image_file, load_setup, output_file, positive_int, recompute_chunks)
from pulse.errors import PlanError
from pulse.partition import partition
from pulse.partition.report import PartitionReport, compare_placements, report
from pulse.partition.symmetric import plan_symmetric
from pulse.placement import Placement
from pulse.plan import Plan
from pulse.yamlio import dump_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_pipeline_arguments(parser)
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe"), default="pulse")
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="microbatches per step (default 2*pp)")
    parser.add_argument("--out", type=output_file, help="write the plan (YAML, or JSON by suffix)")
    parser.add_argument("--png", type=image_file, help="draw the partition (layers by device, skips as arcs)")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    check_positive(pp=args.pp, microbatch_size=args.microbatch_size, folds=args.folds)
    setup = load_setup(args)
    placements, notes = all_placements(setup, args.pp, args.folds, args.strict, args.partition_objective)
    chosen = placements[args.partitioner]
    chosen_report = report(setup.spec, setup.costs, chosen)
    rows = compare_placements(setup.spec, setup.costs, placements)
    plan = make_plan(args, setup, chosen, chosen_report)
    if args.out:
        plan.save(args.out, setup.spec)
    if args.png:
        from pulse.views.partition import draw_partition

        draw_partition(setup.spec, chosen, setup.costs, args.png)
    if args.format == "json":
        print(dump_json({"plan": plan.to_dict(setup.spec), "comparison": [r.__dict__ for r in rows],
                         "notes": notes}), end="")
        return 0
    print(describe(setup, chosen, chosen_report))
    print()
    print(format_comparison(rows))
    for note in notes:
        print(f"note: {note}")
    if args.out:
        print(f"plan written to {args.out}")
    return 0


def all_placements(setup: Setup, pp: int, folds: int, strict: bool,
                   objective: str = "time") -> tuple[dict[str, Placement], list[str]]:
    spec, costs, cluster = setup.spec, setup.costs, setup.cluster
    notes = []
    crossing = spec.crossing_pairs()
    if crossing:  # local only if a chain keeps both in one encoder/decoder pair (partition.cuts)
        notes.append(f"{len(crossing)} crossing skip pair(s): kept on one device where they share an "
                     "encoder/decoder pair, else sent directly")
    try:
        symmetric = plan_symmetric(spec, costs, pp, folds=folds, strict=strict, cluster=cluster,
                                   objective=objective)
    except PlanError as exc:
        if not (strict and crossing and "crosses" in str(exc)):
            raise
        a, b = crossing[0]
        raise PlanError(f"{spec.name}: skip {a.key} crosses {b.key} and no placement over {pp} devices keeps "
                        "both local; drop --strict to send crossing skips directly, or fix the model's "
                        "skip edges") from None
    if symmetric.dropped_skips:
        notes.append(f"skips sent between devices: {', '.join(symmetric.dropped_skips)}")
    placements = {
        "sequential": partition("sequential", spec, costs, pp, cluster=cluster),
        "diffusionpipe": partition("diffusionpipe", spec, costs, pp, cluster=cluster),
        "pulse": symmetric.placement,
    }
    return placements, notes


def make_plan(args, setup: Setup, placement: Placement, rep: PartitionReport) -> Plan:
    num_microbatches = args.num_microbatches or 2 * args.pp
    check_positive(num_microbatches=num_microbatches)
    predicted = {
        "bytes_per_microbatch": rep.bytes_per_microbatch,
        "bottleneck_seconds_per_microbatch": rep.bottleneck,
        "imbalance": rep.imbalance,
        "cost_source": setup.costs.source,
    }
    return Plan(model=args.model, cluster=args.cluster, pp=args.pp, dp=1,
                microbatch_size=args.microbatch_size, num_microbatches=num_microbatches,
                partitioner=args.partitioner, placement=placement, model_options=setup.model_options,
                predicted=predicted, recompute=recompute_chunks(args.recompute, len(placement.chunks)))


def describe(setup: Setup, placement: Placement, rep: PartitionReport) -> str:
    spec = setup.spec
    head = (f"{spec.name}: {spec.num_layers} layers, {spec.total_params / 1e6:.1f}M params, "
            f"{len(spec.skips)} skips | {placement.partitioner} {placement.kind} placement over "
            f"{placement.num_devices} devices of {setup.cluster.name} | microbatch {setup.costs.microbatch_size}")
    lines = [head, f"{'device':>6}  {'load ms':>9}  chunks (layers)"]
    for device in range(placement.num_devices):
        parts = []
        for index in placement.chunks_of(device):
            c = placement.chunks[index]
            parts.append(f"#{index} {spec.layers[c.start].name}..{spec.layers[c.end - 1].name} ({c.num_layers})")
        lines.append(f"{device:>6}  {rep.device_load[device] * 1e3:>9.2f}  " + " | ".join(parts))
    lines.append(f"bytes across devices per microbatch: {fmt_bytes(rep.bytes_per_microbatch)} "
                 f"(forward main {fmt_bytes(rep.forward.main)}, skips {fmt_bytes(rep.forward.skip)}, "
                 f"shared {fmt_bytes(rep.forward.shared)}; backward the same); "
                 f"skips leaving their device: {len(rep.skips_leaving)}; imbalance {rep.imbalance:.3f}")
    return "\n".join(lines)


def format_comparison(rows) -> str:
    lines = [f"{'partitioner':<14} {'placement':<10} {'bytes/microbatch':>17} {'reduction':>10} "
             f"{'bottleneck ms':>14} {'imbalance':>10}"]
    for r in rows:
        lines.append(f"{r.name:<14} {r.kind:<10} {fmt_bytes(r.bytes_per_microbatch):>17} "
                     f"{_reduction(r):>10} {r.bottleneck * 1e3:>14.2f} {r.imbalance:>10.3f}")
    return "\n".join(lines)


def _reduction(row) -> str:
    return "(ref)" if row.name == "sequential" else f"{row.reduction_vs_sequential:.1%}"
