"""`pulse plan`: partition a model over pipeline devices and compare partitioners."""
from __future__ import annotations

import argparse

from pulse.args.parser import image_file, output_file, positive_int
from pulse.backend_traits import BackendTraits
from pulse.cli.common import (Setup, add_model_arguments, add_pipeline_arguments, check_positive, fmt_bytes,
                              load_setup, unused_splits_note)
from pulse.encoders import EncoderSet
from pulse.errors import PlanError
from pulse.partition import partition
from pulse.partition.report import PartitionReport, compare_placements, report
from pulse.partition.priced import DEFAULT_CANDIDATES, PricedCuts
from pulse.partition.symmetric import plan_symmetric
from pulse.placement import Placement
from pulse.plan import Plan
from pulse.planner import PlanRequest, describe_priced, plan_of, recompute_chunks
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
    placements, notes, priced = all_placements(setup, args.pp, args.folds, args.strict, args.partition_objective,
                                               args.num_microbatches, candidates=DEFAULT_CANDIDATES)
    chosen = placements[args.partitioner]
    chosen_report = report(setup.spec, setup.costs, chosen)
    rows = compare_placements(setup.spec, setup.costs, placements)
    plan = partition_plan(args, setup, chosen, chosen_report)
    split_note = unused_splits_note(setup.spec, chosen, setup.model_options)
    notes = notes + ([split_note] if split_note else [])
    if args.out:
        plan.save(args.out, setup.spec)
    if args.png:
        from pulse.views.partition import draw_partition

        draw_partition(setup.spec, chosen, setup.costs, args.png)
    if args.format == "json":
        print(dump_json({"plan": plan.to_dict(setup.spec), "comparison": [r.__dict__ for r in rows],
                         "cut_candidates": [priced_row(p) for p in priced], "notes": notes}), end="")
        return 0
    print(describe(setup, chosen, chosen_report))
    print()
    print(format_comparison(rows))
    if priced and args.partitioner == "pulse":
        print()
        print(f"cut sets priced by the simulator (whole step, best V schedule, {setup.cluster.name}):")
        for line in describe_priced(priced):
            print(f"  {line}")
    for note in notes:
        print(f"note: {note}")
    if args.out:
        print(f"plan written to {args.out}")
    return 0


def all_placements(setup: Setup, pp: int, folds: int, strict: bool, objective: str = "time",
                   num_microbatches: int | None = None, candidates: int = 0,
                   ) -> tuple[dict[str, Placement], list[str], tuple[PricedCuts, ...]]:
    """Every partitioner's placement, notes on crossing skips, and the cut sets the simulator priced
    for pulse's (with ``candidates`` > 0: ``pulse.partition.priced``)."""
    spec, costs, cluster = setup.spec, setup.costs, setup.cluster
    notes = []
    crossing = spec.crossing_pairs()
    if crossing:  # local only if a chain keeps both in one encoder/decoder pair (partition.cuts)
        notes.append(f"{len(crossing)} crossing skip pair(s): kept on one device where they share an "
                     "encoder/decoder pair, else sent directly")
    try:
        symmetric = plan_symmetric(spec, costs, pp, folds=folds, strict=strict, cluster=cluster,
                                   objective=objective, num_microbatches=num_microbatches, candidates=candidates,
                                   memory_budget=cluster.hardware.memory_bytes)
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
    return placements, notes, symmetric.priced


def priced_row(priced: PricedCuts) -> dict:
    """One priced cut set as JSON: where it came from, its cuts (layer indices), its simulated step."""
    return {"source": priced.source, "cuts": [list(c) for c in priced.cuts[1:]],
            "step_seconds": priced.step_seconds if priced.step_seconds < float("inf") else None,  # None: not priced
            "schedule": priced.schedule}


def plan_request(args: argparse.Namespace, setup: Setup, traits: BackendTraits = BackendTraits(),
                 encoders: EncoderSet | None = None) -> PlanRequest:
    """The planner's request the pipeline flags make (`pulse plan` has no --dp, --schedule, --time-limit
    or --emulate-bandwidth: the request's defaults)."""
    optional = {name: getattr(args, name) for name in ("dp", "schedule", "time_limit", "emulate_bandwidth")
                if hasattr(args, name)}
    return PlanRequest(model=args.model, cluster=args.cluster, pp=args.pp, microbatch_size=args.microbatch_size,
                       num_microbatches=args.num_microbatches, partitioner=args.partitioner, folds=args.folds,
                       strict=args.strict, objective=args.partition_objective, recompute=args.recompute,
                       encoders=encoders, traits=traits, model_options=setup.model_options, **optional)


def partition_plan(args: argparse.Namespace, setup: Setup, placement: Placement, rep: PartitionReport) -> Plan:
    """The partition's plan (no schedule), with the partition's own figures as its prediction."""
    request = plan_request(args, setup)
    predicted = {
        "bytes_per_microbatch": rep.bytes_per_microbatch,
        "bottleneck_seconds_per_microbatch": rep.bottleneck,
        "imbalance": rep.imbalance,
        "cost_source": setup.costs.source,
    }
    return plan_of(request, placement, recompute=recompute_chunks(request.recompute, len(placement.chunks)),
                   predicted=predicted)


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
