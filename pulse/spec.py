"""Model specs: ordered layers, long skip edges and inputs shared by every layer.

A spec is framework-free data. Sizes are per sample; byte sizes use the spec's
activation precision (``act_bytes`` bytes per element, 2 for fp16), and
``with_act_bytes`` rescales them, e.g. to fp32 for CPU training.

::

    conv_in ─▶ down0 ─▶ down1 ─▶ mid ─▶ up1 ─▶ up0 ─▶ conv_out      main path
        └────────┼────────┼── skip ──────┘      │         │
                 └────────┼── skip ─────────────┘         │          long skips
                          └── skip ───────────────────────┘          (nested)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable


@dataclass(frozen=True)
class Layer:
    """One schedulable unit of the backbone (a ResNet block, an attention block, ...)."""

    name: str
    kind: str
    params: int
    flops: float  # forward FLOPs per sample (a multiply-add counts as 2)
    out_bytes: int  # main-path output activation bytes per sample
    saved_bytes: int  # activation bytes kept for backward per sample
    # Architecture hyper-parameters a backend needs to build the module
    # (channels, resolution, heads, ...): plain ints/floats/strings/bools.
    attrs: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class SkipEdge:
    """A long-range dependency: ``src``'s output is also read by ``dst``."""

    src: str
    dst: str
    bytes: int  # per sample

    @property
    def key(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class SharedInput:
    """An input every layer may read.

    ``producer`` is None for inputs that come from the data (timesteps, text
    context): every rank loads them itself, so they never cross a device
    boundary. Otherwise the named layer computes it (e.g. the timestep-embedding
    MLP) and it rides the main-path messages from there on, its gradient back:
    across every later device boundary under relay transport, once into each
    device under direct transport (``pulse.traffic``).
    """

    name: str
    bytes: int  # per sample
    producer: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[Layer, ...]
    skips: tuple[SkipEdge, ...] = ()
    shared_inputs: tuple[SharedInput, ...] = ()
    act_bytes: int = 2  # bytes per activation element the byte sizes assume
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "skips", tuple(self.skips))
        object.__setattr__(self, "shared_inputs", tuple(self.shared_inputs))
        validate_spec(self)

    # -- lookups -----------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def total_flops(self) -> float:
        return sum(layer.flops for layer in self.layers)

    def index(self, name: str) -> int:
        return self._index()[name]

    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_name_index")
        if cached is None:
            cached = {layer.name: i for i, layer in enumerate(self.layers)}
            object.__setattr__(self, "_name_index", cached)
        return cached

    def skip_spans(self) -> list[tuple[int, int, SkipEdge]]:
        """Skips as (src index, dst index, edge), in spec order."""
        return [(self.index(e.src), self.index(e.dst), e) for e in self.skips]

    def crossing_pairs(self) -> list[tuple[SkipEdge, SkipEdge]]:
        """Pairs of skips that cross (neither nested nor disjoint)."""
        spans = self.skip_spans()
        out = []
        for i, (s1, t1, e1) in enumerate(spans):
            for s2, t2, e2 in spans[i + 1 :]:
                if s1 < s2 < t1 < t2 or s2 < s1 < t2 < t1:
                    out.append((e1, e2))
        return out

    def with_act_bytes(self, act_bytes: int) -> "ModelSpec":
        """The same model with activation byte sizes at another precision."""
        if act_bytes == self.act_bytes:
            return self

        def scale(n: int) -> int:
            return n * act_bytes // self.act_bytes

        return replace(
            self,
            layers=tuple(
                replace(l, out_bytes=scale(l.out_bytes), saved_bytes=scale(l.saved_bytes))
                for l in self.layers
            ),
            skips=tuple(replace(e, bytes=scale(e.bytes)) for e in self.skips),
            shared_inputs=tuple(replace(s, bytes=scale(s.bytes)) for s in self.shared_inputs),
            act_bytes=act_bytes,
        )


def validate_spec(spec: ModelSpec) -> None:
    """Raise SpecError naming the first problem found."""
    from pulse.errors import SpecError

    if not spec.layers:
        raise SpecError(f"model '{spec.name}' has no layers")
    if spec.act_bytes <= 0:
        raise SpecError(f"model '{spec.name}': act_bytes must be positive, got {spec.act_bytes}")
    seen: set[str] = set()
    for layer in spec.layers:
        if layer.name in seen:
            raise SpecError(f"model '{spec.name}': duplicate layer name '{layer.name}'")
        seen.add(layer.name)
        for attr in ("params", "flops", "out_bytes", "saved_bytes"):
            if getattr(layer, attr) < 0:
                raise SpecError(
                    f"model '{spec.name}': layer '{layer.name}' has negative {attr} "
                    f"({getattr(layer, attr)}); sizes must be >= 0"
                )
    for edge in spec.skips:
        for end in (edge.src, edge.dst):
            if end not in seen:
                raise SpecError(
                    f"model '{spec.name}': skip {edge.key} names unknown layer '{end}'"
                )
        if spec.index(edge.src) >= spec.index(edge.dst):
            raise SpecError(
                f"model '{spec.name}': skip {edge.key} points backwards "
                "(its source must come before its destination)"
            )
        if edge.bytes < 0:
            raise SpecError(f"model '{spec.name}': skip {edge.key} has negative bytes")
    keys = [e.key for e in spec.skips]
    if len(set(keys)) != len(keys):
        raise SpecError(f"model '{spec.name}': a skip edge is listed twice")
    for shared in spec.shared_inputs:
        if shared.bytes < 0:
            raise SpecError(f"model '{spec.name}': shared input '{shared.name}' has negative bytes")
        if shared.producer is not None and shared.producer not in seen:
            raise SpecError(
                f"model '{spec.name}': shared input '{shared.name}' names unknown "
                f"producer layer '{shared.producer}'"
            )


def layers_from_rows(rows: Iterable[tuple]) -> tuple[Layer, ...]:
    """Build layers from (name, kind, params, flops, out_bytes, saved_bytes) rows."""
    return tuple(Layer(*row) for row in rows)
