"""`pulse simulate`: schedule a placement, simulate it and every baseline, draw the timeline."""
from __future__ import annotations

import argparse
from dataclasses import replace

from pulse.cli.common import (ACT_BYTES, Setup, add_model_arguments, add_pipeline_arguments, check_positive,
                              fmt_bytes, image_file, load_model, load_setup, memory_gib, output_file, positive_int,
                              seconds_float)
from pulse.cli.plan_cmd import all_placements
from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.placement import Placement
from pulse.plan import Plan, load_plan
from pulse.schedule.generators import applicable_baselines, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import validate
from pulse.sim.engine import simulate
from pulse.sim.result import SimResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", help="a plan YAML from `pulse plan`/`pulse tune` (overrides the model flags)")
    add_model_arguments(parser)
    add_pipeline_arguments(parser)
    parser.add_argument("--partitioner", choices=("pulse", "sequential", "diffusionpipe"), default="pulse")
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="default: the plan's, or 2*pp")
    parser.add_argument("--schedule", default="auto",
                        help="auto (ILP synthesis vs every baseline), a baseline name, or a schedule file")
    parser.add_argument("--time-limit", type=seconds_float, default=20.0, help="total seconds for ILP synthesis (split between the tiled and the full solve)")
    parser.add_argument("--memory-budget", type=memory_gib, default=None,
                        help="GiB per device (default: the device's memory); caps in-flight microbatches, marks "
                             "and refuses schedules over it")
    parser.add_argument("--force", action="store_true",
                        help="report a chosen schedule that does not fit the memory budget instead of refusing it")
    parser.add_argument("--timeline", type=image_file, help="Gantt chart PNG of the chosen schedule")
    parser.add_argument("--trace", type=output_file, help="Chrome-trace (Perfetto) JSON of the chosen schedule")
    parser.add_argument("--out", type=output_file, help="write the plan with its schedule")


def run(args: argparse.Namespace) -> int:
    setup, placement, num_mb, base = _inputs(args)
    check_positive(num_microbatches=num_mb)
    budget = (setup.cluster.hardware.memory_bytes if args.memory_budget is None
              else int(args.memory_budget * 2**30))
    chosen, schedules, results, note = _choose(args, setup, placement, num_mb, None if args.force else budget)
    results = {name: replace(r, memory_budget=budget) for name, r in results.items()}
    num_mb = schedules[chosen].num_microbatches  # a schedule file brings its own count
    print(f"{setup.spec.name}: {placement.partitioner} {placement.kind} placement, {placement.num_devices} devices "
          f"of {setup.cluster.name}, {num_mb} microbatches of {setup.costs.microbatch_size}")
    print(format_results(results, chosen))
    if note:
        print(note)
    best = results[chosen]
    print("peak memory per device (GiB): " + " ".join(f"{m / 2**30:.2f}" for m in best.peak_memory))
    _check_fits(best, chosen, setup, args.force)
    if args.timeline:
        from pulse.views.timeline import draw_timeline

        draw_timeline(best, placement, args.timeline, title=f"{setup.spec.name}: {chosen}")
        print(f"timeline written to {args.timeline}")
    if args.trace:
        from pulse.views.trace import write_trace

        write_trace(best, args.trace)
        print(f"trace written to {args.trace}")
    if args.out:
        plan = Plan(model=base["model"], cluster=base["cluster"], pp=placement.num_devices, dp=base["dp"],
                    microbatch_size=setup.costs.microbatch_size, num_microbatches=num_mb,
                    partitioner=placement.partitioner, placement=placement, schedule=schedules[chosen],
                    model_options=setup.model_options,
                    predicted={"makespan_seconds": best.makespan, "bubble_ratio": best.bubble_ratio,
                               "peak_memory_bytes": max(best.peak_memory), "schedule": chosen})
        plan.save(args.out, setup.spec)
        print(f"plan written to {args.out}")
    return 0


def _inputs(args) -> tuple[Setup, Placement, int, dict]:
    if args.plan:
        plan, spec = load_plan(args.plan, load_model)
        spec = spec.with_act_bytes(ACT_BYTES[args.precision])
        try:
            cluster = load_cluster(plan.cluster)
        except PulseError as exc:
            raise PulseError(f"{args.plan}: 'cluster': {exc}") from None
        costs = CostTable.load(args.costs) if args.costs else AnalyticProfiler(cluster.hardware).profile(
            spec, plan.microbatch_size)
        costs.check_matches(spec)
        num_mb = args.num_microbatches or plan.num_microbatches
        base = {"model": plan.model, "cluster": plan.cluster, "dp": plan.dp}
        return Setup(spec, cluster, costs, plan.model_options), plan.placement, num_mb, base
    check_positive(pp=args.pp, microbatch_size=args.microbatch_size, folds=args.folds)
    setup = load_setup(args)
    placements, _ = all_placements(setup, args.pp, args.folds, args.strict, args.partition_objective)
    base = {"model": args.model, "cluster": args.cluster, "dp": 1}
    return setup, placements[args.partitioner], args.num_microbatches or 2 * args.pp, base


def _choose(args, setup: Setup, placement: Placement, num_mb: int,
            budget: int | None) -> tuple[str, dict[str, Schedule], dict[str, SimResult], str]:
    spec, costs, cluster = setup.spec, setup.costs, setup.cluster
    schedules: dict[str, Schedule] = {}
    note = ""
    if args.schedule == "auto":
        from pulse.synth import synthesize

        synth = synthesize(spec, placement, costs, cluster, num_mb, memory_budget=budget,
                           time_limit=args.time_limit, progress=lambda msg: print(f"  ilp: {msg}", flush=True))
        schedules[synth.schedule.name] = synth.schedule
        note = synth.explanation
    elif args.schedule.endswith((".yaml", ".yml", ".json", ".csv")):
        loaded = Schedule.load(args.schedule, num_microbatches=num_mb)
        validate(loaded, placement, loaded.num_microbatches)
        schedules[loaded.name] = loaded
        num_mb = loaded.num_microbatches
    for name in applicable_baselines(placement, num_mb):
        schedules.setdefault(name, make_schedule(name, placement, num_mb, costs))
    if args.schedule not in ("auto", *schedules) and not args.schedule.endswith((".yaml", ".yml", ".json", ".csv")):
        raise PulseError(f"unknown schedule '{args.schedule}' (auto, a file, or one of {', '.join(schedules)})")
    results = {name: simulate(spec, placement, s, costs, cluster, memory_budget=budget)
               for name, s in schedules.items()}
    chosen = args.schedule if args.schedule in schedules else next(iter(schedules))
    return chosen, schedules, results, note


def _check_fits(best: SimResult, chosen: str, setup: Setup, force: bool) -> None:
    """The chosen schedule must fit the budget, as `pulse train` demands; ``--force`` reports it anyway."""
    if best.fits_memory:
        return
    message = (f"{chosen} needs {max(best.peak_memory) / 2**30:.2f} GiB per device but the budget is "
               f"{best.memory_budget / 2**30:.2f} GiB ({setup.cluster.hardware.name}); raise --pp, lower "
               "--microbatch-size, or give --force to report it anyway")
    if not force:
        raise PulseError(message)
    print(f"warning (--force): {message.split('; raise')[0]}")


def format_results(results: dict[str, SimResult], chosen: str) -> str:
    """One row per schedule, fastest first; a schedule over the memory budget is marked OVER."""
    lines = [f"  {'schedule':<16}{'makespan ms':>12}{'bubble':>9}{'peak GiB':>10}{'moved':>11}  memory"]
    for name, r in sorted(results.items(), key=lambda kv: kv[1].makespan):
        mark = "*" if name == chosen else " "
        fits = "fits" if r.fits_memory else "OVER budget"
        lines.append(f"{mark} {name:<16}{r.makespan * 1e3:>12.2f}{r.bubble_ratio:>9.1%}"
                     f"{max(r.peak_memory) / 2**30:>10.2f}{fmt_bytes(r.total_link_bytes):>11}  {fits}")
    return "\n".join(lines)
