"""Arguments and loaders shared by the `pulse` subcommands."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pulse.args.model_args import add_diffusers_argument, option_pairs, parse_options
from pulse.args.parser import non_negative_int, positive_int
from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster, load_cluster
from pulse.partition.fitted_splits import blocks_cut
from pulse.placement import Placement
from pulse.spec import ModelSpec
from pulse.train.run_config import PRECISIONS
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.progress import fmt_bytes  # noqa: F401  (the commands print sizes with it)
from pulse.zoo.common import BLOCK_NAME_OPTIONS
from pulse.zoo.loading import load_model
from pulse.zoo.unet_blocks import SPLIT_OPTIONS, block_of


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "sd2-unet",
                        precision: str = "fp16") -> None:
    parser.add_argument("--model", default=default_model,
                        help="zoo name (sd2-unet, sd2-unet-768, uvit, hunyuan-dit, tiny-*) or a spec YAML path")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                        help="zoo builder option, e.g. resolution=768 (repeatable)")
    parser.add_argument("--hardware", "--cluster", dest="cluster", default=DEFAULT_CLUSTER,
                        help="hardware name (one node) or cluster name/YAML from configs/")
    parser.add_argument("--costs", default=None,
                        help="a measured cost table (YAML/JSON) instead of the analytic model")
    add_precision_argument(parser, precision)


PRECISION_HELP = ("the precision the job trains in: fp32, or bf16/fp16 mixed precision; activations are counted "
                  "at its width")


def add_precision_argument(parser: argparse.ArgumentParser, default: str, also: str = "") -> None:
    """``--precision``, one meaning for every command: the training precision (``also``: what the command
    does with it besides); ``default`` is the command's (fp16 where only bytes are counted, fp32 to train)."""
    parser.add_argument("--precision", choices=PRECISIONS, default=default,
                        help=f"{PRECISION_HELP}{also} (default {default})")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=positive_int, default=4, help="pipeline devices")
    parser.add_argument("--microbatch-size", type=positive_int, default=1)
    parser.add_argument("--folds", type=positive_int, default=1, help="1 = V placement, k > 1 = wave with k folds")
    parser.add_argument("--strict", action="store_true",
                        help="keep every skip on its device: refuse models whose skips cross, and never "
                             "price V cuts that send a skip between devices (without it: sent directly "
                             "where the simulator finds that faster)")
    parser.add_argument("--partition-objective", choices=("time", "balance"), default="time",
                        help="time: the V's cuts priced on the cluster's links too (a slow link moves them to "
                             "small tensors); balance: compute balance alone, bytes within 2%% of it")
    parser.add_argument("--recompute", nargs="?", const="all", default=None, type=recompute_choice,
                        metavar="CHUNKS",
                        help="activation recomputation: a chunk's forward keeps only its inputs and its backward "
                             "re-runs it (less memory, one more forward per microbatch); 'all' (the default when "
                             "the flag is given alone), 'none', or chunk indices like 0,3")


def recompute_choice(text: str) -> str:
    """``type=``: all, none, or comma-separated chunk indices (0-based), as normalised text."""
    text = text.strip().lower()
    if text in ("all", "none"):
        return text
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"expected all, none or chunk indices like 0,3, got '{text[:60]}'")
    return ",".join(str(non_negative_int(item)) for item in items)


@dataclass(frozen=True)
class Setup:
    spec: ModelSpec
    cluster: Cluster
    costs: CostTable
    model_options: dict


ACT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
DEFAULT_CLUSTER = "ascend-910a"


def load_setup(args: argparse.Namespace) -> Setup:
    if getattr(args, "diffusers_config", None) and not args.model.startswith(DIFFUSERS_PREFIX):
        raise PulseError("give either --model or --diffusers-config, not both")
    if getattr(args, "pipeline", None):
        from pulse.data.pipeline_folder import read_pipeline

        read_pipeline(args.pipeline)  # one line naming what the folder lacks, before the model loads
    options = parse_options(args.model_option)
    spec = load_model(args.model, options).with_act_bytes(ACT_BYTES[args.precision])
    cluster = load_cluster(args.cluster)
    mb = getattr(args, "microbatch_size", 1)
    if args.costs:
        costs = load_costs(args.costs, spec)
        if costs.microbatch_size != mb:
            raise PulseError(f"{args.costs}: profiled at microbatch size {costs.microbatch_size}, "
                             f"but --microbatch-size is {mb}; re-profile or change it")
    else:
        costs = AnalyticProfiler(cluster.hardware).profile(spec, mb)
    return Setup(spec, cluster, costs, options)


def load_costs(path: str, spec: ModelSpec) -> CostTable:
    """``--costs``: a measured table, checked against the model it is to price."""
    costs = CostTable.load(path)
    costs.check_matches(spec)
    if costs.model != spec.name:  # same layer names, another model (or another variant of it)
        raise PulseError(f"{path}: profiled for model '{costs.model}', not '{spec.name}'; re-profile "
                         f"with `pulse profile --model {spec.name}`")
    return costs


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value is None or value < 1:
            raise PulseError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def unused_splits_note(spec: ModelSpec, placement: Placement, options: dict) -> str | None:
    """What to say where every block was split (``split_resnets=true`` / ``split_transformers=true``) but
    the placement cuts inside only some: the flags that keep those alone; None where nothing is to gain."""
    asked = [option for option in BLOCK_NAME_OPTIONS if options.get(option) is True]
    if not asked:
        return None
    split = {block_of(layer) for layer in spec.layers
             if SPLIT_OPTIONS.get(layer.kind) in asked and block_of(layer) != layer.name}
    cut = blocks_cut(spec, placement)
    used = sum(len(cut[option] or ()) for option in asked)
    if used == len(split):
        return None
    flags = " ".join(f"--model-option {pair}" for pair in option_pairs({o: cut[o] for o in asked}))
    return (f"the cuts fall inside {used} of the {len(split)} split blocks: {flags} keeps only those split, "
            "a launch a pass fewer for each of the others (`pulse tune` writes its winner so)")
