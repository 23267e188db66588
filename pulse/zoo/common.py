"""Counting helpers shared by the zoo builders: parameters, FLOPs, bytes.

Conventions (one place, so every model counts the same way):

* FLOPs are forward FLOPs per sample of the matrix products only: convolutions,
  linear layers and the two attention products (Q K^T and A V). A multiply-add
  is 2 FLOPs. Norms, activations, softmax, bias and residual adds are left out:
  they are memory-bound and well under 1% of these models' FLOPs.
* Sizes are counted in elements here and turned into bytes at ``ACT_BYTES``
  (fp16) by ``make_layer``.
* ``saved`` counts the tensors PyTorch autograd keeps for backward: the input of
  every conv / linear / norm / activation, and q, k, v and the output of
  attention computed flash-style (the N x N score matrix is never stored;
  its per-row log-sum-exp is negligible and not counted).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from pulse.errors import SpecError
from pulse.spec import Layer

ACT_BYTES = 2  # fp16 activations: the precision every zoo spec is stated at
BLOCK_NAME_OPTIONS = ("split_resnets", "split_transformers")  # true, false, or the blocks to cut in two


def conv_params(cin: int, cout: int, k: int, bias: bool = True) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def conv_flops(cin: int, cout: int, k: int, h_out: int, w_out: int) -> int:
    return 2 * cin * cout * k * k * h_out * w_out


def linear_params(fin: int, fout: int, bias: bool = True) -> int:
    return fin * fout + (fout if bias else 0)


def linear_flops(fin: int, fout: int, tokens: int = 1) -> int:
    return 2 * fin * fout * tokens


def norm_params(channels: int, affine: bool = True) -> int:
    """GroupNorm or LayerNorm: a weight and a bias per channel when affine."""
    return 2 * channels if affine else 0


def attention_flops(q_tokens: int, kv_tokens: int, inner_dim: int) -> int:
    """Q K^T plus A V over all heads (heads * head_dim = inner_dim)."""
    return 2 * 2 * q_tokens * kv_tokens * inner_dim


def make_layer(name: str, kind: str, params: int, flops: int, out_elems: int,
               saved_elems: int, attrs: dict[str, Any]) -> Layer:
    """A Layer with element counts turned into fp16 bytes."""
    return Layer(name=name, kind=kind, params=int(params), flops=float(flops),
                 out_bytes=int(out_elems) * ACT_BYTES, saved_bytes=int(saved_elems) * ACT_BYTES,
                 attrs=dict(attrs))


def fuse_layers(name: str, kind: str, parts: list[Layer]) -> Layer:
    """Consecutive layers run as one: sizes summed, the last part's output, attrs merged.

    ``split_blocks=False`` builds each transformer block this way from its two
    halves, so the whole-block and the split counts agree by construction.
    """
    attrs: dict[str, Any] = {}
    for part in parts:
        attrs.update(part.attrs)
    return Layer(name=name, kind=kind, params=sum(p.params for p in parts),
                 flops=float(sum(p.flops for p in parts)), out_bytes=parts[-1].out_bytes,
                 saved_bytes=sum(p.saved_bytes for p in parts), attrs=attrs)


def require(ok: bool, model: str, message: str) -> None:
    """Reject an inconsistent hyper-parameter set with one clear line."""
    if not ok:
        raise SpecError(f"model '{model}': {message}")


def with_options(config: Any, options: dict[str, Any], entry: str) -> Any:
    """``config`` (a frozen dataclass) with user options applied.

    Options are the config's own fields, plus ``resolution`` (image pixels)
    for configs with ``latent_size`` and ``vae_factor``: it sets the latent
    size and, when it differs from the default, suffixes the spec name
    (``sd2-unet`` at 768 px is ``sd2-unet-768``).
    """
    names = [f.name for f in fields(config)]
    options = dict(options)
    resolution = options.pop("resolution", None)
    unknown = sorted(set(options) - set(names))
    if unknown:
        allowed = ", ".join(sorted([n for n in names if n != "name"] + ["resolution"]))
        raise SpecError(f"zoo entry '{entry}': unknown option '{unknown[0]}' (allowed: {allowed})")
    for key in options:
        options[key] = (_block_names(options[key], key, entry) if key in BLOCK_NAME_OPTIONS
                        else _typed_option(options[key], getattr(config, key), key, entry))
    if resolution is not None:
        factor = config.vae_factor
        if not isinstance(resolution, int) or resolution <= 0 or resolution % factor:
            raise SpecError(f"zoo entry '{entry}': resolution must be a positive multiple of "
                            f"{factor} pixels, got {resolution!r}")
        default = config.latent_size * factor
        options.setdefault("latent_size", resolution // factor)
        if resolution != default:
            options.setdefault("name", f"{config.name}-{resolution}")
    return replace(config, **options)


def _block_names(value: Any, key: str, entry: str) -> bool | tuple[str, ...]:
    """A split option: true, false, or the blocks to split, as a list or as comma-separated text
    (``--model-option split_resnets=up1_res0,up2_res0``; the builder checks that each is a block)."""
    if isinstance(value, bool):
        return value
    names = value.split(",") if isinstance(value, str) else value
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) and n.strip() for n in names):
        return tuple(dict.fromkeys(n.strip() for n in names))
    raise SpecError(f"zoo entry '{entry}': option '{key}' must be true, false or block names "
                    f"(e.g. up1_res0,up2_attn1), got {value!r}")


def _typed_option(value: Any, default: Any, key: str, entry: str) -> Any:
    """``value`` of the same kind as the field's default (a tuple from a list), else SpecError.

    Whole numbers are sizes and counts, so >= 1 (``num_classes`` 0: no label
    token); other numbers (ratios, epsilons) positive and finite."""
    def fits(v: Any, d: Any) -> bool:
        if isinstance(d, bool):
            return isinstance(v, bool)
        if isinstance(d, int):  # a size or count: positive (num_classes 0 means no label token)
            return isinstance(v, int) and not isinstance(v, bool) and v >= (0 if key == "num_classes" else 1)
        if isinstance(d, float):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
        return isinstance(v, type(d))

    names = {bool: "true or false", int: "a whole number >= 1", float: "a positive number", str: "text"}
    plural = {bool: "booleans", int: "whole numbers >= 1", float: "positive numbers", str: "texts"}
    if key == "num_classes":
        names[int] = "a whole number >= 0"
    if isinstance(default, tuple):
        item = default[0] if default else None
        if isinstance(value, (list, tuple)) and all(item is None or fits(v, item) for v in value):
            return tuple(float(v) if isinstance(item, float) else v for v in value)
        what = f"a list of {plural.get(type(item), 'values')}"
    elif default is None or fits(value, default):
        return float(value) if isinstance(default, float) else value
    else:
        what = names.get(type(default), type(default).__name__)
    raise SpecError(f"zoo entry '{entry}': option '{key}' must be {what}, got {value!r}")


def config_meta(config: Any) -> dict[str, Any]:
    """The config as plain YAML-able data (tuples become lists)."""
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
