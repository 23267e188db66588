"""`pulse simulate`: schedule a placement, simulate it and every baseline, draw the timeline."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable

from pulse.args.parser import image_file, memory_gib, output_file, positive_int, seconds_float
from pulse.cli.common import (ACT_BYTES, DEFAULT_CLUSTER, Setup, add_model_arguments, add_pipeline_arguments,
                              check_positive, fmt_bytes, load_model, load_setup)
from pulse.cli.plan_cmd import all_placements
from pulse.cli.encoders_args import encoder_modes, model_encoders
from pulse.costs import AnalyticProfiler, CostTable, with_encoder_costs
from pulse.encoders import EncoderSet
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.placement import Placement
from pulse.plan import Plan, load_plan
from pulse.planner import auto_schedule, memory_of, recompute_chunks
from pulse.schedule.generators import OnLinks, applicable_baselines, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import validate
from pulse.sim.breakdown import step_breakdown
from pulse.sim.floor import compute_floor, floor_distance
from pulse.sim.engine import simulate
from pulse.sim.figures import sim_figures
from pulse.sim.memory import MemoryModel
from pulse.sim.result import SimResult
from pulse.sim.step import StepTerms, StepTime, step_time
from pulse.tune.bounds import placement_bound
from pulse.tune.space import Candidate
from pulse.yamlio import dump_json

Say = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", help="a plan YAML from `pulse plan`/`pulse tune` (overrides the model flags)")
    add_model_arguments(parser)
    parser.set_defaults(cluster=None)  # with --plan: the plan's cluster unless --hardware names another
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
    parser.add_argument("--encoders", default=None,
                        help="where the frozen encoders (text, VAE) run: cached (data encoded offline), before (on "
                             "the first device before the pipeline), bubbles (in the pipeline's idle gaps); "
                             "default: the plan's, else cached")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: the figures on stdout (key names as `pulse plan` / `pulse tune`), "
                             "progress and notes on stderr")


def run(args: argparse.Namespace) -> int:
    as_json = args.format == "json"
    say: Say = (lambda line: print(line, file=sys.stderr, flush=True)) if as_json else print
    setup, placement, num_mb, base = _inputs(args)
    check_positive(num_microbatches=num_mb)
    check_simulation_size(num_mb, len(placement.chunks))
    base["recompute"] = recompute_chunks(args.recompute, len(placement.chunks), base["recompute"])
    memory = memory_of(base["recompute"])
    encoders = _encoders(args, setup, base.get("encoders"))
    if encoders is not None:  # measured encoder times kept, the others estimated like layers
        setup = replace(setup, costs=with_encoder_costs(setup.costs, encoders, setup.cluster.hardware))
    budget = (setup.cluster.hardware.memory_bytes if args.memory_budget is None
              else int(args.memory_budget * 2**30))
    chosen, schedules, results, note = _choose(args, setup, placement, num_mb, None if args.force else budget, say,
                                               memory, encoders, base["dp"])
    results = {name: replace(r, memory_budget=budget) for name, r in results.items()}
    terms = StepTerms(dp=base["dp"], grad_bytes=4)  # as pulse train predicts: fp32 gradients all-reduced
    steps = {name: step_time(setup.spec, placement, setup.costs, setup.cluster, r, terms) for name, r in results.items()}
    num_mb = schedules[chosen].num_microbatches  # a schedule file brings its own count
    best = results[chosen]
    parts = step_breakdown(setup.spec, placement, schedules[chosen], setup.costs, setup.cluster, steps[chosen],
                           memory, encoders, base["dp"])
    floor = floor_distance(setup.costs, placement.num_devices, num_mb, steps[chosen].total)
    least = any_schedule_bound(setup, placement, num_mb, base["dp"], terms, encoders)
    if as_json:
        report = json_report(setup, placement, num_mb, base["dp"], chosen, results, steps, note)
        print(dump_json({**report, "recompute": list(base["recompute"]), "step_breakdown_seconds": parts.parts(),
                         "compute_floor_seconds": floor.floor, "step_over_floor": floor.ratio,
                         "placement_bound_seconds": least}), end="")
    else:
        print(f"{setup.spec.name}: {placement.partitioner} {placement.kind} placement, {placement.num_devices} "
              f"devices of {setup.cluster.name}, {num_mb} microbatches of {setup.costs.microbatch_size}, "
              f"{recompute_text(base['recompute'], len(placement.chunks))}")
        print(format_results(results, chosen, steps, floor.floor))
        print(f"where the {chosen} step goes (pulse.sim.breakdown): {parts.text()}")
        print(f"{chosen}: {floor.text()} (pulse.sim.floor)")
        print(f"no schedule of this placement beats {least * 1e3:.2f} ms ({least / floor.floor:.3f}x the floor; "
              f"pulse.tune.bounds): another schedule could win back at most "
              f"{max(steps[chosen].total - least, 0.0) * 1e3:.2f} ms of {chosen}'s step")
        if note:
            print(note)
        print("peak memory per device (GiB): " + " ".join(f"{m / 2**30:.2f}" for m in best.peak_memory))
    _check_fits(best, chosen, setup, args.force, say)
    if encoders is not None:
        say(f"frozen encoders {encoders.mode}: " + ", ".join(
            f"{e.name} {setup.costs.encoder_seconds(e.name) * 1e3:.2f} ms/microbatch" for e in encoders.encoders))
    _write_outputs(args, setup, placement, base, num_mb, chosen, schedules[chosen], (best, steps[chosen]), say,
                   encoders)
    return 0


def any_schedule_bound(setup: Setup, placement: Placement, num_mb: int, dp: int, terms: StepTerms,
                       encoders: EncoderSet | None) -> float:
    """Seconds no schedule of ``placement`` can beat: the tuner's bound (``pulse.tune.bounds``) taken both
    ways a backward may run, whole and split, so that it holds for every schedule."""
    cand = Candidate(placement.partitioner, placement.num_devices, dp, setup.costs.microbatch_size, num_mb, 0,
                     placement.partitioner, "any", encoders=encoders.mode if encoders is not None else "cached")
    return placement_bound(setup.spec, placement, setup.costs, setup.cluster, cand, terms)


# Chunk passes (microbatches x chunks) one simulation may hold: each schedule's lowered lists, its
# validation and its event simulation grow faster than linearly in them (about 10 s at 12,800 on one
# core), and every baseline is simulated; a pipeline's steady state shows within a few times pp
# microbatches, so more only costs time with no output.
MAX_CHUNK_PASSES = 20_000


def check_simulation_size(num_microbatches: int, num_chunks: int) -> None:
    passes = num_microbatches * num_chunks
    if passes > MAX_CHUNK_PASSES:
        raise PulseError(f"--num-microbatches {num_microbatches} over {num_chunks} chunks is {passes:,} chunk passes "
                         f"to simulate per schedule (limit {MAX_CHUNK_PASSES:,}, minutes of work beyond it): give at "
                         f"most {MAX_CHUNK_PASSES // num_chunks}; a pipeline's steady state shows within a few "
                         "times pp microbatches")


def _encoders(args, setup: Setup, planned: EncoderSet | None) -> EncoderSet | None:
    """The encoders that run in the pipeline: --encoders, else the plan's; None when cached."""
    if args.encoders is None:
        return planned if planned is not None and planned.active else None
    (mode,) = encoder_modes(args.encoders) if "," not in args.encoders else (None,)
    if mode is None:
        raise PulseError(f"--encoders: pulse simulate takes one mode, got '{args.encoders}'")
    if mode == "cached":
        return None
    base = planned if planned is not None else model_encoders(setup.spec, (mode,))
    return base.with_mode(mode)


def json_report(setup: Setup, placement: Placement, num_mb: int, dp: int, chosen: str,
                results: dict[str, SimResult], steps: dict[str, StepTime], note: str) -> dict:
    """What the text report shows, under the key names of ``pulse.sim.figures``; rows fastest first."""
    floor = compute_floor(setup.costs, placement.num_devices, num_mb)
    rows = [{"schedule": name, **sim_figures(r, steps[name], dp),
             "step_over_floor": steps[name].total / floor if floor > 0 else None}
            for name, r in sorted(results.items(), key=lambda kv: kv[1].makespan)]
    return {
        "model": setup.spec.name, "cluster": setup.cluster.name, "cost_source": setup.costs.source,
        "placement": {"partitioner": placement.partitioner, "kind": placement.kind,
                      "num_devices": placement.num_devices},
        "num_microbatches": num_mb, "microbatch_size": setup.costs.microbatch_size, "dp": dp,
        "chosen": chosen, "note": note, "schedules": rows,
        "peak_memory_bytes_per_device": list(results[chosen].peak_memory),
    }


def _write_outputs(args, setup: Setup, placement: Placement, base: dict, num_mb: int, chosen: str,
                   schedule: Schedule, priced: tuple[SimResult, StepTime], say: Say,
                   encoders: EncoderSet | None = None) -> None:
    best, step = priced
    if args.timeline:
        from pulse.views.timeline import draw_timeline

        draw_timeline(best, placement, args.timeline, title=f"{setup.spec.name}: {chosen}")
        say(f"timeline written to {args.timeline}")
    if args.trace:
        from pulse.views.trace import write_trace

        write_trace(best, args.trace)
        say(f"trace written to {args.trace}")
    if args.out:
        predicted = {**sim_figures(best, step, base["dp"]), "schedule": chosen,
                     "cost_source": setup.costs.source}
        plan = Plan(model=base["model"], cluster=base["cluster"], pp=placement.num_devices, dp=base["dp"],
                    microbatch_size=setup.costs.microbatch_size, num_microbatches=num_mb,
                    partitioner=placement.partitioner, placement=placement, schedule=schedule,
                    model_options=setup.model_options, predicted=predicted, recompute=base["recompute"],
                    encoders=encoders)
        plan.save(args.out, setup.spec)
        say(f"plan written to {args.out}")


def _inputs(args) -> tuple[Setup, Placement, int, dict]:
    if args.plan:
        plan, spec = load_plan(args.plan, load_model)
        spec = spec.with_act_bytes(ACT_BYTES[args.precision])
        if args.cluster:  # e.g. the cluster YAML `pulse profile` measured
            cluster = load_cluster(args.cluster)
        else:
            try:
                cluster = load_cluster(plan.cluster)
            except PulseError as exc:
                raise PulseError(f"{args.plan}: 'cluster': {exc}; or price it on another with --hardware") from None
        costs = CostTable.load(args.costs) if args.costs else AnalyticProfiler(cluster.hardware).profile(
            spec, plan.microbatch_size)
        costs.check_matches(spec)
        num_mb = args.num_microbatches or plan.num_microbatches
        base = {"model": plan.model, "cluster": args.cluster or plan.cluster, "dp": plan.dp,
                "recompute": plan.recompute,
                "encoders": plan.encoders}
        return Setup(spec, cluster, costs, plan.model_options), plan.placement, num_mb, base
    check_positive(pp=args.pp, microbatch_size=args.microbatch_size, folds=args.folds)
    args.cluster = args.cluster or DEFAULT_CLUSTER
    setup = load_setup(args)
    placements, _, _ = all_placements(setup, args.pp, args.folds, args.strict, args.partition_objective)
    base = {"model": args.model, "cluster": args.cluster, "dp": 1, "recompute": ()}
    return setup, placements[args.partitioner], args.num_microbatches or 2 * args.pp, base


def _choose(args, setup: Setup, placement: Placement, num_mb: int, budget: int | None, say: Say,
            memory: MemoryModel, encoders: EncoderSet | None = None, replicas: int = 1
            ) -> tuple[str, dict[str, Schedule], dict[str, SimResult], str]:
    spec, costs, cluster = setup.spec, setup.costs, setup.cluster
    schedules: dict[str, Schedule] = {}
    note = ""
    if args.schedule == "auto":
        synth = auto_schedule(spec, placement, costs, cluster, num_mb, memory, args.time_limit, budget,
                              progress=lambda msg: say(f"  ilp: {msg}"))
        schedules[synth.schedule.name] = synth.schedule
        note = synth.explanation
    elif args.schedule.endswith((".yaml", ".yml", ".json", ".csv")):
        loaded = Schedule.load(args.schedule, num_microbatches=num_mb)
        validate(loaded, placement, loaded.num_microbatches)
        schedules[loaded.name] = loaded
        num_mb = loaded.num_microbatches
    links = OnLinks(spec, cluster)  # the list schedules as `pulse train` orders them
    for name in applicable_baselines(placement, num_mb):
        schedules.setdefault(name, make_schedule(name, placement, num_mb, costs, links))
    if args.schedule not in ("auto", *schedules) and not args.schedule.endswith((".yaml", ".yml", ".json", ".csv")):
        raise PulseError(f"unknown schedule '{args.schedule}' (auto, a file, or one of {', '.join(schedules)})")
    if encoders is not None:  # every schedule (the ILP's too) gets its encodes by the same greedy pass
        from pulse.synth.encodes import ENCODE_ILP_SECONDS, place_encodes_with_ilp

        share = min(ENCODE_ILP_SECONDS, args.time_limit / max(len(schedules), 1))
        schedules = {name: place_encodes_with_ilp(spec, placement, s, costs, cluster, encoders, budget,
                                                   ilp_seconds=share)
                     for name, s in schedules.items()}
    elif any(s.has_encodes for s in schedules.values()):
        schedules = {name: s.without_encodes() for name, s in schedules.items()}
    results = {name: simulate(spec, placement, s, costs, cluster, memory_budget=budget, memory=memory,
                                encoders=encoders, replicas=replicas)
               for name, s in schedules.items()}
    chosen = args.schedule if args.schedule in schedules else next(iter(schedules))
    return chosen, schedules, results, note


def _check_fits(best: SimResult, chosen: str, setup: Setup, force: bool, say: Say) -> None:
    """The chosen schedule must fit the budget, as `pulse train` demands; ``--force`` reports it anyway."""
    if best.fits_memory:
        return
    message = (f"{chosen} needs {max(best.peak_memory) / 2**30:.2f} GiB per device but the budget is "
               f"{best.memory_budget / 2**30:.2f} GiB ({setup.cluster.hardware.name}); raise --pp, lower "
               "--microbatch-size, give --recompute, or --force to report it anyway")
    if not force:
        raise PulseError(message)
    say(f"warning (--force): {message.split('; raise')[0]}")


def recompute_text(chunks: tuple[int, ...], num_chunks: int) -> str:
    """How a report names the recomputing chunks."""
    if not chunks:
        return "no recomputation"
    which = "all chunks" if len(chunks) == num_chunks else "chunks " + ",".join(map(str, chunks))
    return f"recomputing {which}"


def format_results(results: dict[str, SimResult], chosen: str, steps: dict[str, StepTime], floor: float) -> str:
    """One row per schedule, fastest first; a schedule over the memory budget is marked OVER.
    ``moved``: one replica's point-to-point bytes per step; ``vs floor``: the step over the compute
    floor (``pulse.sim.floor``), in ms and as a ratio."""
    lines = [f"  {'schedule':<16}{'makespan ms':>12}{'step ms':>10}{'bubble':>9}{'peak GiB':>10}{'moved':>11}"
             f"{'vs floor':>18}  memory"]
    for name, r in sorted(results.items(), key=lambda kv: kv[1].makespan):
        mark = "*" if name == chosen else " "
        fits = "fits" if r.fits_memory else "OVER budget"
        over = f"+{(steps[name].total - floor) * 1e3:.2f} {steps[name].total / floor:.3f}x" if floor > 0 else "-"
        lines.append(f"{mark} {name:<16}{r.makespan * 1e3:>12.2f}{steps[name].total * 1e3:>10.2f}"
                     f"{r.bubble_ratio:>9.1%}{max(r.peak_memory) / 2**30:>10.2f}{fmt_bytes(r.total_link_bytes):>11}"
                     f"{over:>18}  {fits}")
    return "\n".join(lines)
