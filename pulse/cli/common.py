"""Arguments and loaders shared by the `pulse` subcommands."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster, load_cluster
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "sd2-unet") -> None:
    parser.add_argument("--model", default=default_model,
                        help="zoo name (sd2-unet, sd2-unet-768, uvit, hunyuan-dit, tiny-*) or a spec YAML path")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                        help="zoo builder option, e.g. resolution=768 (repeatable)")
    parser.add_argument("--hardware", "--cluster", dest="cluster", default="ascend-910a",
                        help="hardware name (one node) or cluster name/YAML from configs/")
    parser.add_argument("--costs", default=None,
                        help="a measured cost table (YAML/JSON) instead of the analytic model")
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="activation precision for byte counts (default fp16)")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=4, help="pipeline devices")
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--folds", type=int, default=1, help="1 = V placement, k > 1 = wave with k folds")
    parser.add_argument("--strict", action="store_true",
                        help="refuse models whose skips cross instead of sending crossing skips directly")
    parser.add_argument("--partition-objective", choices=("time", "balance"), default="time",
                        help="time: the V's cuts priced on the cluster's links too (a slow link moves them to "
                             "small tensors); balance: compute balance alone, bytes within 2%% of it")


class _DiffusersModel(argparse.Action):
    """``--diffusers-config PATH`` sets the model to ``diffusers:<absolute folder>``, the name plans record.

    The folder, not its config.json: it also holds the weights a training rank loads.
    """

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        if getattr(namespace, "model", None) not in (None, parser.get_default("model")):
            parser.error("give either --model or --diffusers-config, not both")
        setattr(namespace, self.dest, values)
        path = Path(values).expanduser().resolve()
        namespace.model = DIFFUSERS_PREFIX + str(path.parent if path.name == "config.json" else path)


def add_diffusers_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--diffusers-config", action=_DiffusersModel, default=None, metavar="PATH",
                        help="plan a diffusers UNet2DConditionModel or HunyuanDiT2DModel from its local model "
                             "folder or config.json (options: resolution, context_len, split_blocks, name)")


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PulseError(f"--model-option expects KEY=VALUE, got '{pair}'")
        options[key] = _number_or_text(value)
    return options


def _number_or_text(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def load_model(name: str, options: dict | None = None) -> ModelSpec:
    """A zoo entry, a spec file, or a diffusers model (``diffusers:PATH``, its folder or config.json)."""
    from pulse.zoo import get_spec
    from pulse.zoo.diffusers_config import is_diffusers_model, spec_from_path

    if is_diffusers_model(name):  # read with json here: the core never imports diffusers
        return spec_from_path(name, **(options or {}))
    return get_spec(name, **(options or {}))


@dataclass(frozen=True)
class Setup:
    spec: ModelSpec
    cluster: Cluster
    costs: CostTable
    model_options: dict


ACT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def load_setup(args: argparse.Namespace) -> Setup:
    if getattr(args, "diffusers_config", None) and not args.model.startswith(DIFFUSERS_PREFIX):
        raise PulseError("give either --model or --diffusers-config, not both")
    options = parse_options(args.model_option)
    spec = load_model(args.model, options).with_act_bytes(ACT_BYTES[args.precision])
    cluster = load_cluster(args.cluster)
    mb = getattr(args, "microbatch_size", 1)
    if args.costs:
        costs = CostTable.load(args.costs)
        costs.check_matches(spec)
        if costs.microbatch_size != mb:
            raise PulseError(f"{args.costs}: profiled at microbatch size {costs.microbatch_size}, "
                             f"but --microbatch-size is {mb}; re-profile or change it")
    else:
        costs = AnalyticProfiler(cluster.hardware).profile(spec, mb)
    return Setup(spec, cluster, costs, options)


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value is None or value < 1:
            raise PulseError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
