"""Random data inputs of the right shapes for a spec: the latent and every data shared input (numpy).

The shapes and value ranges of ``pulse_torch.layers.inputs.make_inputs``,
drawn with a numpy generator (the two frameworks' random streams differ;
cross-framework checks exchange the batch itself, see ``parity_export``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pulse.errors import SpecError
from pulse.spec import ModelSpec
from pulse.zoo.shapes import NUM_TRAIN_TIMESTEPS, latent_shape
from pulse.zoo.shapes import attrs_of_kind as _attrs

# (spec, batch, generator) -> array
Maker = Callable[[ModelSpec, int, np.random.Generator], np.ndarray]


def _text(kind: str, length: str, dim: str) -> Maker:
    def make(spec: ModelSpec, b: int, g: np.random.Generator) -> np.ndarray:
        a = _attrs(spec, kind)
        return g.standard_normal((b, a[length], a[dim]), dtype=np.float32)
    return make


def _prefix_mask(kind: str, length: str) -> Maker:
    """1 for the first n tokens, n uniform in [1, L]: padded text as a tokenizer returns it."""
    def make(spec: ModelSpec, b: int, g: np.random.Generator) -> np.ndarray:
        n = _attrs(spec, kind)[length]
        valid = g.integers(1, n + 1, size=(b, 1))
        return (np.arange(n)[None, :] < valid).astype(np.int64)
    return make


def _image_meta_size(spec: ModelSpec, b: int, g: np.random.Generator) -> np.ndarray:
    """Hunyuan's (original H, W, target H, W, crop top, left), in pixels: uncropped squares."""
    size = float(spec.meta.get("image_resolution", _attrs(spec, "hdit_cond_embed")["height"] * 8))
    return np.tile(np.array([size, size, size, size, 0.0, 0.0], dtype=np.float32), (b, 1))


_MAKERS: dict[str, Maker] = {
    "timesteps": lambda spec, b, g: g.integers(0, NUM_TRAIN_TIMESTEPS, size=(b,), dtype=np.int64),
    "labels": lambda spec, b, g: g.integers(0, _attrs(spec, "uvit_embed")["num_classes"], size=(b,),
                                            dtype=np.int64),
    "context": _text("transformer2d", "context_len", "context_dim"),
    "text_clip": _text("hdit_cond_embed", "clip_len", "clip_dim"),
    "text_t5": _text("hdit_cond_embed", "t5_len", "t5_dim"),
    "text_clip_mask": _prefix_mask("hdit_cond_embed", "clip_len"),
    "text_t5_mask": _prefix_mask("hdit_cond_embed", "t5_len"),
    "image_meta_size": _image_meta_size,
    "style": lambda spec, b, g: np.zeros(b, dtype=np.int64),  # Embedding(1, dim): one style
}


def make_inputs(spec: ModelSpec, batch_size: int,
                rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(latents (B, C, H, W), {data shared input name: array}) drawn from ``rng``.

    Floats are float32 standard normals; timesteps, labels, masks and style
    are int64, as on the torch side.
    """
    g = rng if rng is not None else np.random.default_rng()
    latents = g.standard_normal((batch_size, *latent_shape(spec)), dtype=np.float32)
    shared = {}
    for item in spec.shared_inputs:
        if item.producer is not None:
            continue
        maker = _MAKERS.get(item.name)
        if maker is None:
            raise SpecError(f"model '{spec.name}': no maker for data input '{item.name}' "
                            f"(known: {', '.join(sorted(_MAKERS))})")
        shared[item.name] = maker(spec, batch_size, g)
    return latents, shared
