"""``python -m pulse_torch.export --checkpoint STEP_DIR --pipeline DIR --out DIR`` (what `pulse export` runs).

::

    STEP_DIR (complete: manifest + every rank file, hashes checked) ─ merge_weights ─ {model's name: tensor}
    DIR/model_index.json, unet/ (or transformer/) ─ Class.from_pretrained ─ parameters replaced by the
                                                   checkpoint's (names and shapes must match exactly)
    OUT (written as .OUT.tmp-<pid>, renamed when whole): every other part of DIR copied as it is,
        the trained backbone by save_pretrained (safetensors, in the pipeline's own dtype)

``DiffusionPipeline.from_pretrained(OUT)`` then loads the fine-tuned pipeline.
A checkpoint of a zoo model (not ``--diffusers-config``), of another
architecture, or an incomplete step is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from pulse.args.parser import OneLineParser
from pulse.args.tools import add_export_arguments, entry_main
from pulse.export_folder import check_backbone_tensors, write_pipeline_folder
from pulse.train.checkpoints import CheckpointError, check_step, find_latest
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse_torch.checkpoint import merge_weights
from pulse_torch.pipeline.encode import load_component, quiet
from pulse.data.pipeline_folder import PipelineFolder, config_hash, read_pipeline

PROG = "pulse export"


def find_step(path: Path) -> tuple[int, Path, dict]:
    """(step, folder, manifest) of a complete step folder, or of the newest complete one under ``path``."""
    if not path.is_dir():
        raise CheckpointError(f"--checkpoint: no folder '{path}'")
    match = re.match(r"^step-(\d+)$", path.name)
    if match:
        try:
            return int(match.group(1)), path, check_step(path, int(match.group(1)))
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: not a complete checkpoint: {exc}") from None
    found, skipped = find_latest(path)
    if found is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"{path}: no complete step-<k>/ checkpoint there{why}")
    return found.step, found.path, found.manifest


def check_model(manifest: dict, where: Path, folder: PipelineFolder) -> None:
    """The checkpoint trained a diffusers model with this pipeline backbone's config (when its folder still exists)."""
    model = str(manifest.get("identity", {}).get("model") or manifest.get("model") or "")
    if not model.startswith(DIFFUSERS_PREFIX):
        raise CheckpointError(f"{where}: trained model '{model or '?'}', not a diffusers model: export needs a run "
                              f"of `pulse train --diffusers-config {folder.backbone}`")
    trained = Path(model[len(DIFFUSERS_PREFIX):])
    if (trained / "config.json").is_file() and config_hash(trained) != config_hash(folder.backbone):
        raise CheckpointError(f"{where}: trained {trained}, whose config differs from {folder.backbone}/config.json: "
                              "export into the pipeline the run's model came from")


def load_trained(folder: PipelineFolder, weights: dict[str, torch.Tensor], where: Path) -> torch.nn.Module:
    """The pipeline's backbone with every parameter replaced by the checkpoint's (names and shapes exact)."""
    if any(".lora_A." in n for n in weights):  # adapters only: the base was frozen and never saved
        raise CheckpointError(f"{where}: a LoRA run's checkpoint (adapters only): `pulse train --lora-rank R "
                              "--export DIR` writes its pytorch_lora_weights.safetensors")
    model = load_component(folder, folder.backbone_name, folder.backbone)
    params = dict(model.named_parameters())
    check_backbone_tensors({n: tuple(p.shape) for n, p in params.items()},
                           {n: tuple(w.shape) for n, w in weights.items()}, str(where), folder.backbone,
                           CheckpointError)
    for name, p in params.items():
        with torch.no_grad():
            p.copy_(weights[name])  # cast to the pipeline's dtype if it differs from the training one
    return model


def write_pipeline(folder: PipelineFolder, model: torch.nn.Module, out: Path) -> None:
    """``out``: the other parts copied, the backbone saved; built beside it and renamed, never half-written."""
    write_pipeline_folder(folder, out, lambda where: model.save_pretrained(str(where), safe_serialization=True))


def trained_weights(where: Path, step: int, ema: bool) -> dict[str, torch.Tensor]:
    """The step's merged weights, or their moving averages (``ema``)."""
    try:
        return merge_weights(where, step, ema=ema)
    except KeyError:
        raise CheckpointError(f"{where}: holds no EMA weights (the run trained without --ema): export without "
                              "--ema") from None


def export_step(folder: PipelineFolder, step: int, where: Path, out: Path, ema: bool = False) -> str:
    """Write ``out``: ``folder`` with the backbone of the complete checkpoint ``where``; the line that says so."""
    quiet()
    model = load_trained(folder, trained_weights(where, step, ema), where)
    write_pipeline(folder, model, out)
    count = sum(p.numel() for p in model.parameters())
    which = "EMA weights" if ema else "weights"
    return (f"wrote {out}: {folder.backbone_name}/ from {where} (step {step}, {count:,} parameters, {which}), "
            f"the other parts from {folder.root}")


def export(args: argparse.Namespace) -> int:
    folder = read_pipeline(args.pipeline)
    step, where, manifest = find_step(Path(args.checkpoint))
    check_model(manifest, where, folder)
    print(f"{PROG}: {export_step(folder, step, where, Path(args.out), args.ema)}", flush=True)
    return 0


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, allow_abbrev=False,
                           description="write a diffusers pipeline folder with a checkpoint's trained backbone")
    add_export_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, build_parser(), export, argv)


if __name__ == "__main__":
    sys.exit(main())
