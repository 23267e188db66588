"""MindSpore weights into a diffusers pipeline folder: ``python -m pulse_mindspore.export --weights RUN --pipeline DIR --out NEW``.

::

    every rank, end of a run:  RUN/weights_rank<R>.npz (and ema_rank<R>.npz with --ema), keyed by
                               reference name = the diffusers name (``pulse_mindspore.train.save_shares``)
    merge_shares               the union over the ranks; a name two ranks hold (data-parallel
                               replicas) must be bitwise equal in both
    write_pipeline             DIR's other parts copied, unet/config.json copied, unet/
                               diffusion_pytorch_model.safetensors by safetensors.numpy.save_file, every
                               tensor in the dtype DIR stores it in; names and shapes must equal DIR's
                               exactly; atomic (``pulse.export_folder``)

``pulse train --backend mindspore --export NEW`` runs this on rank 0 after the
last step; the entry does the same from a finished run's folder (or one merged
``.npz``). No torch: ``DiffusionPipeline.from_pretrained(NEW)`` then loads it.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

from pulse.args.parser import OneLineParser
from pulse.args.tools import entry_main
from pulse.data.backbone_weights import WEIGHTS, backbone_weights
from pulse.data.pipeline_folder import PipelineFolder, read_pipeline
from pulse.errors import PulseError
from pulse.export_folder import check_backbone_tensors, check_new_folder, write_pipeline_folder

PROG = "pulse_mindspore.export"
SHARE = {False: "weights_rank", True: "ema_rank"}  # file stem per rank, before the rank number


def share_paths(run_dir: Path, ema: bool) -> list[Path]:
    paths = sorted(run_dir.glob(f"{SHARE[ema]}*.npz"))
    if not paths:
        hint = " (the run trained without --ema: export without --ema)" if ema and any(run_dir.glob("weights_rank*.npz")) else ""
        raise PulseError(f"--weights: no {SHARE[ema]}<R>.npz in {run_dir}{hint}")
    return paths


def merge_shares(paths: list[Path]) -> dict[str, np.ndarray]:
    """Every rank's share in one dict; replicas of a stage hold equal copies (checked bitwise)."""
    merged: dict[str, np.ndarray] = {}
    for path in paths:
        with np.load(path) as data:
            for key in data.files:
                value = data[key]
                if key in merged and not np.array_equal(merged[key], value):
                    raise PulseError(f"{path}: '{key}' differs from another rank's copy: data-parallel "
                                     "replicas should hold equal weights")
                merged[key] = value
    return merged


def load_weights(path: Path, ema: bool) -> dict[str, np.ndarray]:
    """A run folder's rank shares, merged, or one merged ``.npz`` (``final_weights.npz``)."""
    if path.is_dir():
        return merge_shares(share_paths(path, ema))
    if path.suffix == ".npz" and path.is_file():
        return merge_shares([path])
    raise PulseError(f"--weights: '{path}' is neither a run folder nor an .npz file")


def check_state(folder: PipelineFolder, state: Mapping[str, np.ndarray]) -> dict[str, type]:
    """``state`` holds exactly the backbone's tensors with their shapes; the dtype each is stored in."""
    entries = backbone_weights(folder.backbone)
    if entries is None:  # a config-only backbone: the training dtype is as good as any
        return {k: np.float32 for k in state}
    check_backbone_tensors({k: e.shape for k, e in entries.items()}, {k: v.shape for k, v in state.items()},
                           "the weights", folder.backbone)
    from pulse_mindspore.diffusers_weights import NUMPY_DTYPES

    return {k: NUMPY_DTYPES.get(e.dtype, np.float32) for k, e in entries.items()}


def write_pipeline(folder: PipelineFolder, state: Mapping[str, np.ndarray], out: Path) -> int:
    """``out``: ``folder`` with its backbone's weights replaced by ``state``; the parameter count."""
    from safetensors.numpy import save_file

    dtypes = check_state(folder, state)

    def write_backbone(where: Path) -> None:
        where.mkdir()
        shutil.copy2(folder.backbone / "config.json", where / "config.json")
        tensors = {k: np.ascontiguousarray(np.asarray(v).astype(dtypes[k], copy=False)) for k, v in state.items()}
        save_file(tensors, str(where / WEIGHTS), metadata={"format": "pt"})  # diffusers' own files say "pt"

    write_pipeline_folder(folder, out, write_backbone)
    return sum(int(np.asarray(v).size) for v in state.values())


def export_weights(pipeline: str | Path, state: Mapping[str, np.ndarray], out: Path, what: str) -> str:
    """Write the pipeline folder; the line that says so."""
    folder = read_pipeline(pipeline)
    count = write_pipeline(folder, state, out)
    return (f"wrote {out}: {folder.backbone_name}/ from {what} ({count:,} parameters), "
            f"the other parts from {folder.root}")


def export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_new_folder(out)
    read_pipeline(args.pipeline)  # a bad pipeline is said before any weight is read
    state = load_weights(Path(args.weights), args.ema)
    what = f"{args.weights} ({'EMA weights' if args.ema else 'weights'})"
    print(f"{PROG}: {export_weights(args.pipeline, state, out, what)}", flush=True)
    return 0


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, allow_abbrev=False,
                           description="write a diffusers pipeline folder with MindSpore-trained UNet weights")
    parser.add_argument("--weights", required=True,
                        help="a `pulse train --backend mindspore` run folder (its weights_rank<R>.npz) or a merged .npz")
    parser.add_argument("--pipeline", required=True, help="the pipeline folder the run's UNet came from")
    parser.add_argument("--out", required=True, help="the new pipeline folder (must not exist)")
    parser.add_argument("--ema", action="store_true", help="the moving averages (ema_rank<R>.npz) of a run with --ema")
    return parser


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, build_parser(), export, argv)


if __name__ == "__main__":
    sys.exit(main())
