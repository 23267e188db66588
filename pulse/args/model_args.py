"""Which model a command plans: ``--diffusers-config``, ``--pipeline`` and ``--model-option KEY=VALUE``.

Shared by `pulse` and the profile/train entries PyTorch and MindSpore run, so a model
is named the same way in the parent and in its workers.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pulse.errors import PulseError
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX


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
                             "folder or config.json (options: resolution, context_len, split_resnets, "
                             "split_transformers, split_blocks, name)")
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


def option_pairs(options: dict) -> list[str]:
    """``parse_options``' inverse: a plan's model options as ``--model-option`` pairs (a list comma-joined)."""
    def text(value) -> str:
        if isinstance(value, (list, tuple)):
            return ",".join(map(text, value))
        return str(value).lower() if isinstance(value, bool) else str(value)

    return [f"{k}={text(v)}" for k, v in options.items()]


def _number_or_text(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)
