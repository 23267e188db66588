"""A trained backbone written as diffusers' files, tensor by tensor: what ``pulse export`` puts in ``unet/``.

::

    the pipeline's backbone folder ─ config.json ─ Class.from_config on the meta device: the parameter
                                     names and shapes (no weight made), its persistent buffers
                                   ─ its safetensors headers: the dtype each tensor is stored in
    StepWeights (mmap'd rank files) ─ names and shapes checked against the model's (check_backbone_tensors)
        ─ each tensor cast to its stored dtype, written, dropped ─ pulse.backbone_shards (diffusers' names,
          index when sharded); buffers (none in SD's UNet) copied from the folder's own files
    config.json copied as it is (diffusers wrote it)

The exporting process holds one tensor at a time and a window of a mapped
rank file (``pulse_torch.step_weights``), never the model.
"""
from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from pulse.backbone_shards import DEFAULT_MAX_SHARD_BYTES, Shard, TensorInfo, write_backbone_weights
from pulse.data.backbone_weights import Entry, backbone_weights
from pulse.data.pipeline_folder import PipelineError, PipelineFolder
from pulse.errors import PulseError
from pulse.export_folder import check_backbone_tensors
from pulse_torch.step_weights import shapes_of

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class BackboneLayout:
    """What the pipeline's backbone holds, learnt without making a weight."""

    parameters: dict[str, tuple[int, ...]]  # the model's, from its config (meta device)
    buffers: dict[str, tuple[int, ...]]  # persistent buffers: not trained, copied from the folder's files
    stored: dict[str, Entry] | None  # the folder's own tensors (file, dtype, shape); None: a config only

    def dtype(self, name: str) -> str:
        """The safetensors dtype ``name`` is stored in: the folder's own; float32 for a config-only folder."""
        entry = (self.stored or {}).get(name)
        return entry.dtype if entry is not None else "F32"


def backbone_class(folder: PipelineFolder) -> type:
    """The backbone's class, as ``model_index.json`` names it (diffusers)."""
    entry = folder.index.get(folder.backbone_name)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
        raise PipelineError(f"{folder.root}/model_index.json: '{folder.backbone_name}' should be "
                            f"[\"diffusers\", class], got {entry!r}")
    try:
        return getattr(importlib.import_module("diffusers"), str(entry[1]))
    except AttributeError:
        raise PipelineError(f"{folder.root}: '{folder.backbone_name}' needs diffusers.{entry[1]}, which this "
                            "diffusers lacks") from None


def backbone_layout(folder: PipelineFolder) -> BackboneLayout:
    """The backbone's parameters and buffers by name and shape (built on the meta device: no memory), and
    the folder's stored tensors."""
    cls = backbone_class(folder)
    try:
        with torch.device("meta"):
            model = cls.from_config(cls.load_config(str(folder.backbone)))
    except Exception as exc:  # noqa: BLE001 - a damaged config fails deep inside diffusers, in any type
        reason = " ".join(str(exc).split())[:200]
        raise PipelineError(f"{folder.backbone}: cannot build {cls.__name__} from its config.json ({reason})") \
            from None
    parameters = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in parameters}
    return BackboneLayout(parameters, buffers, backbone_weights(folder.backbone))


def refuse_adapters(weights: Mapping[str, Tensor], where: Path, error: type[PulseError]) -> None:
    if any(".lora_A." in n for n in weights):  # adapters only: the base was frozen and never saved
        raise error(f"{where}: a LoRA run's checkpoint (adapters only): `pulse train --lora-rank R "
                    "--export DIR` writes its pytorch_lora_weights.safetensors")


def tensor_infos(layout: BackboneLayout, weights: Mapping[str, Tensor], where: Path, folder: PipelineFolder,
                 error: type[PulseError]) -> list[TensorInfo]:
    """What the backbone's files will hold, in the checkpoint's order (rank file by rank file), buffers last;
    the trained names and shapes must be exactly the model's."""
    refuse_adapters(weights, where, error)
    shapes = shapes_of(weights)
    check_backbone_tensors(layout.parameters, shapes, str(where), folder.backbone, error)
    if layout.buffers and layout.stored is None:
        raise error(f"{folder.backbone}: a config only, and the model keeps buffers "
                    f"('{next(iter(layout.buffers))}') that only its saved weights hold")
    missing = [n for n in layout.buffers if n not in (layout.stored or {})]
    if missing:
        raise error(f"{folder.backbone}: its weights lack the buffer '{missing[0]}'")
    unknown = sorted({layout.dtype(n) for n in [*shapes, *layout.buffers]} - set(TORCH_DTYPES))
    if unknown:
        raise error(f"{folder.backbone}: stores tensors as {unknown[0]}, which export does not write")
    return [TensorInfo(n, layout.dtype(n), shapes[n]) for n in shapes] + \
        [TensorInfo(n, layout.dtype(n), shape) for n, shape in layout.buffers.items()]


def stored_bytes(tensor: Tensor, info: TensorInfo) -> np.ndarray:
    """``tensor`` in its stored dtype as flat bytes (a view when it already is that dtype: nothing copied)."""
    cast = tensor.detach().to(device="cpu", dtype=TORCH_DTYPES[info.dtype]).contiguous()
    return cast.reshape(-1).view(torch.uint8).numpy()


class BufferReader:
    """The folder's own buffers, one at a time from its safetensors files."""

    def __init__(self, layout: BackboneLayout) -> None:
        self.stored = layout.stored or {}

    def __call__(self, name: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self.stored[name].file), framework="pt") as f:
            return f.get_tensor(name)


def write_backbone(target: Path, folder: PipelineFolder, weights: Mapping[str, Tensor], infos: list[TensorInfo],
                   layout: BackboneLayout, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Shard]:
    """``target`` (a new folder): the backbone's config.json copied, its weights from ``weights`` (buffers
    from the folder's own files) in diffusers' (sharded) safetensors files; the shards written."""
    target.mkdir()
    shutil.copy2(folder.backbone / "config.json", target / "config.json")
    buffers = BufferReader(layout)

    def data(info: TensorInfo) -> Any:
        source = buffers(info.name) if info.name in layout.buffers else weights[info.name]
        return stored_bytes(source, info)

    return write_backbone_weights(target, infos, data, max_shard_bytes)
