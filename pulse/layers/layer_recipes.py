"""The order of operations of composite layers, framework-free: every backend runs the same recipe.

A recipe calls the layer's own submodules (named as the reference names
them: ``attn1``, ``pooler``, ``label_emb`` ...) and a handful of tensor
primitives the backend supplies as a ``TensorOps``; everything else (which
input feeds which submodule, what is concatenated in which order, where the
residuals are) is written once, here::

    backend layer ──forward / construct──▶ recipe(layer, ops, ...) ──▶ layer.<submodule>(...)
                                                     └──────────────▶ ops.cat / ops.batch_of / ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from pulse.layers.layer_contract import need


@dataclass(frozen=True)
class TensorOps:
    """The tensor primitives the recipes need, as one framework writes them."""

    cat: Callable[[Sequence[Any], int], Any]  # (tensors, axis)
    batch_of: Callable[[Any, int], Any]  # per-sample values (B,) or one value, broadcast to (batch,)
    cast_like: Callable[[Any, Any], Any]  # (x, like): x in like's dtype
    sinusoid: Callable[[Any, int, bool], Any]  # (t (B,), dim, flip_sin_to_cos) -> (B, dim) float32
    where_valid: Callable[[Any, Any, Any], Any]  # (mask (B, L) ints, x (B, L, D), fill (L, D)): x where set
    to_tokens: Callable[[Any], Any]  # (B, C, H, W) -> (B, H W, C)
    to_map: Callable[[Any, tuple[int, int, int, int]], Any]  # (B, H W, C) -> (B, C, H, W) of the given shape


def transformer_block(block: Any, x: Any, context: Any) -> Any:
    """diffusers ``BasicTransformerBlock``: pre-LN self-attention, cross-attention, feed-forward."""
    x = x + block.attn1(block.norm1(x))
    x = x + block.attn2(block.norm2(x), context)
    return x + block.ff(block.norm3(x))


def transformer2d(layer: Any, ops: TensorOps, h: Any, shared: Mapping[str, Any]) -> Any:
    """diffusers ``Transformer2DModel``: GN, projection in, blocks over the context, projection out, residual.

    ``layer.linear_projection`` (SD 2's ``use_linear_projection``): the projections are linears on
    tokens; otherwise (SD 1.x) 1x1 convs on the feature map, applied before tokenizing and after
    mapping back, in diffusers' order.
    """
    context = need(shared, "context", layer.kind)
    x = layer.norm(h)
    x = layer.proj_in(ops.to_tokens(x)) if layer.linear_projection else ops.to_tokens(layer.proj_in(x))
    for block in layer.transformer_blocks:
        x = block(x, context)
    if layer.linear_projection:
        return ops.to_map(layer.proj_out(x), tuple(h.shape)) + h
    return layer.proj_out(ops.to_map(x, tuple(h.shape))) + h


def transformer_part_ends(attrs: Mapping[str, Any]) -> tuple[bool, bool]:
    """(first, last) of a ``transformer2d_part``: the first starts the model (GN, proj_in), the last ends it."""
    return (attrs["block"] == 0 and attrs["half"] == "self",
            attrs["block"] == attrs["num_layers"] - 1 and attrs["half"] == "cross")


def transformer2d_part(layer: Any, block: Any, ops: TensorOps, h: Any, shared: Mapping[str, Any]) -> Any:
    """One half of one of a ``Transformer2DModel``'s blocks (``split_transformers``,
    ``pulse.zoo.unet_blocks.transformer2d_parts``): ``block`` holds the half's submodules.

    Between parts the main path is cat[t, x] on the last axis, as (B, H, W, 2C): the block's tokens,
    then the model's input as tokens, which the last part's residual adds back. Tokens kept on their
    grid (a free reshape of (B, H W, C)), so that every part reads the grid from its input (an aspect
    bucket's, not the spec's). The layouts are permutations, so each step is ``transformer2d``'s on the
    same values and the parts compute exactly what the whole model does.
    """
    c, batch = layer.channels, h.shape[0]
    if layer.first:
        height, width = h.shape[2], h.shape[3]
        t = layer.norm(h)
        t = layer.proj_in(ops.to_tokens(t)) if layer.linear_projection else ops.to_tokens(layer.proj_in(t))
        x = ops.to_tokens(h)
    else:
        height, width = h.shape[1], h.shape[2]
        t, x = h[..., :c].reshape(batch, height * width, c), h[..., c:].reshape(batch, height * width, c)
    if layer.half == "self":
        t = t + block.attn1(block.norm1(t))
    else:
        t = t + block.attn2(block.norm2(t), need(shared, "context", layer.kind))
        t = t + block.ff(block.norm3(t))
    if not layer.last:
        return ops.cat([t.reshape(batch, height, width, c), x.reshape(batch, height, width, c)], -1)
    shape = (batch, c, height, width)
    if layer.linear_projection:
        return ops.to_map(layer.proj_out(t), shape) + ops.to_map(x, shape)
    return layer.proj_out(ops.to_map(t, shape)) + ops.to_map(x, shape)


def uvit_tokens(layer: Any, ops: TensorOps, h: Any, shared: Mapping[str, Any]) -> Any:
    """U-ViT's embedding: [label token, time token, patch tokens] + positions (B, N, D)."""
    x = layer.patch_embed(h)
    t = ops.batch_of(need(shared, "timesteps", layer.kind), h.shape[0])
    tokens = [ops.cast_like(ops.sinusoid(t, layer.dim, True), x)[:, None], x]
    if layer.label_emb is not None:
        tokens.insert(0, layer.label_emb(need(shared, "labels", layer.kind))[:, None])
    return ops.cat(tokens, 1) + layer.pos_embed


def hdit_conditions(layer: Any, ops: TensorOps, batch: int, shared: Mapping[str, Any]) -> dict[str, Any]:
    """Hunyuan-DiT's conditioning: {"c": (B, dim), "context": (B, L, clip_dim)}."""
    return {"c": _hdit_c(layer, ops, batch, shared), "context": _hdit_context(layer, ops, shared)}


def _hdit_context(layer: Any, ops: TensorOps, shared: Mapping[str, Any]) -> Any:
    """cat[CLIP, mlp_t5(mT5)], masked positions replaced by the learned padding."""
    kind = layer.kind
    text = ops.cat([need(shared, "text_clip", kind), layer.mlp_t5(need(shared, "text_t5", kind))], 1)
    mask = ops.cat([need(shared, "text_clip_mask", kind), need(shared, "text_t5_mask", kind)], -1)
    return ops.where_valid(mask, text, layer.text_embedding_padding)


def _hdit_c(layer: Any, ops: TensorOps, batch: int, shared: Mapping[str, Any]) -> Any:
    """t_embedder(t) + extra_embedder(cat[pool(mT5), size sinusoids, style])."""
    kind = layer.kind
    t = ops.batch_of(need(shared, "timesteps", kind), batch)
    extra = [layer.pooler(need(shared, "text_t5", kind))]
    if layer.size_cond:
        sizes = need(shared, "image_meta_size", kind)
        extra.append(ops.cast_like(ops.sinusoid(sizes.reshape(-1), layer.freq_dim, True), extra[0]).reshape(batch, -1))
    if layer.style_embedder is not None:
        extra.append(layer.style_embedder(need(shared, "style", kind)))
    return layer.t_embedder(t) + layer.extra_embedder(ops.cat(extra, 1))
