"""How a run of spec layers is walked, framework-free: every backend's chunk and reference model use it.

::

    inputs {"h", skip keys, shared names}
        │
        ▼  for each layer, in spec order:
    layer(h, shared, [skip tensors it reads, spec edge order]) -> (h, made)
        │  made joins ``shared``; a skip key read is dropped (one edge, one reader);
        │  a layer that is a skip source leaves its output under its edge keys
        ▼
    outputs {"h", skip keys a later chunk reads, shared names the chunk made}

The layers are whatever the backend built (torch modules, MindSpore cells,
a user's diffusers modules): the walk only calls them, so the same code runs
under torch's autograd and inside ``mindspore.vjp``. Parameter names
("<layer>.<path>"), the reference checkpoint's names and the per-layer seeds
are here too, so checkpoints and weights exchange by name across backends.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from pulse.runtime.wiring import MAIN, ChunkIO
from pulse.spec import Layer, ModelSpec

# A backend's layer object: layer(h, shared, skips) -> (h_out, made shared inputs)
LayerCall = Callable[[Any, dict[str, Any], list[Any]], tuple[Any, Mapping[str, Any]]]


@dataclass(frozen=True)
class SkipWiring:
    """Per layer, the skip keys it reads (spec edge order) and those it is the source of."""

    reads: Mapping[str, tuple[str, ...]]
    writes: Mapping[str, tuple[str, ...]]

    @classmethod
    def of(cls, spec: ModelSpec, names: Iterable[str]) -> "SkipWiring":
        names = list(names)
        return cls(reads={n: tuple(e.key for e in spec.skips if e.dst == n) for n in names},
                   writes={n: tuple(e.key for e in spec.skips if e.src == n) for n in names})


def walk_layers(layers: Mapping[str, LayerCall], wiring: SkipWiring, h: Any, shared: dict[str, Any],
                skips: dict[str, Any]) -> Any:
    """Run ``layers`` in order; ``shared`` and ``skips`` are updated in place. Returns the last ``h``.

    A skip tensor is dropped from ``skips`` once its (only) reader has it, so
    a whole-model walk holds a long skip no longer than it must.
    """
    for name, layer in layers.items():
        h, made = layer(h, shared, [skips.pop(k) for k in wiring.reads[name]])
        shared.update(made)
        for k in wiring.writes[name]:
            skips[k] = h
    return h


def chunk_output_names(io: ChunkIO) -> tuple[str, ...]:
    """The names a chunk's forward returns, in the order ``run_chunk`` returns them."""
    return (MAIN, *io.produces, *io.shared_made)


def run_chunk(layers: Mapping[str, LayerCall], wiring: SkipWiring, io: ChunkIO,
              inputs: Mapping[str, Any]) -> dict[str, Any]:
    """One chunk's forward: its inputs by name -> ``chunk_output_names(io)`` by name."""
    skips = {k: inputs[k] for k in io.consumes}
    shared = {n: inputs[n] for n in (*io.shared_in, *io.data_inputs) if n in inputs}
    h = walk_layers(layers, wiring, inputs[MAIN], shared, skips)
    return {MAIN: h, **{k: skips[k] for k in io.produces}, **{n: shared[n] for n in io.shared_made}}


def run_model(layers: Mapping[str, LayerCall], wiring: SkipWiring, h: Any, shared: Mapping[str, Any]) -> Any:
    """Every layer of a model on one device: the reference a pipeline must equal."""
    return walk_layers(layers, wiring, h, dict(shared), {})


def split_main(inputs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """{"h": latents, data shared inputs by name} -> (latents, the shared inputs)."""
    return inputs[MAIN], {k: v for k, v in inputs.items() if k != MAIN}


def param_name(layer: str, path: str) -> str:
    """A parameter's name across the run: "<layer>.<path in the layer>" (checkpoints, gradients, weights)."""
    return f"{layer}.{path}"


def reference_key(layer: Layer, path: str) -> str:
    """The reference checkpoint's name of one of the layer's parameters.

    A layer owning one reference module (``down_blocks.0.resnets.1``) names
    its parameters as that module does, so the key is prefixed; a layer
    owning several top-level modules (``conv_norm_out,conv_out``) names its
    attributes after them, so the key is the name itself.
    """
    refs = [r for r in str(layer.attrs.get("ref_module", "")).split(",") if r]
    return f"{refs[0]}.{path}" if len(refs) == 1 else path


def layer_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one layer, fixed by the model seed and the layer's name.

    Every backend seeds its generator for layer ``name`` with this, so a stage
    that builds only some layers gets exactly the reference model's weights.
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
