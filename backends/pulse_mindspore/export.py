"""MindSpore weights into a diffusers pipeline folder: ``python -m pulse_mindspore.export --weights RUN --pipeline DIR --out NEW``.

::

    every rank, end of a run:  RUN/weights_rank<R>.npz (and ema_rank<R>.npz with --ema), keyed by
                               reference name = the diffusers name (``pulse_mindspore.train.save_shares``)
    merge_shares               ShareArrays: the union over the ranks, read array by array on access
                               (names and shapes from the .npy headers); a name two ranks hold
                               (data-parallel replicas) must be bitwise equal in both (compared a pair
                               at a time)
    write_pipeline             DIR's other parts copied, unet/config.json copied, unet/ weights as
                               diffusers' (sharded) safetensors, tensor by tensor (pulse.backbone_shards),
                               every tensor in the dtype DIR stores it in; names and shapes must equal
                               DIR's exactly; atomic (``pulse.export_folder``)

``pulse train --backend mindspore --export NEW`` runs this on rank 0 after the
last step; the entry does the same from a finished run's folder (or one merged
``.npz``). No torch: ``DiffusionPipeline.from_pretrained(NEW)`` then loads it.
The exporting worker holds one array (and a replica's copy to compare) at a
time, never the model.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from pulse.args.parser import OneLineParser
from pulse.args.tools import entry_main
from pulse.backbone_shards import DEFAULT_MAX_SHARD_BYTES, TensorInfo, write_backbone_weights
from pulse.data.backbone_weights import backbone_weights
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


def npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every array of an ``.npz`` by key and shape, from the .npy headers alone (no array read)."""
    out: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, _ = read(f)
                out[member[:-len(".npy")] if member.endswith(".npy") else member] = tuple(shape)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise PulseError(f"{path}: not a readable .npz file ({' '.join(str(exc).split())[:160]})") from None
    return out


class ShareArrays(Mapping[str, np.ndarray]):
    """Every rank's share by reference name, each array read from its file when asked for (never merged).

    Names two files hold (data-parallel replicas) are compared when the shares are opened, one pair of
    arrays at a time: they must be bitwise equal.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, Path] = {}
        copies: dict[str, list[Path]] = {}
        for path in paths:
            for key, shape in npz_shapes(path).items():
                self.shapes.setdefault(key, shape)
                self.file_of.setdefault(key, path)
                copies.setdefault(key, []).append(path)
        for key, files in copies.items():
            for path in files[1:]:
                value = self._read(path, key)
                if value.shape != self.shapes[key] or not np.array_equal(self._read(files[0], key), value):
                    raise PulseError(f"{path}: '{key}' differs from another rank's copy: data-parallel "
                                     "replicas should hold equal weights")

    @staticmethod
    def _read(path: Path, key: str) -> np.ndarray:
        with np.load(path, allow_pickle=False) as data:
            return data[key]

    def __getitem__(self, key: str) -> np.ndarray:
        return self._read(self.file_of[key], key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def merge_shares(paths: list[Path]) -> ShareArrays:
    """Every rank's share as one mapping, read on access; replicas of a stage hold equal copies (checked bitwise)."""
    return ShareArrays(paths)


def load_weights(path: Path, ema: bool) -> ShareArrays:
    """A run folder's rank shares, merged, or one merged ``.npz`` (``final_weights.npz``)."""
    if path.is_dir():
        return merge_shares(share_paths(path, ema))
    if path.suffix == ".npz" and path.is_file():
        return merge_shares([path])
    raise PulseError(f"--weights: '{path}' is neither a run folder nor an .npz file")


def shapes_of(state: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Each array's shape, without reading a ``ShareArrays``' arrays."""
    return dict(state.shapes) if isinstance(state, ShareArrays) else {k: np.shape(v) for k, v in state.items()}


def check_state(folder: PipelineFolder, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """``shapes`` are exactly the backbone's tensors'; the (safetensors) dtype each is stored in."""
    entries = backbone_weights(folder.backbone)
    if entries is None:  # a config-only backbone: the training dtype is as good as any
        return {k: "F32" for k in shapes}
    check_backbone_tensors({k: e.shape for k, e in entries.items()}, shapes, "the weights", folder.backbone)
    from pulse_mindspore.diffusers_weights import NUMPY_DTYPES

    return {k: e.dtype if e.dtype in NUMPY_DTYPES else "F32" for k, e in entries.items()}


def write_pipeline(folder: PipelineFolder, state: Mapping[str, np.ndarray], out: Path,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> int:
    """``out``: ``folder`` with its backbone's weights replaced by ``state`` (written array by array, in
    diffusers' sharded safetensors when over ``max_shard_bytes``); the parameter count."""
    from pulse_mindspore.diffusers_weights import NUMPY_DTYPES

    shapes = shapes_of(state)
    dtypes = check_state(folder, shapes)
    infos = [TensorInfo(k, dtypes[k], tuple(shape)) for k, shape in shapes.items()]

    def stored(info: TensorInfo) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(state[info.name]).astype(NUMPY_DTYPES[info.dtype], copy=False))

    def write_backbone(where: Path) -> None:
        where.mkdir()
        shutil.copy2(folder.backbone / "config.json", where / "config.json")
        write_backbone_weights(where, infos, stored, max_shard_bytes)

    write_pipeline_folder(folder, out, write_backbone)
    return sum(int(np.prod(shape)) for shape in shapes.values())


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
