"""A reference ``Backend`` in numpy (float64, manual backward), for tests and as a template.

It builds a chunk from ``Layer.attrs``; widths come from the spec's byte
sizes (width = bytes per sample / ``spec.act_bytes``), so the tensors it moves
are exactly as large as ``pulse.traffic`` says::

    op "dense":  h' = tanh(h W^T + b + sum_skips s W_s^T + sum_reads x U_x^T)
                 (skips: the spec's edges ending here; reads: attrs["reads"])
    op "embed":  shared[attrs["produces"]] = tanh(data[attrs["source"]] E^T + c); h passes

A dense layer 0 takes attrs["in_dim"] inputs. Parameters are seeded per
layer name, so every placement of the same spec trains the same model.
``pulse.testing.toy`` has a spec, data and loss this backend trains.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pulse.errors import SpecError
from pulse.runtime.wiring import MAIN, ChunkIO
from pulse.spec import ModelSpec


@dataclass
class _Layer:
    name: str
    op: str
    params: dict[str, np.ndarray]
    skips_in: tuple[str, ...] = ()  # skip keys read (by key, param "W[key]")
    skips_out: tuple[str, ...] = ()  # skip keys whose source is this layer
    reads: tuple[str, ...] = ()  # shared names read (param "U[name]")
    source: str = ""  # embed: the data input
    produces: str = ""  # embed: the shared name made
    grads: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class NumpyChunk:
    io: ChunkIO
    layers: list[_Layer]


def _width(nbytes: int, spec: ModelSpec, what: str) -> int:
    if nbytes % spec.act_bytes:
        raise SpecError(f"{what}: {nbytes} bytes is not a whole number of {spec.act_bytes}-byte elements")
    return nbytes // spec.act_bytes


def _build_layer(spec: ModelSpec, i: int, seed: int) -> _Layer:
    layer = spec.layers[i]
    rng = np.random.default_rng([seed, zlib.crc32(layer.name.encode())])
    dims = {s.name: _width(s.bytes, spec, f"shared input {s.name}") for s in spec.shared_inputs}

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.7 / np.sqrt(cols), size=(rows, cols))

    op = layer.attrs.get("op", "dense")
    if op == "embed":
        src, made = layer.attrs["source"], layer.attrs["produces"]
        return _Layer(layer.name, op, {"E": mat(dims[made], dims[src]), "c": np.zeros(dims[made])},
                      skips_out=tuple(e.key for e in spec.skips if e.src == layer.name),
                      source=src, produces=made)
    out = _width(layer.out_bytes, spec, f"layer {layer.name}")
    fan_in = layer.attrs["in_dim"] if i == 0 else _width(spec.layers[i - 1].out_bytes, spec, "input")
    edges = [e for e in spec.skips if e.dst == layer.name]
    reads = tuple(layer.attrs.get("reads", ()))
    params = {"W": mat(out, fan_in), "b": rng.normal(0.0, 0.1, size=out)}
    params.update({f"W[{e.key}]": mat(out, _width(e.bytes, spec, f"skip {e.key}")) for e in edges})
    params.update({f"U[{n}]": mat(out, dims[n]) for n in reads})
    return _Layer(layer.name, op, params, skips_in=tuple(e.key for e in edges),
                  skips_out=tuple(e.key for e in spec.skips if e.src == layer.name), reads=reads)


class NumpyBackend:
    """SGD with learning rate ``lr``; tensors are float64 arrays of shape (batch, width)."""

    def __init__(self, lr: float = 0.1, seed: int = 0) -> None:
        self.lr = lr
        self.seed = seed
        self._watches: dict[int, Any] = {}  # id(layer) -> on_final of its watched chunk (``watch_gradients``)

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> NumpyChunk:
        chunk = NumpyChunk(io, [_build_layer(spec, i, self.seed) for i in range(io.start, io.end)])
        self.zero_grad(chunk)
        return chunk

    # -- compute ---------------------------------------------------------------
    def forward(self, chunk: NumpyChunk, inputs: dict[str, np.ndarray],
                grad_names: frozenset[str]) -> tuple[dict[str, np.ndarray], Any]:
        io = chunk.io
        h = inputs[MAIN]
        skips = {k: inputs[k] for k in io.consumes}
        shared = {n: inputs[n] for n in (*io.shared_in, *io.data_inputs) if n in inputs}
        tape = []
        for layer in chunk.layers:
            p = layer.params
            if layer.op == "embed":
                x = shared[layer.source]
                shared[layer.produces] = np.tanh(x @ p["E"].T + p["c"])
                tape.append((layer, [x], shared[layer.produces]))
            else:
                xs = [h] + [skips[k] for k in layer.skips_in] + [shared[n] for n in layer.reads]
                keys = ["W"] + [f"W[{k}]" for k in layer.skips_in] + [f"U[{n}]" for n in layer.reads]
                h = np.tanh(sum(x @ p[k].T for x, k in zip(xs, keys)) + p["b"])
                tape.append((layer, xs, h))
            for k in layer.skips_out:
                skips[k] = h
        outputs = {MAIN: h, **{k: skips[k] for k in io.produces}, **{n: shared[n] for n in io.shared_made}}
        return outputs, (chunk, tape, dict(inputs), grad_names, h)

    def backward_input(self, ctx: Any, output_grads: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
        chunk, tape, inputs, grad_names, h_out = ctx
        gh = output_grads.get(MAIN, np.zeros_like(h_out))
        gskip = {k: output_grads[k] for k in chunk.io.produces if k in output_grads}
        gshared = {n: output_grads[n] for n in chunk.io.shared_made if n in output_grads}
        work = []  # (layer, layer inputs, pre-activation gradient) for the weight half
        for layer, xs, y in reversed(tape):
            for k in layer.skips_out:  # the output also fed these skips
                if k in gskip:
                    gh = gh + gskip.pop(k)
            if layer.op == "embed":
                ge = gshared.pop(layer.produces, None)
                if ge is not None:
                    work.append((layer, xs, ge * (1.0 - y * y)))
                continue
            gz = gh * (1.0 - y * y)
            work.append((layer, xs, gz))
            p = layer.params
            gh = gz @ p["W"]
            for k in layer.skips_in:
                gskip[k] = gskip.get(k, 0.0) + gz @ p[f"W[{k}]"]
            for n in layer.reads:
                gshared[n] = gshared.get(n, 0.0) + gz @ p[f"U[{n}]"]
        found = {MAIN: gh, **gskip, **gshared}
        grads = {n: found.get(n, np.zeros_like(inputs[n])) for n in grad_names}
        return grads, work

    def backward_weight(self, work: Any) -> None:
        for layer, xs, gz in work:
            keys = (["E"] if layer.op == "embed" else
                    ["W"] + [f"W[{k}]" for k in layer.skips_in] + [f"U[{n}]" for n in layer.reads])
            for x, k in zip(xs, keys):
                layer.grads[k] += gz.T @ x
            layer.grads["c" if layer.op == "embed" else "b"] += gz.sum(axis=0)
            if id(layer) in self._watches:
                for k, g in layer.grads.items():
                    self._watches[id(layer)](f"{layer.name}.{k}", g)

    def backward(self, ctx: Any, output_grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        grads, work = self.backward_input(ctx, output_grads)
        self.backward_weight(work)
        return grads

    # -- parameters ----------------------------------------------------------------
    def zero_grad(self, chunk: NumpyChunk) -> None:
        for layer in chunk.layers:
            layer.grads = {k: np.zeros_like(v) for k, v in layer.params.items()}

    def parameters(self, chunk: NumpyChunk) -> dict[str, np.ndarray]:
        return {f"{l.name}.{k}": v for l in chunk.layers for k, v in l.params.items()}

    def parameter_layers(self, chunk: NumpyChunk) -> dict[str, int]:
        return {f"{l.name}.{k}": i for i, l in enumerate(chunk.layers) for k in l.params}

    def watch_gradients(self, chunk: NumpyChunk, on_final: Any) -> Any:
        """Tell ``on_final(name, gradient)`` of each gradient as the weight half makes it (layers
        last to first), until the returned function is called (``pulse.runtime.grad_sync``). Several
        chunks may be watched at once: in process, the ranks share this backend."""
        for layer in chunk.layers:
            self._watches[id(layer)] = on_final

        def unwatch() -> None:
            for layer in chunk.layers:
                self._watches.pop(id(layer), None)

        return unwatch

    def gradients(self, chunk: NumpyChunk) -> dict[str, np.ndarray]:
        return {f"{l.name}.{k}": v for l in chunk.layers for k, v in l.grads.items()}

    def set_gradients(self, chunk: NumpyChunk, grads: dict[str, np.ndarray]) -> None:
        for layer in chunk.layers:
            for k in layer.grads:
                layer.grads[k] = np.array(grads[f"{layer.name}.{k}"], dtype=np.float64)

    def optimizer_step(self, chunk: NumpyChunk) -> None:
        for layer in chunk.layers:
            for k, v in layer.params.items():
                v -= self.lr * layer.grads[k]

    # -- tensors -------------------------------------------------------------------
    def nbytes(self, t: np.ndarray) -> int:
        return int(t.nbytes)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def scale(self, t: np.ndarray, factor: float) -> np.ndarray:
        return t * factor

    def zeros_like(self, t: np.ndarray) -> np.ndarray:
        return np.zeros_like(t)

    def flatten(self, tensors: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.ravel(t) for t in tensors])

    def split_like(self, flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
        ends = np.cumsum([t.size for t in like])[:-1]
        return [p.reshape(t.shape) for p, t in zip(np.split(flat, ends), like)]

    def to_numpy(self, t: np.ndarray) -> np.ndarray:
        return np.asarray(t)

    def from_numpy(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.float64)
