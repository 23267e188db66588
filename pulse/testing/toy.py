"""A toy UNet the numpy backend builds, its data, its loss and hand-cut placements.

::

    temb(t) ─▶ stem ─▶ enc0 ─▶ ... ─▶ enc{d-1} ─▶ mid ─▶ dec{d-1} ─▶ ... ─▶ dec0 ─▶ head
                 │       └──────── ... ──── skip ────────────────────────────┘      │
                 └──────────────────────── skip ───────────────────────────────────┘
    every dense layer but the head reads the shared input "temb" (made by layer 0)

Small enough for float64 gradient checks in milliseconds, rich enough to hit
every path of the runtime: nested skips, a layer-made shared input, skips
inside a chunk, relayed, sent directly, or kept local.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pulse.errors import PlanError
from pulse.placement import Placement, PlacementKind, SkipTransport, from_cuts, interleaved_devices, wave_devices
from pulse.runtime.protocols import Batches
from pulse.runtime.wiring import MAIN
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge


def toy_unet_spec(depth: int = 3, width: int = 4, in_dim: int = 3, temb_dim: int = 2,
                  t_dim: int = 1, act_bytes: int = 8, name: str = "toy-unet") -> ModelSpec:
    """2 * depth + 4 layers; widths vary per level (width + level) so a tensor
    routed to the wrong place fails loudly."""
    def dense(name: str, dim: int, **attrs: Any) -> Layer:
        nbytes = dim * act_bytes
        return Layer(name, "dense", dim * dim, 2.0 * dim * dim, nbytes, nbytes,
                     {"op": "dense", "reads": ["temb"], **attrs})

    layers = [Layer("temb", "embed", t_dim * temb_dim, 2.0 * t_dim * temb_dim, in_dim * act_bytes, 0,
                    {"op": "embed", "source": "t", "produces": "temb"}),
              dense("stem", width)]
    layers += [dense(f"enc{i}", width + i) for i in range(depth)]
    layers.append(dense("mid", width + depth))
    layers += [dense(f"dec{i}", width + i) for i in reversed(range(depth))]
    layers.append(Layer("head", "dense", width * in_dim, 2.0 * width * in_dim, in_dim * act_bytes,
                        in_dim * act_bytes, {"op": "dense"}))
    skips = [SkipEdge(f"enc{i}", f"dec{i}", (width + i) * act_bytes) for i in range(depth)]
    skips.append(SkipEdge("stem", "head", width * act_bytes))
    shared = [SharedInput("t", t_dim * act_bytes), SharedInput("temb", temb_dim * act_bytes, "temb")]
    return ModelSpec(name, tuple(layers), tuple(skips), tuple(shared), act_bytes=act_bytes,
                     meta={"depth": depth})


def toy_batches(spec: ModelSpec, microbatch_size: int, seed: int = 0) -> Batches:
    """"h" (the model input), the data shared inputs, and a "target"; seeded per microbatch."""
    in_dim = spec.layers[0].out_bytes // spec.act_bytes
    out_dim = spec.layers[-1].out_bytes // spec.act_bytes
    data = [s for s in spec.shared_inputs if s.producer is None]

    def batch(mb: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, mb])
        out = {MAIN: rng.normal(size=(microbatch_size, in_dim)),
               "target": rng.normal(size=(microbatch_size, out_dim))}
        out.update({s.name: rng.normal(size=(microbatch_size, s.bytes // spec.act_bytes)) for s in data})
        return out

    return batch


def mse_loss(outputs: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """Mean squared error against batch["target"], and its gradient."""
    diff = outputs[MAIN] - batch["target"]
    return float(np.mean(diff * diff)), {MAIN: 2.0 * diff / diff.size}


def toy_placement(spec: ModelSpec, kind: PlacementKind, num_devices: int, folds: int = 1,
                  transport: SkipTransport | None = None) -> Placement:
    """Hand-cut placements of ``toy_unet_spec``: even cuts for sequential and
    interleaved (``folds`` chunks per device), mirror cuts for V and wave so
    that every skip stays on its device."""
    n = spec.num_layers
    if kind in ("sequential", "interleaved"):
        per = 1 if kind == "sequential" else folds
        chunks = num_devices * per
        cuts = [round(i * n / chunks) for i in range(chunks + 1)]
        devices = list(range(num_devices)) if per == 1 else interleaved_devices(num_devices, per)
        return from_cuts(kind, cuts, devices, num_devices, transport or "relay", "toy")
    half = num_devices * (1 if kind == "v" else folds)  # encoder-side chunks
    depth = spec.meta["depth"]
    if depth + 1 < half:
        raise PlanError(f"toy model of depth {depth} has {depth + 1} encoder units, {half} chunks need more")
    units = [round(j * (depth + 1) / half) for j in range(half + 1)]
    first_layer = lambda u: 0 if u == 0 else u + 1  # unit 0 is temb+stem, unit u is enc{u-1}
    left = [first_layer(u) for u in units[:-1]]
    right = [n - u for u in reversed(units[1:-1])]
    cuts = left + [depth + 2] + right + [n]  # depth + 2: "mid" opens the innermost decoder chunk
    folds_used = 1 if kind == "v" else folds
    return from_cuts(kind, cuts, wave_devices(num_devices, folds_used), num_devices, transport or "direct", "toy")
