"""`pulse tune`: search PP x DP x microbatching x folds x schedule for a model and cluster."""
from __future__ import annotations

import argparse
import sys

from pulse.args.model_args import add_diffusers_argument, option_pairs, parse_options
from pulse.args.parser import int_list, memory_gib, output_file, positive_int
from pulse.cli.common import ACT_BYTES, add_precision_argument, load_costs, load_model
from pulse.cli.encoders_args import add_encoders_argument, encoder_modes, model_encoders
from pulse.cli.figures import evaluation_figures
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.optimizers import NAMES as OPTIMIZERS
from pulse.optimizers import optimizer_kind
from pulse.plan import Plan
from pulse.sim.memory import mixed_precision_memory
from pulse.progress import Progress
from pulse.tune.report import BASELINE_STRATEGIES, format_result
from pulse.tune.space import enumerate_candidates
from pulse.backend_traits import load_traits
from pulse.tune.measured import MeasuredProfiler
from pulse.tune.tuner import TuneRequest, TuneResult, default_budget, tune
from pulse.spec import ModelSpec
from pulse.zoo.common import BLOCK_NAME_OPTIONS
from pulse.yamlio import dump_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="sd2-unet", help="zoo name or spec YAML path")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--cluster", default="ascend-910a-2x8", help="cluster name or YAML (configs/clusters)")
    parser.add_argument("--global-batch", type=positive_int, default=256)
    parser.add_argument("--memory-budget", type=memory_gib, default=None,
                        help="GiB per device (default: device memory minus 2 GiB)")
    parser.add_argument("--microbatch-sizes", type=int_list, default=None,
                        help="comma-separated candidates (default: powers of two from 1 to a device's share of "
                             "the global batch, at least to 8; with --costs: the table's size)")
    parser.add_argument("--costs", default=None,
                        help="a measured cost table (`pulse profile`; as plan, simulate and train take) instead of "
                             "the analytic model: the search keeps to the microbatch size it was measured at")
    parser.add_argument("--folds", type=int_list, default="1,2", help="comma-separated fold counts for the pulse placement")
    parser.add_argument("--max-pp", type=positive_int, default=None)
    add_precision_argument(parser, "fp16")
    parser.add_argument("--backend", choices=("torch", "mindspore"), default=None,
                        help="price memory as this PULSE backend's ranks hold it (fp32 weights, gradients and "
                             "AdamW moments, autocast's weight copies, data-parallel buckets; what `pulse train` "
                             "prices and log.json measures); default: mixed-precision Adam as accelerator "
                             "frameworks count it (2 + 2 + 12 bytes per parameter)")
    parser.add_argument("--ema", action="store_true", help="with --backend: price an EMA copy of the weights")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="price this optimizer's state per trained parameter (pulse.optimizers: adamw 8 B, "
                             "adafactor ~1.9, adamw8bit ~2.03, lion 4, prodigy 16), as `pulse train --optimizer`")
    parser.add_argument("--no-recompute", action="store_true",
                        help="never recompute activations (by default a configuration over the memory budget is "
                             "priced again recomputing the chunks of its over-budget devices, then every chunk)")
    parser.add_argument("--top", type=positive_int, default=10)
    add_encoders_argument(parser, many=True)
    parser.add_argument("--out", type=output_file, default="tuned-plan.yaml", help="where to write the winning plan")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: the ranking on stdout (key names as `pulse plan` / `pulse simulate`), "
                             "progress on stderr")


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PulseError(f"{flag} expects comma-separated whole numbers, got '{text}'") from None
    if not values or min(values) < 1:
        raise PulseError(f"{flag} expects numbers >= 1, got '{text}'")
    return values


def microbatch_sizes(args: argparse.Namespace, profiler: MeasuredProfiler | None) -> tuple[int, ...]:
    """``--microbatch-sizes``, or with ``--costs`` the table's one size (another size is refused, in one line)."""
    if profiler is None:
        return _int_list(args.microbatch_sizes, "--microbatch-sizes") if args.microbatch_sizes else ()
    if args.microbatch_sizes is None:
        return profiler.microbatch_sizes
    asked = _int_list(args.microbatch_sizes, "--microbatch-sizes")
    others = [size for size in asked if size not in profiler.microbatch_sizes]
    if others:
        measured = profiler.table.microbatch_size
        raise PulseError(f"{args.costs} was measured at microbatch size {measured}, but --microbatch-sizes asks "
                         f"for {', '.join(map(str, others))}: give --microbatch-sizes {measured}, or profile "
                         "each size and tune with its table")
    return asked


def held_memory(args: argparse.Namespace) -> dict:
    """``--backend``: the tuner prices what that backend's ranks hold (buckets only where dp > 1,
    ``pulse.tune.evaluate``); none: the request's default accounting."""
    if args.backend is None:
        if args.ema:
            raise PulseError("--ema prices a backend's EMA copy: give --backend torch or mindspore too")
        return {} if args.optimizer == "adamw" else {"memory": mixed_precision_memory(args.optimizer)}
    return {"memory": load_traits(args.backend).memory(args.precision, ema=args.ema, dp=2, optimizer=args.optimizer)}


def run(args: argparse.Namespace) -> int:
    options = parse_options(args.model_option)
    spec = load_model(args.model, options).with_act_bytes(ACT_BYTES[args.precision])
    cluster = load_cluster(args.cluster)
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise PulseError(f"--memory-budget must be positive GiB, got {args.memory_budget}")
    budget = default_budget(cluster) if args.memory_budget is None else int(args.memory_budget * 2**30)
    modes = encoder_modes(args.encoders)
    profiler = MeasuredProfiler(load_costs(args.costs, spec), args.costs) if args.costs else None
    if not optimizer_kind(args.optimizer).elementwise:  # Prodigy trains at pp 1 only (pulse.optimizers.check_pipeline)
        args.max_pp = 1
        print(f"--optimizer {args.optimizer}: searching pp 1 only (its step size sums over the whole model, which "
              "a pipeline stage does not see)", file=sys.stderr if args.format == "json" else sys.stdout)
    request = TuneRequest(spec, cluster, args.global_batch, budget, microbatch_sizes(args, profiler),
                          _int_list(args.folds, "--folds"),
                          args.max_pp, recompute=not args.no_recompute, encoders=model_encoders(spec, modes),
                          encoder_modes=modes, **held_memory(args))
    total = len(enumerate_candidates(cluster.num_devices, args.global_batch, request.sizes,
                                     request.folds, min(args.max_pp or cluster.num_devices, spec.num_layers)))
    total *= len(modes) if request.encoders is not None else 1
    as_json = args.format == "json"
    out = sys.stderr if as_json else sys.stdout
    print(f"tuning {spec.name} ({spec.total_params / 1e6:.1f}M params) on {cluster.name} "
          f"({cluster.num_devices} devices), global batch {args.global_batch}, budget {budget / 2**30:.2f} GiB/device",
          file=out)
    if profiler is not None:
        print(f"costs: {args.costs} ({profiler.table.source}), measured at microbatch size "
              f"{profiler.table.microbatch_size}: the search keeps to that size", file=out)
    def fit_layers(split: dict) -> ModelSpec:  # the model with other split options (pulse.tune.fitted)
        return load_model(args.model, {**options, **split}).with_act_bytes(ACT_BYTES[args.precision])

    with Progress(total, "tune") as bar:
        result = tune(request, profiler, progress=lambda label: bar.update(1, note=label), top=args.top,
                      fit_layers=fit_layers if any(options.get(o) for o in BLOCK_NAME_OPTIONS) else None)
    if as_json:
        print(dump_json(json_report(result, args, budget)), end="")
    else:
        print(format_result(result, args.top))
    winner = result.winner
    c = winner.candidate
    if winner.fitted is not None:
        split = winner.fitted.plan_options
        options, spec = {**options, **split}, winner.fitted.spec
        kept = " ".join(option_pairs(split))
        print(f"finer layers kept only where the winner's cuts fall ({spec.num_layers} layers): {kept}", file=out)
    predicted = {k: v for k, v in evaluation_figures(winner, budget).items()
                 if k not in ("label", "partitioner", "pp", "dp", "microbatch_size", "num_microbatches", "folds",
                              "schedule", "inflight_cap", "recompute", "step_breakdown_seconds", "fitted_layers")}
    plan = Plan(model=args.model, cluster=args.cluster, pp=c.pp, dp=c.dp, microbatch_size=c.microbatch_size,
                num_microbatches=c.num_microbatches, partitioner=c.partitioner, placement=winner.placement,
                schedule=winner.schedule, model_options=options, predicted=predicted, recompute=c.recompute,
                encoders=winner.encoders)
    plan.save(args.out, spec)
    print(f"plan written to {args.out}", file=out)
    return 0


def json_report(result: TuneResult, args: argparse.Namespace, budget: int) -> dict:
    """The text tables as data: the top ``--top`` that fit, the best of each strategy, the winner."""
    best = {s: (evaluation_figures(e, budget) if (e := result.best_by_strategy.get(s)) else None)
            for s in ("pulse",) + BASELINE_STRATEGIES}
    return {
        "model": args.model, "cluster": args.cluster, "global_batch": args.global_batch,
        "memory_budget_bytes": budget, "search_seconds": result.seconds,
        "counts": {"fit": len(result.ranked), "over_budget": len(result.rejected),
                   "unbuildable": len(result.unbuildable), "skipped_by_bound": result.skipped},
        "ranked": [evaluation_figures(e, budget) for e in result.ranked[:args.top]],
        "fastest_rejected": (dict(evaluation_figures(result.rejected[0], budget), reason=result.rejected[0].reason)
                             if result.rejected else None),
        "best_by_strategy": best,
        "pulse_speedup": {s: result.speedup_over(s) for s in BASELINE_STRATEGIES},
        "winner": evaluation_figures(result.winner, budget),
        "plan_file": str(args.out),
    }
