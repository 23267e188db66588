"""Arguments and loaders shared by the `pulse` subcommands."""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

from pulse.atomic_io import check_target
from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster, load_cluster
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.progress import fmt_bytes  # noqa: F401  (the commands print sizes with it)
from pulse.zoo.loading import load_model


# -- argument parsing: one line per bad value, exit 2 ------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that says a bad argument in one line (no usage block), exit code 2,
    and never expands abbreviations (``--plan`` must not be read as ``--plan-only``).

    Sub-parsers made with ``add_subparsers`` are of the parent's class, so the rule holds for
    every command.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (--[\w-]+)(?:/\S+)?: must ", r"\1 must ", message)  # "--pp must be >= 1"
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


MAX_COUNT = 100_000  # degrees, microbatches, sizes: more than any job, small enough to plan in memory
MAX_SEED = 2**32 - 1  # numpy's seed range; torch's is wider


def _number(text: str, cast: Callable[[str], float | int], kind: str) -> float | int:
    try:
        return cast(text.strip())
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected {kind}, got '{text[:60]}'") from None


def int_between(low: int, high: int) -> Callable[[str], int]:
    """``type=``: a whole number in [low, high] (bounded, so nothing downstream grows without limit)."""

    def parse(text: str) -> int:
        value = _number(text, int, "a whole number")
        if not low <= value <= high:
            bound = f">= {low}" if value < low else f"<= {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text[:60]}")
        return int(value)

    parse.__name__ = f"int in [{low}, {high}]"  # argparse names the type in its messages
    return parse


positive_int = int_between(1, MAX_COUNT)
non_negative_int = int_between(0, MAX_COUNT)
seed_int = int_between(0, MAX_SEED)


def float_between(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """``type=``: a finite number in [low, high] ((low, high] with ``low_open``); NaN and inf refused."""

    def parse(text: str) -> float:
        value = float(_number(text, float, "a number"))
        inside = (low < value if low_open else low <= value) and value <= high
        if not math.isfinite(value) or not inside:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be a finite number in {bracket}{low:.10g}, {high:.10g}], "
                                             f"got {text[:60]}")
        return value

    parse.__name__ = "number"
    return parse


finite_positive_float = float_between(0.0, 1e300, low_open=True)
finite_non_negative_float = float_between(0.0, 1e300)
seconds_float = float_between(0.1, 7 * 24 * 3600.0)  # a wait: not instant, not forever (timedelta overflows)
learning_rate = float_between(0.0, 1e6, low_open=True)
memory_gib = float_between(0.0, 2.0**20, low_open=True)  # up to a PiB per device


def int_list(text: str) -> str:
    """``type=``: comma-separated whole numbers >= 1 (``1,2,4``), empty items refused; returned as
    normalised text (the commands split it where they use it)."""
    items = text.split(",")
    if not text.strip() or any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like 1,2,4, got '{text[:60]}'")
    return ",".join(str(positive_int(item)) for item in items)


def output_file(text: str) -> str:
    """``type=``: a file to write: a regular file or nothing yet (never a device, pipe, socket or link),
    in a folder that exists (``pulse.atomic_io``'s rule, said before any work)."""
    path = Path(text)
    try:
        if not text or path.is_dir() or text.endswith(("/", "\\")):
            raise argparse.ArgumentTypeError(f"'{text[:120]}' is a directory; name a file to write")
        _check_parents(text, path.parents)
        check_target(path)
    except PulseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OSError as exc:  # a name too long for the filesystem, ...
        raise argparse.ArgumentTypeError(f"cannot write '{text[:120]}': {exc.strerror}") from None
    return text


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def image_file(text: str) -> str:
    """``type=``: a picture to write; its suffix says the format (matplotlib's)."""
    if not text.lower().endswith(IMAGE_SUFFIXES):
        raise argparse.ArgumentTypeError(f"'{text[:120]}': name a picture ending in {', '.join(IMAGE_SUFFIXES)}")
    return output_file(text)


def output_dir(text: str) -> str:
    """``type=``: a directory to write into (it may not exist yet, but must not be a file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    path = Path(text)
    try:
        _check_parents(text, [path, *path.parents])
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write into '{text[:120]}': {exc.strerror}") from None
    return text


def _check_parents(text: str, folders) -> None:
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise argparse.ArgumentTypeError(f"'{text[:120]}': '{str(folder)[:120]}' is a file, not a directory")


def host_address(text: str) -> str:
    """``type=``: an IP address (v4 or v6) a store can listen on; names are refused (they may resolve
    to an address on every interface)."""
    import ipaddress

    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address of this machine such as 127.0.0.1 or "
                                         f"10.0.0.5, got '{text[:60]}'") from None
    if address.is_unspecified or address.is_multicast:
        raise argparse.ArgumentTypeError(f"{address} is not one interface's address (every interface is what "
                                         "this avoids); name the address the other nodes reach node 0 at")
    return str(address)


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def path_safe_name(name: str) -> str:
    """``name`` as one file-name component: no separators, no ``..``, nothing absolute.

    Model names come from spec files users hand in; a run directory is named after them and
    must stay inside ``runs/``.
    """
    safe = _UNSAFE.sub("_", name).strip("._") or "model"
    return safe[:100]


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "sd2-unet") -> None:
    parser.add_argument("--model", default=default_model,
                        help="zoo name (sd2-unet, sd2-unet-768, uvit, hunyuan-dit, tiny-*) or a spec YAML path")
    add_diffusers_argument(parser)
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                        help="zoo builder option, e.g. resolution=768 (repeatable)")
    parser.add_argument("--hardware", "--cluster", dest="cluster", default=DEFAULT_CLUSTER,
                        help="hardware name (one node) or cluster name/YAML from configs/")
    parser.add_argument("--costs", default=None,
                        help="a measured cost table (YAML/JSON) instead of the analytic model")
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="activation precision for byte counts (default fp16)")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=positive_int, default=4, help="pipeline devices")
    parser.add_argument("--microbatch-size", type=positive_int, default=1)
    parser.add_argument("--folds", type=positive_int, default=1, help="1 = V placement, k > 1 = wave with k folds")
    parser.add_argument("--strict", action="store_true",
                        help="refuse models whose skips cross instead of sending crossing skips directly")
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


def recompute_chunks(choice: str | None, num_chunks: int, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The chunks ``--recompute`` names on a placement of ``num_chunks`` (None: ``default``)."""
    if choice is None:
        return default
    if choice in ("all", "none"):
        return tuple(range(num_chunks)) if choice == "all" else ()
    chunks = tuple(sorted({int(c) for c in choice.split(",")}))
    if chunks[-1] >= num_chunks:
        raise PulseError(f"--recompute names chunk {chunks[-1]}, but the placement has chunks 0..{num_chunks - 1}")
    return chunks


def memory_model(recompute: tuple[int, ...]) -> MemoryModel:
    """The simulator's memory model with these chunks recomputing (static bytes: its defaults)."""
    return MemoryModel(recompute=frozenset(recompute))


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


class _PipelineModel(argparse.Action):
    """``--pipeline DIR`` plans (and trains) the pipeline's backbone, ``diffusers:DIR/unet`` (or transformer/).

    The folder itself is checked when the command runs (``pulse.data.pipeline_folder.read_pipeline``:
    one line naming what is missing); here only its backbone is found.
    """

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        if getattr(namespace, "model", None) not in (None, parser.get_default("model")):
            parser.error("give either --model, --diffusers-config or --pipeline, not two of them")
        root = Path(values).expanduser().resolve()
        setattr(namespace, self.dest, str(root))
        try:
            backbone = next((root / b for b in ("unet", "transformer") if (root / b / "config.json").is_file()), None)
        except OSError as exc:  # e.g. a name too long for the file system
            parser.error(f"--pipeline: cannot read '{values[:80]}': {exc.strerror}")
        namespace.model = DIFFUSERS_PREFIX + str(backbone or root / "unet")


def add_diffusers_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--diffusers-config", action=_DiffusersModel, default=None, metavar="PATH",
                        help="plan a diffusers UNet2DConditionModel or HunyuanDiT2DModel from its local model "
                             "folder or config.json (options: resolution, context_len, split_blocks, name)")
    parser.add_argument("--pipeline", action=_PipelineModel, default=None, metavar="DIR",
                        help="a local diffusers pipeline folder (model_index.json): its unet/ or transformer/ "
                             "is the model, trained from its weights with its scheduler's noise schedule")


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
        costs = CostTable.load(args.costs)
        costs.check_matches(spec)
        if costs.model != spec.name:  # same layer names, another model (or another variant of it)
            raise PulseError(f"{args.costs}: profiled for model '{costs.model}', not '{spec.name}'; re-profile "
                             f"with `pulse profile --model {spec.name}`")
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


