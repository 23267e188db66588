"""ModelSpec <-> YAML."""
from __future__ import annotations

from pathlib import Path

from pulse.errors import PulseError, SpecError
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.atomic_io import write_atomic
from pulse.yamlio import (check_keys, dump_yaml, load_mapping, require_list, require_mapping, require_number,
                          require_text)

_LAYER_NUMBERS = ("params", "flops", "out_bytes", "saved_bytes")


def spec_to_dict(spec: ModelSpec) -> dict:
    return {
        "name": spec.name,
        "act_bytes": spec.act_bytes,
        "meta": dict(spec.meta),
        "layers": [
            {"name": l.name, "kind": l.kind, "params": l.params, "flops": l.flops,
             "out_bytes": l.out_bytes, "saved_bytes": l.saved_bytes, "attrs": dict(l.attrs)}
            for l in spec.layers
        ],
        "skips": [{"src": e.src, "dst": e.dst, "bytes": e.bytes} for e in spec.skips],
        "shared_inputs": [
            {"name": s.name, "bytes": s.bytes, "producer": s.producer} for s in spec.shared_inputs
        ],
    }


def spec_from_dict(data: dict, where: str = "model") -> ModelSpec:
    """A ModelSpec from plain data; every problem is one PulseError line naming ``where`` and the key."""
    if not isinstance(data, dict):
        raise PulseError(f"{where}: expected a mapping, got {type(data).__name__}")
    check_keys(data, {"name", "layers"}, {"act_bytes", "meta", "skips", "shared_inputs"}, where)
    name = require_text(data, "name", where)
    layers = []
    for i, row in enumerate(require_list(data, "layers", where, non_empty=True)):
        at = f"{where}: layers[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping, got {type(row).__name__}")
        check_keys(row, {"name", "kind", *_LAYER_NUMBERS}, {"attrs"}, at)
        nums = {k: require_number(row, k, at, integer=(k != "flops")) for k in _LAYER_NUMBERS}
        attrs = require_mapping(row, "attrs", at)
        for key, value in attrs.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise PulseError(f"{at}: attrs[{key!r}] must be a number, text or boolean, "
                                 f"got {type(value).__name__}")
        layers.append(Layer(name=require_text(row, "name", at), kind=require_text(row, "kind", at),
                            attrs=dict(attrs), **nums))
    skips = []
    for i, row in enumerate(require_list(data, "skips", where)):
        at = f"{where}: skips[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping with src, dst, bytes, got {type(row).__name__}")
        check_keys(row, {"src", "dst", "bytes"}, set(), at)
        skips.append(SkipEdge(require_text(row, "src", at), require_text(row, "dst", at),
                              require_number(row, "bytes", at, integer=True)))
    shared = []
    for i, row in enumerate(require_list(data, "shared_inputs", where)):
        at = f"{where}: shared_inputs[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping with name, bytes[, producer], got {type(row).__name__}")
        check_keys(row, {"name", "bytes"}, {"producer"}, at)
        producer = None if row.get("producer") is None else require_text(row, "producer", at)
        shared.append(SharedInput(require_text(row, "name", at), require_number(row, "bytes", at, integer=True),
                                  producer))
    seen: set[str] = set()
    for i, s in enumerate(shared):
        if s.name in seen:
            raise PulseError(f"{where}: shared_inputs[{i}]: duplicate shared input name '{s.name}'")
        seen.add(s.name)
    act_bytes = data.get("act_bytes", 2)
    if isinstance(act_bytes, bool) or not isinstance(act_bytes, int) or act_bytes <= 0:
        raise PulseError(f"{where}: 'act_bytes' must be a positive whole number, got {act_bytes!r}")
    meta = require_mapping(data, "meta", where)
    try:
        return ModelSpec(name=name, layers=tuple(layers), skips=tuple(skips),
                         shared_inputs=tuple(shared), act_bytes=act_bytes, meta=dict(meta))
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def load_spec(path: str | Path) -> ModelSpec:
    return spec_from_dict(load_mapping(path), where=str(path))


def save_spec(spec: ModelSpec, path: str | Path) -> None:
    write_atomic(path, dump_yaml(spec_to_dict(spec)))
