"""A transformer block as one layer or as two (attention half, MLP half), for every backend.

U-ViT's ``Block`` and Hunyuan-DiT's ``HunYuanDiTBlock`` are each specced as
two layers (``<family>_block_attn`` then ``<family>_block_mlp``, finer cuts
for the partitioner) or, with ``split_blocks=False``, as one
(``<family>_block``). All three kinds build and run the same halves, so a
backend writes each half once, as an object with two methods::

    build(layer, attrs, *ctx)      creates the half's submodules on the layer
    run(layer, h, shared, skips)   -> h

and ``split_block_classes`` makes the three layer classes over its layer base.
The MLP half is the same in both families (``h + mlp(norm2(h))``, ``MlpHalf``);
``mlp_activation`` is the one place that says which MLPs exist.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence


def mlp_activation(attrs: Mapping[str, Any]) -> str:
    """The MLP half's activation, "gelu" (U-ViT) or "gelu_tanh" (Hunyuan-DiT), after a LayerNorm."""
    if attrs.get("norm", "layer") != "layer" or attrs["activation"] not in ("gelu", "gelu_tanh"):
        raise NotImplementedError(f"block mlp: norm {attrs.get('norm')!r} with activation "
                                  f"{attrs['activation']!r} is not implemented (LayerNorm, gelu or gelu_tanh is)")
    return str(attrs["activation"])


def skip_count(attrs: Mapping[str, Any]) -> int:
    """How many skip tensors a block's attention half fuses: one when it ends a long skip."""
    return 1 if attrs["skip"] else 0


class MlpHalf:
    """The MLP half: pre-LN FFN with its residual, ``h + mlp(norm2(h))``.

    A backend's subclass builds ``norm2`` and ``mlp`` (for ``mlp_activation``).
    """

    def build(self, layer: Any, attrs: Mapping[str, Any], *ctx: Any) -> None:
        raise NotImplementedError

    def run(self, layer: Any, h: Any, shared: Mapping[str, Any], skips: Sequence[Any]) -> Any:
        return h + layer.mlp(layer.norm2(h))


def split_block_classes(kind: str, class_prefix: str, base: type, attn: Any, mlp: Any, entry: str,
                        finish: Callable[[Any], None] | None = None) -> dict[str, type]:
    """``{kind}_attn``, ``{kind}_mlp`` and ``kind`` as subclasses of ``base``.

    ``entry`` is the method the framework calls (``forward``, ``construct``);
    ``finish(layer)`` runs once every half is built (U-ViT's re-initialisation
    walks all of the layer's linears in module order, as the reference does).
    """
    parts = {f"{kind}_attn": ("Attn", (attn,)), f"{kind}_mlp": ("Mlp", (mlp,)), kind: ("", (attn, mlp))}
    return {k: _block_class(f"{class_prefix}Block{suffix}", k, base, halves, entry, finish)
            for k, (suffix, halves) in parts.items()}


def _block_class(name: str, kind: str, base: type, halves: tuple[Any, ...], entry: str,
                 finish: Callable[[Any], None] | None) -> type:
    def __init__(self: Any, attrs: Mapping[str, Any], *ctx: Any) -> None:
        base.__init__(self)
        for half in halves:
            half.build(self, attrs, *ctx)
        if finish is not None:
            finish(self)

    def call(self: Any, h: Any, shared: Mapping[str, Any], skips: Sequence[Any]) -> tuple[Any, dict]:
        self.check_skips(skips)
        for half in halves:
            h = half.run(self, h, shared, skips)
        return h, {}

    doc = " then ".join(_summary(half) for half in halves)
    return type(name, (base,), {"kind": kind, "__init__": __init__, entry: call, "__doc__": f"Layer {kind}: {doc}.",
                                "__module__": type(halves[0]).__module__, "__qualname__": name})


def _summary(half: Any) -> str:
    return (type(half).__doc__ or type(half).__name__).split("\n")[0].rstrip(".")
