"""ModelSpec <-> YAML."""
from __future__ import annotations

from pathlib import Path

from pulse.errors import PulseError, SpecError
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.yamlio import check_keys, dump_yaml, load_mapping, require_number, write_atomic

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
    check_keys(data, {"name", "layers"}, {"act_bytes", "meta", "skips", "shared_inputs"}, where)
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise PulseError(f"{where}: 'layers' must be a non-empty list")
    layers = []
    for i, row in enumerate(data["layers"]):
        at = f"{where}: layers[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping")
        check_keys(row, {"name", "kind", *_LAYER_NUMBERS}, {"attrs"}, at)
        nums = {k: require_number(row, k, at, integer=(k != "flops")) for k in _LAYER_NUMBERS}
        attrs = row.get("attrs") or {}
        if not isinstance(attrs, dict):
            raise PulseError(f"{at}: 'attrs' must be a mapping")
        layers.append(Layer(name=str(row["name"]), kind=str(row["kind"]), attrs=dict(attrs), **nums))
    skips = []
    for i, row in enumerate(data.get("skips") or []):
        at = f"{where}: skips[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping")
        check_keys(row, {"src", "dst", "bytes"}, set(), at)
        skips.append(SkipEdge(str(row["src"]), str(row["dst"]), require_number(row, "bytes", at, integer=True)))
    shared = []
    for i, row in enumerate(data.get("shared_inputs") or []):
        at = f"{where}: shared_inputs[{i}]"
        if not isinstance(row, dict):
            raise PulseError(f"{at}: expected a mapping")
        check_keys(row, {"name", "bytes"}, {"producer"}, at)
        producer = row.get("producer")
        shared.append(SharedInput(str(row["name"]), require_number(row, "bytes", at, integer=True),
                                  None if producer is None else str(producer)))
    act_bytes = data.get("act_bytes", 2)
    if not isinstance(act_bytes, int) or act_bytes <= 0:
        raise PulseError(f"{where}: 'act_bytes' must be a positive whole number, got {act_bytes!r}")
    try:
        return ModelSpec(name=str(data["name"]), layers=tuple(layers), skips=tuple(skips),
                         shared_inputs=tuple(shared), act_bytes=act_bytes,
                         meta=dict(data.get("meta") or {}))
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def load_spec(path: str | Path) -> ModelSpec:
    return spec_from_dict(load_mapping(path), where=str(path))


def save_spec(spec: ModelSpec, path: str | Path) -> None:
    write_atomic(path, dump_yaml(spec_to_dict(spec)))
