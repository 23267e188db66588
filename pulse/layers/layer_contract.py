"""The per-layer interface every backend's layers share, and its framework-free parts.

The stage executor drives every layer kind, in every backend, as::

    layer(h, shared, skips) -> (h_out, made)

    h       main-path input (latent, feature map or tokens)
    shared  shared inputs by name: data ones ("timesteps", "context", ...) and
            those earlier layers made ("temb", "c", ...)
    skips   the tensors of the skip edges whose dst is this layer, in spec order
    made    the shared inputs this layer produces ({} for most layers)

A backend's layer base is ``LayerContract`` mixed into its framework's module
class (``torch.nn.Module``, ``mindspore.nn.Cell``); ``build_checked`` turns a
spec ``Layer`` into one with the same errors everywhere.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, TypeVar

from pulse.errors import SpecError
from pulse.layers.split_blocks import mlp_activation
from pulse.spec import Layer

T = TypeVar("T")


class LayerContract:
    """Framework-free half of a layer: its kind and how many skip tensors it takes."""

    kind: str = ""
    num_skips: int = 0  # how many skip tensors a call expects

    def check_skips(self, skips: Sequence[Any]) -> None:
        """Fail loudly when the walker hands the wrong number of skips (a wiring bug)."""
        if len(skips) != self.num_skips:
            raise SpecError(f"layer kind '{self.kind}' expects {self.num_skips} skip tensor(s), "
                            f"got {len(skips)}")


def need(shared: Mapping[str, T], name: str, kind: str) -> T:
    """``shared[name]`` with an error naming the layer kind when it is missing."""
    try:
        return shared[name]
    except KeyError:
        raise SpecError(f"layer kind '{kind}' reads shared input '{name}', which is missing "
                        f"(have: {', '.join(sorted(shared)) or 'none'})") from None


def _sd2_transformer(a: Mapping[str, Any]) -> None:
    if a["qkv_bias"] or a["activation"] != "geglu":
        raise NotImplementedError("transformer2d: only SD's bias-free q/k/v, GEGLU variant is implemented "
                                  "(linear or 1x1-conv projections)")


def _plain_time_embed(a: Mapping[str, Any]) -> None:
    if a.get("text_embeds_dim"):
        raise NotImplementedError("time_embed: SDXL's added text/time conditioning (text_embeds, time_ids) is "
                                  "implemented only over a diffusers model (--diffusers-config / --pipeline, "
                                  "--backend torch)")


def _uvit_time_token(a: Mapping[str, Any]) -> None:
    if a["time_embed"] != "sinusoid":
        raise NotImplementedError("uvit_embed: only the reference's mlp_time_embed=False is implemented")


def _hdit_attention(a: Mapping[str, Any]) -> None:
    if not a["qk_norm"] or a["norm"] != "layer" or a["rope"] != "2d":
        raise NotImplementedError("hdit block: only the reference's qk-norm, LayerNorm, 2D RoPE "
                                  "variant is implemented")


def _block_mlp(a: Mapping[str, Any]) -> None:
    mlp_activation(a)


# Per kind, the checks its attrs must pass before any backend builds it.
VARIANT_CHECKS: dict[str, tuple[Callable[[Mapping[str, Any]], None], ...]] = {
    "transformer2d": (_sd2_transformer,),
    "transformer2d_part": (_sd2_transformer,),
    "time_embed": (_plain_time_embed,),
    "uvit_embed": (_uvit_time_token,),
    "uvit_block_mlp": (_block_mlp,),
    "uvit_block": (_block_mlp,),
    "hdit_block_attn": (_hdit_attention,),
    "hdit_block_mlp": (_block_mlp,),
    "hdit_block": (_hdit_attention, _block_mlp),
}


def build_checked(table: Mapping[str, Callable[..., T]], layer: Layer, *args: Any, backend: str, unit: str) -> T:
    """``table[layer.kind](layer.attrs, *args)``, an unknown kind or a missing attribute a ``SpecError``.

    ``backend`` and ``unit`` name what is missing ("the torch backend has no
    module for kind ..."). A variant no backend implements raises
    ``NotImplementedError`` naming it.
    """
    cls = table.get(layer.kind)
    if cls is None:
        raise SpecError(f"layer '{layer.name}': the {backend} backend has no {unit} for kind "
                        f"'{layer.kind}' (known kinds: {', '.join(sorted(table))})")
    try:
        for check in VARIANT_CHECKS.get(layer.kind, ()):
            check(layer.attrs)
        return cls(layer.attrs, *args)
    except KeyError as missing:
        raise SpecError(f"layer '{layer.name}' (kind '{layer.kind}') lacks attribute {missing} "
                        "in its attrs") from None
