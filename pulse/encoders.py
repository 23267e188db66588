"""The frozen encoders of a diffusion model as part of the plan (DiffusionPipe's "non-trainable part").

A training step of a latent diffusion model first encodes each microbatch: the
text encoder turns tokens into the cross-attention context, the VAE encoder
turns pixels into the latent the backbone denoises. They are forward only (no
parameters to update, no activations kept for a backward), so they can run
anywhere the pipeline idles, as long as their output reaches its readers before
the microbatch's first forward::

    mode "cached"   no encode tasks: the data set is encoded offline (pulse cache-latents)
    mode "before"   every E on chunk 0's device before the pipeline starts (DiffusionPipe's
                    sequential baseline for the non-trainable part)
    mode "bubbles"  each E in an idle gap of a device with room for its weights: before its
                    microbatch's first forward, or anywhere in the step before as a prefetch
                    (E of M + m: the next step's m), then re-sequenced with the compute by the
                    ILP where the simulator says so (pulse.schedule.encode, pulse.synth.encodes)

An ``Encoder`` says what one encoder costs and where its output goes; which
layers read it (``readers``) decides the chunks it is delivered to
(``reader_chunks``): the first reader chunk on each device, since a device keeps
its copy for its later chunks, as it does for shared inputs.

An encode task makes one model input (``feeds``) or several: SDXL's two text
encoders run as one task whose output is the whole ``context`` (both halves,
concatenated on the feature axis), text_encoder_2's pooled ``text_embeds`` and
the image's ``time_ids`` (read off its file header with the caption)::

    E text m ─▶ context, text_embeds, time_ids   one message of three tensors per reader device
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from pulse.errors import PulseError
from pulse.placement import Placement
from pulse.spec import ModelSpec
from pulse.yamlio import check_keys, require_list, require_number, require_text

MODES = ("cached", "before", "bubbles")
LATENT = "latent"  # ``feeds`` of an encoder whose output is the main-path input of the first layer
WEIGHT_BYTES = 2  # bytes per frozen weight unless told (fp16, the planners' headline): no gradient, no optimizer state
OUT_ACT_BYTES = 2  # bytes per element ``Encoder.out_bytes`` is stated at, as the zoo's layers (fp16)


@dataclass(frozen=True)
class Encoder:
    """One frozen encoder; sizes per sample."""

    name: str  # "text", "vae", "clip", "mt5"
    params: int
    flops: float  # forward FLOPs per sample (a multiply-add counts as 2, as in pulse.zoo.common)
    out_bytes: int  # its output per sample at OUT_ACT_BYTES (fp16), the message to each reader device
    # the data inputs it makes, in message order: LATENT, or data shared inputs' names ("context",
    # "text_t5"); a single name is taken as a one-name tuple
    feeds: tuple[str, ...]
    readers: tuple[str, ...] = ()  # layer kinds that read it (any of its feeds); () with LATENT: the first layer
    layers: int = 1  # kernels-per-pass count for the roofline's fixed overhead (its transformer / conv blocks)
    source: str = ""  # where the hyper-parameters come from
    # bytes per weight as the run holds it: 2 in bf16 / fp16, 4 in fp32 (``pulse train --precision``: the
    # pipeline's parts in the training precision, pulse.data.frozen_precision)
    bytes_per_param: int = WEIGHT_BYTES

    def __post_init__(self) -> None:
        feeds = (self.feeds,) if isinstance(self.feeds, str) else tuple(self.feeds)
        if not feeds or len(set(feeds)) != len(feeds):
            raise PulseError(f"encoder '{self.name}': 'feeds' must name its model inputs once each, got {feeds}")
        object.__setattr__(self, "feeds", feeds)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    def out_bytes_at(self, act_bytes: int) -> int:
        """Its output per sample at ``act_bytes`` bytes per element (fp32 training sends 4)."""
        return self.out_bytes * act_bytes // OUT_ACT_BYTES

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.params, "flops": self.flops, "out_bytes": self.out_bytes,
                # one input as a name, as plans always held it (their YAML unchanged); several as a list
                "feeds": self.feeds[0] if len(self.feeds) == 1 else list(self.feeds),
                "readers": list(self.readers), "layers": self.layers, "source": self.source,
                "bytes_per_param": self.bytes_per_param}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "Encoder":
        if not isinstance(data, dict):
            raise PulseError(f"{where}: expected a mapping, got {type(data).__name__}")
        check_keys(data, {"name", "params", "flops", "out_bytes", "feeds"},
                   {"readers", "layers", "source", "bytes_per_param"}, where)
        readers = data.get("readers") or []
        if not isinstance(readers, list) or not all(isinstance(r, str) and r for r in readers):
            raise PulseError(f"{where}: 'readers' must be a list of layer kinds")
        source = data.get("source", "")
        if not isinstance(source, str):
            raise PulseError(f"{where}: 'source' must be text")
        feeds = data["feeds"]
        if isinstance(feeds, list) and feeds and all(isinstance(f, str) and f for f in feeds):
            feeds = tuple(feeds)
        else:
            feeds = require_text(data, "feeds", where)
        return cls(name=require_text(data, "name", where),
                   params=require_number(data, "params", where, integer=True),
                   flops=float(require_number(data, "flops", where)),
                   out_bytes=require_number(data, "out_bytes", where, integer=True),
                   feeds=feeds, readers=tuple(readers),
                   layers=require_number(data, "layers", where, positive=True, integer=True) if "layers" in data else 1,
                   source=source,  # plans written before the key priced fp16 weights
                   bytes_per_param=require_number(data, "bytes_per_param", where, positive=True, integer=True)
                   if "bytes_per_param" in data else WEIGHT_BYTES)


@dataclass(frozen=True)
class EncoderSet:
    """The encoders of one model and where their tasks run (``mode``); E actions name them by index."""

    encoders: tuple[Encoder, ...]
    mode: str = "cached"

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoders", tuple(self.encoders))
        if self.mode not in MODES:
            raise PulseError(f"encoders: unknown mode '{self.mode}' (known: {', '.join(MODES)})")
        names = [e.name for e in self.encoders]
        if len(set(names)) != len(names):
            raise PulseError(f"encoders: a name is listed twice in {names}")

    @property
    def active(self) -> bool:
        """Does the plan run encode tasks (not cached offline)?"""
        return self.mode != "cached" and bool(self.encoders)

    def with_mode(self, mode: str) -> "EncoderSet":
        return EncoderSet(self.encoders, mode)

    def held_at(self, bytes_per_param: Mapping[str, int]) -> "EncoderSet":
        """The same encoders with their weights held at ``bytes_per_param[name]`` bytes each (an encoder
        not named keeps its own): what the run's ranks load them in, which the memory model prices."""
        return EncoderSet(tuple(replace(e, bytes_per_param=bytes_per_param.get(e.name, e.bytes_per_param))
                                for e in self.encoders), self.mode)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "encoders": [e.to_dict() for e in self.encoders]}

    @classmethod
    def from_dict(cls, data: dict, where: str = "encoders") -> "EncoderSet":
        if not isinstance(data, dict):
            raise PulseError(f"{where}: expected a mapping with mode, encoders, got {type(data).__name__}")
        check_keys(data, {"mode", "encoders"}, set(), where)
        mode = require_text(data, "mode", where)
        if mode not in MODES:
            raise PulseError(f"{where}: 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        rows = require_list(data, "encoders", where)
        return cls(tuple(Encoder.from_dict(r, f"{where}: encoders[{i}]") for i, r in enumerate(rows)), mode)


def reader_layers(spec: ModelSpec, encoder: Encoder) -> list[int]:
    """Indices of the layers reading ``encoder``'s output."""
    if LATENT in encoder.feeds and not encoder.readers:
        return [0]
    found = [i for i, layer in enumerate(spec.layers) if layer.kind in encoder.readers]
    if not found:
        raise PulseError(f"encoder '{encoder.name}': no layer of model '{spec.name}' has a kind in "
                         f"{list(encoder.readers)} to read its output '{', '.join(encoder.feeds)}'")
    return found


def reader_chunks(spec: ModelSpec, placement: Placement, encoder: Encoder) -> tuple[int, ...]:
    """The chunks an encode's output is delivered to: per device, its first chunk (in chain
    order) that reads the output; the device's later chunks read the same copy. Chain order."""
    chunks = sorted({placement.chunk_of_layer(i) for i in reader_layers(spec, encoder)})
    first: dict[int, int] = {}
    for c in chunks:
        first.setdefault(placement.chunks[c].device, c)
    return tuple(sorted(first.values()))


def check_feeds(spec: ModelSpec, encoders: EncoderSet) -> None:
    """Every encoder makes the latent or a data input the model reads (one with no producer layer)."""
    data_inputs = {s.name for s in spec.shared_inputs if s.producer is None}
    for e in encoders.encoders:
        for feeds in e.feeds:
            if feeds != LATENT and feeds not in data_inputs:
                raise PulseError(f"encoder '{e.name}' feeds '{feeds}', which is not a data input of model "
                                 f"'{spec.name}' (data inputs: {', '.join(sorted(data_inputs)) or 'none'}; or "
                                 f"'{LATENT}')")
        reader_layers(spec, e)
