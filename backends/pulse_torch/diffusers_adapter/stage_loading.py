"""A rank's share of a diffusers model: the model built without weights, only the rank's layers made real.

::

    skeleton(path)          Class.from_config under accelerate's init_empty_weights: every parameter on
                            the meta device (no bytes), buffers real (the model's forward reads them)
    from_diffusers(...)     the spec and one layer per spec layer, checked against the skeleton
    materialize(adapter, layers, device, ...)
        saved weights       each parameter of those layers read by its key from the folder's
                            safetensors (one file or a sharded ``*.index.json``; ``.bin`` through
                            ``torch.load(mmap=True)``): the other stages' tensors are never read
        config only         each layer's modules initialised as PyTorch initialises them
                            (``reset_parameters``), under the generator of ``layer_seed(seed, layer)``:
                            a run's initial weights do not depend on how pp and dp split it

The other layers' parameters stay on the meta device, on the host and the
device alike, so a rank holds its stage's bytes and no more. What a rank owns
is the plan's to say (``pulse.ownership.stage_layers``); this module only
makes those layers real.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping

import torch
from torch import Tensor, nn

from pulse.data.backbone_weights import Entry, read_header
from pulse.errors import SpecError
from pulse.layers.chunk_layout import layer_seed
from pulse.zoo.diffusers_config import PREFIX, config_path, read_config
from pulse_torch.diffusers_adapter.adapter import DiffusersAdapter, from_diffusers

SAFETENSORS = "diffusion_pytorch_model.safetensors"
BIN = "diffusion_pytorch_model.bin"

# Parameters no module's reset_parameters covers, and how diffusers' constructors draw them
# (HunyuanDiT2DModel: text_embedding_padding = randn; its attention pool's positional_embedding =
# randn / sqrt(embed_dim)). Any other such parameter is drawn from a standard normal.
_LOOSE_SCALE = {"positional_embedding": lambda p: p.shape[-1] ** -0.5}


def import_libraries(path: str) -> None:
    """Import what building the model at ``path`` needs (diffusers, its model class, accelerate, peft), so
    that a measurement started afterwards counts the stage and not the libraries (~130 MiB resident)."""
    import accelerate  # noqa: F401

    from pulse_torch.diffusers_adapter.loading import _model_class

    path = str(path)[len(PREFIX):] if str(path).startswith(PREFIX) else str(path)
    _model_class(str(read_config(path)["_class_name"]))
    try:
        import peft  # noqa: F401
    except ImportError:
        pass


def skeleton(path: str) -> nn.Module:
    """The diffusers model at ``path`` with every parameter on the meta device and its buffers real."""
    from accelerate import init_empty_weights

    from pulse_torch.diffusers_adapter.loading import _model_class

    config = read_config(path)
    cls = _model_class(str(config["_class_name"]))
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    model.register_to_config(_name_or_path=str(config_path(path).parent))
    return model


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


class WeightFiles:
    """The tensors of a model folder's saved weights, read one key at a time.

    safetensors are read with plain reads of each tensor's byte range, not through a memory map: the
    pages of a mapped file a rank touched would count in its resident memory until the map closes,
    doubling a stage's bytes while it loads (a LoRA rank's whole peak: its base is frozen in bf16).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stored: dict[str, Entry] = {}
        self.pickled: dict[str, Path] = {}
        single, index = folder / SAFETENSORS, folder / f"{SAFETENSORS}.index.json"
        if single.is_file():
            self.stored = read_header(single)
        elif index.is_file():
            for name in sorted(set(self._index(index).values())):
                self.stored.update(read_header(folder / name))
        elif (folder / BIN).is_file():
            self.pickled = dict.fromkeys(self._bin(folder / BIN).keys(), folder / BIN)
        elif (folder / f"{BIN}.index.json").is_file():
            self.pickled = {key: folder / name for key, name in self._index(folder / f"{BIN}.index.json").items()}
        self._open: dict[Path, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.stored or self.pickled)

    def _index(self, path: Path) -> dict[str, str]:
        try:
            return dict(json.loads(path.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SpecError(f"{path}: not a weights index ({exc})") from None

    @staticmethod
    def _bin(path: Path) -> Mapping[str, Tensor]:
        # mmap: the file's pages are read as tensors are touched, not the whole file at once
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)

    def get(self, key: str) -> Tensor:
        if key in self.stored:
            entry = self.stored[key]
            if entry.dtype not in SAFETENSORS_DTYPES:
                raise SpecError(f"{entry.file}: '{key}' is stored as {entry.dtype}, which PULSE cannot read")
            buffer = bytearray(entry.end - entry.begin)
            with open(entry.file, "rb") as f:
                f.seek(entry.begin)
                if f.readinto(buffer) != len(buffer):
                    raise SpecError(f"{entry.file}: '{key}' is cut short (the file is truncated)")
            flat = torch.frombuffer(buffer, dtype=SAFETENSORS_DTYPES[entry.dtype]) if buffer else \
                torch.empty(0, dtype=SAFETENSORS_DTYPES[entry.dtype])
            return flat.reshape(entry.shape)
        path = self.pickled.get(key)
        if path is None:
            raise SpecError(f"{self.folder}: the saved weights hold no '{key}': the folder's weights do not "
                            "match its config.json")
        if path not in self._open:
            self._open[path] = self._bin(path)
        return self._open[path][key]

    def close(self) -> None:
        self._open.clear()


class ParameterSlots:
    """Every place a parameter is registered: in the model, and directly on an adapter layer that owns a
    bare parameter (Hunyuan-DiT's ``text_embedding_padding``). Replacing one replaces it everywhere."""

    def __init__(self, adapter: DiffusersAdapter) -> None:
        self.slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in [*adapter.model.modules(), *adapter.layers.values()]:
            for key, p in module._parameters.items():
                if p is not None:
                    self.slots.setdefault(id(p), []).append((module, key))

    def replace(self, old: Tensor, value: Tensor, requires_grad: bool) -> nn.Parameter:
        new = nn.Parameter(value, requires_grad=requires_grad)
        places = self.slots.pop(id(old))
        for module, key in places:
            module._parameters[key] = new
        self.slots[id(new)] = places  # the new one may be replaced in turn (moved, cast)
        return new


def _training_dtype(saved: torch.dtype) -> torch.dtype:
    """Trainable weights are held in fp32 (or the file's fp64): AdamW on half-precision masters loses updates."""
    return saved if saved == torch.float64 else torch.float32


def load_saved(adapter: DiffusersAdapter, layers: Collection[str], files: WeightFiles, device: torch.device,
               frozen_dtype: torch.dtype | None) -> None:
    """Each parameter of ``layers`` read from ``files`` by its key, cast and placed; nothing else read."""
    names, slots = adapter.parameter_names(), ParameterSlots(adapter)
    for layer in layers:
        for p in list(adapter.layers[layer].parameters()):
            name = names[id(p)]
            saved = files.get(name)
            if tuple(saved.shape) != tuple(p.shape):
                raise SpecError(f"{files.folder}: '{name}' is {tuple(saved.shape)} in the saved weights but "
                                f"{tuple(p.shape)} in config.json")
            dtype = frozen_dtype or _training_dtype(saved.dtype)
            slots.replace(p, saved.to(device=device, dtype=dtype), frozen_dtype is None)
        adapter.layers[layer].to(device)  # its buffers (the parameters are there already)
    files.close()


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def initialise(adapter: DiffusersAdapter, layers: Collection[str], seed: int, device: torch.device,
               frozen_dtype: torch.dtype | None) -> None:
    """Each of ``layers`` made real on ``device`` and initialised under its own seed (CPU draws, then moved:
    the same values on every device)."""
    slots = ParameterSlots(adapter)
    for layer in layers:
        module = adapter.layers[layer]
        with _seeded(layer_seed(seed, layer)):
            for sub in list(module.modules()):
                own = list(sub.named_parameters(recurse=False))
                if not own:
                    continue
                sub.to_empty(device="cpu", recurse=False)  # new Parameters in sub: the other slots follow
                for (_, old), (_, new) in zip(own, sub.named_parameters(recurse=False)):
                    slots.replace(old, new.data, True)
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                    continue
                with torch.no_grad():
                    for name, p in sub.named_parameters(recurse=False):
                        p.normal_().mul_(_LOOSE_SCALE.get(name, lambda _: 1.0)(p))
        for p in list(module.parameters()):  # to the device and dtype, every slot with it
            slots.replace(p, p.data.to(device=device, dtype=frozen_dtype or p.dtype), frozen_dtype is None)
        module.to(device)  # its buffers


def materialize(adapter: DiffusersAdapter, layers: Collection[str], *, device: str | torch.device = "cpu",
                seed: int = 0, frozen_dtype: torch.dtype | None = None) -> None:
    """Make ``layers`` (spec layer names) real on ``device``: the folder's saved weights where it has them,
    else seeded per layer. ``frozen_dtype``: the layers' weights are a frozen base (LoRA), held in that dtype."""
    unknown = sorted(set(layers) - set(adapter.layers))
    if unknown:
        raise SpecError(f"'{unknown[0]}' is not a layer of {adapter.spec.name}")
    device = torch.device(device)
    order = [name for name in adapter.layers if name in set(layers)]  # spec order: seeds never depend on it
    files = WeightFiles(Path(str(adapter.model.config.get("_name_or_path") or "")))
    if files:
        load_saved(adapter, order, files, device, frozen_dtype)
    else:
        initialise(adapter, order, seed, device, frozen_dtype)


def skeleton_adapter(path: str | Path, **options: Any) -> DiffusersAdapter:
    """The adapter over the skeleton of the model at ``path`` (nothing real yet: ``materialize`` some layers).

    ``options`` are the plan's ``model_options`` (resolution, name, context_len, split_blocks).
    """
    path = str(path)[len(PREFIX):] if str(path).startswith(PREFIX) else str(path)
    return from_diffusers(skeleton(path), **options)


def load_stage(path: str | Path, layers: Collection[str] | None = None, *, device: str | torch.device = "cpu",
               seed: int = 0, frozen_dtype: torch.dtype | None = None, **options: Any) -> DiffusersAdapter:
    """The adapter over the model at ``path`` with only ``layers`` real (None: every layer), in training mode."""
    adapter = skeleton_adapter(path, **options)
    materialize(adapter, adapter.layers if layers is None else layers, device=device, seed=seed,
                frozen_dtype=frozen_dtype)
    adapter.model.train()
    return adapter


def materialized_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters that hold bytes (not on the meta device), by name."""
    return {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
