"""``python -m pulse_torch.export --checkpoint STEP_DIR --pipeline DIR --out DIR`` (what `pulse export` runs).

::

    STEP_DIR (complete: manifest + every rank file, hashes checked) ─ StepWeights: the rank files mapped
             (mmap), {model's name: tensor} read on access, never merged (pulse_torch.step_weights)
    DIR/model_index.json, unet/ (or transformer/) ─ Class.from_config on the meta device: names and shapes
             to check the checkpoint's against (exactly); the safetensors headers: each tensor's dtype
    OUT (written as .OUT.tmp-<pid>, renamed when whole): every other part of DIR copied as it is,
        unet/config.json copied, the trained weights streamed tensor by tensor, cast to the dtype DIR
        stores each in, into diffusers' (sharded) safetensors files (pulse_torch.backbone_files)

``DiffusionPipeline.from_pretrained(OUT)`` then loads the fine-tuned pipeline.
The exporting process never holds the model: one tensor, and a window of one
mapped rank file. A checkpoint of a zoo model (not ``--diffusers-config``), of
another architecture, or an incomplete step is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from pulse.args.parser import OneLineParser
from pulse.args.tools import add_export_arguments, entry_main
from pulse.backbone_shards import DEFAULT_MAX_SHARD_BYTES, Shard
from pulse.export_folder import check_backbone_tensors, write_pipeline_folder
from pulse.train.checkpoints import CheckpointError, check_step, find_latest
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse_torch.backbone_files import backbone_layout, refuse_adapters, tensor_infos, write_backbone
from pulse_torch.pipeline.encode import load_component, quiet
from pulse_torch.step_weights import StepWeights, shapes_of, step_weights
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


def load_trained(folder: PipelineFolder, weights: Mapping[str, torch.Tensor], where: Path) -> torch.nn.Module:
    """The pipeline's backbone with every parameter replaced by the checkpoint's (names and shapes exact),
    copied one by one (a ``StepWeights`` reads each as it is copied: the model is the only copy held)."""
    refuse_adapters(weights, where, CheckpointError)
    model = load_component(folder, folder.backbone_name, folder.backbone)
    params = dict(model.named_parameters())
    check_backbone_tensors({n: tuple(p.shape) for n, p in params.items()}, shapes_of(weights), str(where),
                           folder.backbone, CheckpointError)
    for name, p in params.items():
        with torch.no_grad():
            p.copy_(weights[name])  # cast to the pipeline's dtype if it differs from the training one
    return model


def write_pipeline(folder: PipelineFolder, model: torch.nn.Module, out: Path) -> None:
    """``out`` with a model held whole (a LoRA run's fused backbone): the other parts copied, the backbone
    saved; built beside it and renamed, never half-written."""
    write_pipeline_folder(folder, out, lambda where: model.save_pretrained(str(where), safe_serialization=True))


def trained_weights(where: Path, step: int, ema: bool, manifest: Mapping[str, Any] | None = None) -> StepWeights:
    """The step's weights, or their moving averages (``ema``), read on access from the mapped rank files."""
    return step_weights(where, step, ema, manifest)


def export_step(folder: PipelineFolder, step: int, where: Path, out: Path, ema: bool = False,
                manifest: Mapping[str, Any] | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write ``out``: ``folder`` with the backbone of the complete checkpoint ``where``, streamed (see the
    module doc); the line that says so. ``manifest``: ``where``'s, already checked."""
    quiet()
    weights = trained_weights(where, step, ema, manifest)
    layout = backbone_layout(folder)
    infos = tensor_infos(layout, weights, where, folder, CheckpointError)  # every refusal before a byte is written
    shards: list[Shard] = []

    def fill(target: Path) -> None:
        shards.extend(write_backbone(target, folder, weights, infos, layout, max_shard_bytes))

    write_pipeline_folder(folder, out, fill)
    weights.release()
    which = "EMA weights" if ema else "weights"
    files = f", {len(shards)} shards" if len(shards) > 1 else ""
    return (f"wrote {out}: {folder.backbone_name}/ from {where} (step {step}, {weights.numel():,} parameters, "
            f"{which}{files}), the other parts from {folder.root}")


def export(args: argparse.Namespace) -> int:
    folder = read_pipeline(args.pipeline)
    step, where, manifest = find_step(Path(args.checkpoint))
    check_model(manifest, where, folder)
    print(f"{PROG}: {export_step(folder, step, where, Path(args.out), args.ema, manifest)}", flush=True)
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
