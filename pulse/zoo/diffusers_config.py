"""A diffusers model's ``config.json`` as a zoo spec, without importing diffusers or torch.

::

    <folder>/config.json ─json─▶ dict ─┬─ UNet2DConditionModel ─▶ UNetConfig ───────▶ build_unet
                                       └─ HunyuanDiT2DModel ────▶ HunyuanDiTConfig ─▶ build_hunyuan_dit
                                                                                          │
                                       attrs patched to the config's own choices ◀─────────┘
                                       (projection kind, sinusoid flags, module paths)

The zoo builders take architecture hyper-parameters, and a diffusers config
is exactly that, so planning a user's model needs only its config: the
torch side (``pulse_torch.diffusers_adapter``) adds the chunk modules over
the real model and checks every layer's parameter count against it.

SDXL's UNet maps too: ``addition_embed_type="text_time"`` becomes the data
inputs "text_embeds" and "time_ids" its time_embed layer reads, and
``transformer_layers_per_block`` one count per level. A config the zoo's
layer vocabulary cannot express (other block types, class embeddings, other
addition embeddings, extra attention variants) raises one
``UnsupportedDiffusersModel`` naming the block or field, never a spec that
silently differs from the model. Options (``--model-option``): ``resolution``
in pixels (latent = resolution / 8; default the config's ``sample_size``),
``name``, and ``context_len`` (UNet: text tokens, not in the config: read from
the pipeline the UNet sits in, ``pipeline_text_tokens``, else 77 = CLIP; the
option overrides both), ``split_resnets`` (UNet: each ResnetBlock2D as two layers, default off) and
``split_transformers`` (UNet: each Transformer2DModel as two layers per transformer block, default off),
or ``split_blocks`` (Hunyuan-DiT, default on).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from pulse.errors import SpecError
from pulse.spec import Layer, ModelSpec
from pulse.zoo.common import with_options
from pulse.zoo.dit import HunyuanDiTConfig, build_hunyuan_dit
from pulse.zoo.unet import UNetConfig, build_unet
from pulse.zoo.unet_blocks import ATTENTION_KINDS

PREFIX = "diffusers:"  # how a plan names a diffusers model: "diffusers:<folder or config.json>"
UNET = "UNet2DConditionModel"
HUNYUAN_DIT = "HunyuanDiT2DModel"
# Sub-folders a diffusers pipeline keeps its denoiser in: named after the repository instead.
_COMPONENT_DIRS = {"unet", "transformer"}
_UNET_OPTIONS = {"resolution", "name", "context_len", "split_resnets", "split_transformers"}
_DIT_OPTIONS = {"resolution", "name", "split_blocks"}


class UnsupportedDiffusersModel(SpecError):
    """A diffusers model PULSE cannot map onto its layers and skips (names the block or field)."""


def _unsupported(cls: str, what: str) -> UnsupportedDiffusersModel:
    return UnsupportedDiffusersModel(f"diffusers {cls}: {what}; PULSE cannot map this model's layers "
                                     "and skips (see docs/DIFFUSERS.md for what is supported)")


# -- reading ----------------------------------------------------------------------------
def config_path(path: str | Path) -> Path:
    """``path`` itself if a file, else ``path/config.json``."""
    path = Path(path).expanduser()
    return path / "config.json" if path.is_dir() else path


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a model folder's ``config.json`` (or of a config file)."""
    file = config_path(path)
    if not file.is_file():
        raise SpecError(f"diffusers model: no file '{file}' (give a local model folder or its config.json)")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{file}: not a readable JSON config ({exc})") from None
    if not isinstance(data, dict) or "_class_name" not in data:
        raise SpecError(f"{file}: not a diffusers model config (no '_class_name' key)")
    return data


def is_diffusers_model(name: str) -> bool:
    """Whether a ``--model`` value names a diffusers model rather than a zoo entry or spec file."""
    if name.startswith(PREFIX):
        return True
    path = Path(name)
    if path.is_dir():
        return (path / "config.json").is_file()
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        return "_class_name" in json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def default_name(path: str | Path) -> str:
    """A spec name from the folder: ``stable-diffusion-2/unet`` -> ``stable-diffusion-2-unet``."""
    path = Path(path).expanduser()
    path = path.resolve() if path.exists() else path
    folder = path.parent if path.suffix == ".json" else path  # also for a Hub id a model was loaded from
    if folder.name in _COMPONENT_DIRS and folder.parent.name:
        return f"{folder.parent.name}-{folder.name}"
    return folder.name or "diffusers-model"


def spec_from_path(path: str | Path, **options: Any) -> ModelSpec:
    """The spec of the diffusers model whose folder (or config.json) is ``path``."""
    path = str(path)[len(PREFIX):] if str(path).startswith(PREFIX) else path
    config = read_config(path)
    return spec_from_config(config, source=f"diffusers {config['_class_name']} config {config_path(path)}",
                            base_name=default_name(path), text_tokens=pipeline_text_tokens(path), **options)


_TOKEN_LIMIT = 1_000_000  # transformers writes model_max_length 1e30 (VERY_LARGE_INTEGER) when a tokenizer has none


def pipeline_text_tokens(path: str | Path) -> int | None:
    """The caption length of the pipeline a model folder sits in (``<pipeline>/unet``): its
    ``tokenizer/tokenizer_config.json`` model_max_length (what encoding pads to), else its
    ``text_encoder/config.json`` max_position_embeddings; None outside a pipeline or where neither says."""
    folder = config_path(path).parent
    root = folder.parent
    if folder.name not in _COMPONENT_DIRS or not (root / "model_index.json").is_file():
        return None
    for file, key in (("tokenizer/tokenizer_config.json", "model_max_length"),
                      ("text_encoder/config.json", "max_position_embeddings")):
        try:
            value = json.loads((root / file).read_text()).get(key)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _TOKEN_LIMIT:
            return value
    return None


# -- mapping --------------------------------------------------------------------------------
def spec_from_config(config: Mapping[str, Any], class_name: str | None = None, *, source: str = "",
                     base_name: str | None = None, text_tokens: int | None = None, **options: Any) -> ModelSpec:
    """The spec of a ``UNet2DConditionModel`` or ``HunyuanDiT2DModel`` config dict.

    ``base_name`` (default ``diffusers-unet`` / ``diffusers-hunyuan-dit``) is suffixed with a non-default resolution (as zoo names
    are); an explicit ``name`` option is taken as it is. ``text_tokens``: the UNet's caption length
    when the pipeline says it (``pipeline_text_tokens``); a ``context_len`` option overrides it.
    """
    cls = class_name or str(config.get("_class_name", ""))
    if cls == UNET:
        if text_tokens is not None:
            options = {"context_len": text_tokens, **options}
        cfg = _with(unet_config(config, options), options, _UNET_OPTIONS, cls, base_name)
        return _patch_unet(build_unet(cfg), config, source)
    if cls == HUNYUAN_DIT:
        cfg = _with(hunyuan_config(config, options), options, _DIT_OPTIONS, cls, base_name)
        return _patch_hunyuan(build_hunyuan_dit(cfg), source)
    raise UnsupportedDiffusersModel(f"diffusers model class '{cls or '?'}' is not supported "
                                    f"(supported: {UNET}, {HUNYUAN_DIT})")


def _with(cfg: Any, options: Mapping[str, Any], allowed: set[str], cls: str, base_name: str | None) -> Any:
    """``cfg`` with the options applied by the zoo's own ``with_options`` (all are config fields or resolution)."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise SpecError(f"diffusers {cls}: unknown option '{unknown[0]}' (allowed: {', '.join(sorted(allowed))})")
    if base_name:
        cfg = replace(cfg, name=base_name)
    return with_options(cfg, dict(options), base_name or cls)


def _latent_size(cls: str, config: Mapping[str, Any], options: Mapping[str, Any]) -> int:
    """Square latents only: ``sample_size`` (int or [h, w]); ``resolution`` overrides it later."""
    size = config.get("sample_size")
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise _unsupported(cls, f"sample_size {list(size)} is not square")
        size = size[0]
    if size is None:
        if "resolution" not in options:
            raise SpecError(f"diffusers {cls}: the config has no sample_size; pass resolution=<pixels>")
        return 1  # replaced by the resolution option
    return int(size)


def _per_level(cls: str, field: str, value: Any, levels: int) -> tuple:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * levels
    if len(values) != levels:
        raise _unsupported(cls, f"{field} has {len(values)} entries for {levels} levels")
    return values


def _one_value(cls: str, field: str, value: Any, levels: int) -> Any:
    """A per-level field the zoo keeps as one number (PULSE's UNet has one value for all levels)."""
    values = set(_per_level(cls, field, value, levels))
    if len(values) != 1:
        raise _unsupported(cls, f"{field}={list(value)} differs between levels")
    return values.pop()


# Fields whose non-default value adds parameters, inputs or layers the UNet spec has no place for.
_UNET_DEFAULTS: dict[str, Any] = {
    "class_embed_type": None, "num_class_embeds": None,
    "time_cond_proj_dim": None, "encoder_hid_dim": None, "encoder_hid_dim_type": None,
    "attention_type": "default", "dual_cross_attention": False, "cross_attention_norm": None,
    "resnet_time_scale_shift": "default", "time_embedding_type": "positional",
    "reverse_transformer_layers_per_block": None, "conv_in_kernel": 3, "conv_out_kernel": 3,
    "downsample_padding": 1, "act_fn": "silu", "mid_block_only_cross_attention": None,
}
_DOWN = {"CrossAttnDownBlock2D": True, "DownBlock2D": False}
_UP = {"CrossAttnUpBlock2D": True, "UpBlock2D": False}
_MID = "UNetMidBlock2DCrossAttn"


def _check_unet_fields(config: Mapping[str, Any]) -> None:
    for key, default in _UNET_DEFAULTS.items():
        value = config.get(key, default)
        if value != default and not (default is None and value is False):
            raise _unsupported(UNET, f"{key}={value!r} is not supported (only {default!r})")
    only_cross = config.get("only_cross_attention", False)
    if any(only_cross if isinstance(only_cross, (list, tuple)) else (only_cross,)):
        raise _unsupported(UNET, "only_cross_attention is not supported")
    mid = config.get("mid_block_type", _MID)
    if mid != _MID:
        raise _unsupported(UNET, f"mid_block is {mid!r} (only {_MID!r})")
    if config.get("norm_num_groups", 32) is None:
        raise _unsupported(UNET, "norm_num_groups=None (no GroupNorm before conv_out)")


def _unet_levels(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """Per encoder level: cross-attention or not, with the decoder mirroring the encoder."""
    down = list(config.get("down_block_types") or ())
    up = list(config.get("up_block_types") or ())
    for i, kind in enumerate(down):
        if kind not in _DOWN:
            raise _unsupported(UNET, f"down_blocks.{i} is {kind!r} (only {', '.join(_DOWN)})")
    for k, kind in enumerate(up):
        if kind not in _UP:
            raise _unsupported(UNET, f"up_blocks.{k} is {kind!r} (only {', '.join(_UP)})")
    if len(up) != len(down) or not down:
        raise _unsupported(UNET, f"{len(down)} down blocks but {len(up)} up blocks")
    cross = tuple(_DOWN[kind] for kind in down)
    for k, kind in enumerate(up):
        if _UP[kind] != cross[len(down) - 1 - k]:
            raise _unsupported(UNET, f"up_blocks.{k} is {kind!r} but mirrors down_blocks.{len(down) - 1 - k} "
                                     f"({down[len(down) - 1 - k]!r}): attention must be symmetric")
    return cross


def unet_config(config: Mapping[str, Any], options: Mapping[str, Any]) -> UNetConfig:
    """``UNet2DConditionModel`` hyper-parameters as the zoo's ``UNetConfig``."""
    _check_unet_fields(config)
    cross = _unet_levels(config)
    levels = len(cross)
    channels = tuple(int(c) for c in config["block_out_channels"])
    if len(channels) != levels:
        raise _unsupported(UNET, f"{len(channels)} block_out_channels for {levels} blocks")
    depths = _transformer_layers(config, levels)
    # diffusers' historic naming: attention_head_dim is the head count unless num_attention_heads is set.
    heads = _per_level(UNET, "num_attention_heads",
                       config.get("num_attention_heads") or config.get("attention_head_dim", 8), levels)
    # Levels without attention never use their head count (the last one feeds the mid block).
    heads = tuple(int(h) if cross[i] or i == levels - 1 else 1 for i, h in enumerate(heads))
    return UNetConfig(
        name="diffusers-unet", latent_size=_latent_size(UNET, config, options), block_channels=channels,
        cross_attn=cross, heads=heads,
        layers_per_block=int(_one_value(UNET, "layers_per_block", config.get("layers_per_block", 2), levels)),
        context_dim=int(_one_value(UNET, "cross_attention_dim", config.get("cross_attention_dim", 1280), levels)),
        context_len=77, norm_groups=int(config.get("norm_num_groups", 32)),
        temb_dim=int(config.get("time_embedding_dim") or 4 * channels[0]),
        in_channels=int(config.get("in_channels", 4)), out_channels=int(config.get("out_channels", 4)),
        norm_eps=float(config.get("norm_eps", 1e-5)), transformer_layers=depths if set(depths) != {1} else (),
        **_added_text_time(config), source="diffusers UNet2DConditionModel config")


def _transformer_layers(config: Mapping[str, Any], levels: int) -> tuple[int, ...]:
    """Blocks per attention per level: an int or one per level (SDXL's [1, 2, 10]), not per block."""
    depths = _per_level(UNET, "transformer_layers_per_block", config.get("transformer_layers_per_block", 1), levels)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in depths):
        raise _unsupported(UNET, f"transformer_layers_per_block={list(depths)} (one count >= 1 per level, "
                                 "not per block)")
    return tuple(depths)


_TIME_IDS = 6  # SDXL base's add_time_ids: original (h, w), crop (top, left), target (h, w)


def _added_text_time(config: Mapping[str, Any]) -> dict[str, int]:
    """SDXL's addition_embed_type="text_time" as UNetConfig fields ({} for none).

    The config gives the projection's input width only; the pooled text width is what is left
    after the six time ids (SDXL base: 2816 = 1280 + 6 x 256). The refiner's five (aesthetic
    score instead of the target size) would be read as a wrong pooled width, so a width that
    leaves none is refused here and a mismatch fails the adapter's forward.
    """
    kind = config.get("addition_embed_type")
    if kind in (None, False):
        return {}
    if kind != "text_time":
        raise _unsupported(UNET, f"addition_embed_type={kind!r} is not supported (only None or 'text_time')")
    per_id, total = config.get("addition_time_embed_dim"), config.get("projection_class_embeddings_input_dim")
    if not isinstance(per_id, int) or not isinstance(total, int) or total - _TIME_IDS * per_id <= 0:
        raise _unsupported(UNET, f"addition_embed_type='text_time' with addition_time_embed_dim={per_id!r} and "
                                 f"projection_class_embeddings_input_dim={total!r} (need {_TIME_IDS} time ids "
                                 "plus a pooled text width)")
    return {"text_embeds_dim": total - _TIME_IDS * per_id, "addition_time_embed_dim": per_id,
            "time_ids": _TIME_IDS}


def hunyuan_config(config: Mapping[str, Any], options: Mapping[str, Any]) -> HunyuanDiTConfig:
    """``HunyuanDiT2DModel`` hyper-parameters as the zoo's ``HunyuanDiTConfig`` (v1.1 or v1.2 conditioning)."""
    cls = HUNYUAN_DIT
    if config.get("norm_type", "layer_norm") != "layer_norm":
        raise _unsupported(cls, f"norm_type={config['norm_type']!r} (only 'layer_norm')")
    if config.get("activation_fn", "gelu-approximate") != "gelu-approximate":
        raise _unsupported(cls, f"blocks' activation_fn={config['activation_fn']!r} (only 'gelu-approximate')")
    heads, head_dim = int(config.get("num_attention_heads", 16)), int(config.get("attention_head_dim", 88))
    dim = int(config.get("hidden_size", 1152))
    if dim != heads * head_dim:
        raise _unsupported(cls, f"hidden_size {dim} != num_attention_heads x attention_head_dim "
                                f"({heads} x {head_dim}): the blocks and the embeddings would disagree")
    depth = int(config.get("num_layers", 28))
    if depth < 4 or depth % 2:  # odd depths > 1 break diffusers' own skip stack; 1 or 2 blocks have no skip
        raise _unsupported(cls, f"num_layers={depth} (PULSE maps an even number of blocks, at least 4)")
    for key in ("in_channels", "patch_size"):
        if config.get(key) is None:
            raise SpecError(f"diffusers {cls}: the config lacks '{key}'")
    conditioned = bool(config.get("use_style_cond_and_image_meta_size", True))
    return HunyuanDiTConfig(
        name="diffusers-hunyuan-dit", latent_size=_latent_size(cls, config, options), dim=dim,
        depth=depth, heads=heads, mlp_ratio=float(config.get("mlp_ratio", 4.0)),
        in_channels=int(config["in_channels"]), patch=int(config["patch_size"]),
        learn_sigma=bool(config.get("learn_sigma", True)), clip_dim=int(config.get("cross_attention_dim", 1024)),
        clip_len=int(config.get("text_len", 77)), t5_dim=int(config.get("cross_attention_dim_t5", 2048)),
        t5_len=int(config.get("text_len_t5", 256)), pooled_dim=int(config.get("pooled_projection_dim", 1024)),
        pooler_heads=8, freq_dim=256,  # fixed inside diffusers' HunyuanCombinedTimestepTextSizeStyleEmbedding
        size_cond=conditioned, style_cond=conditioned, source="diffusers HunyuanDiT2DModel config")


# -- attrs: what the zoo builders fix, as this config has it -------------------------------------------
def _attrs(layer: Layer, **changes: Any) -> Layer:
    return replace(layer, attrs={**layer.attrs, **changes})


def _meta(spec: ModelSpec, cls: str, source: str) -> dict:
    return {**spec.meta, "source": source or spec.meta.get("source", ""), "diffusers_class": cls}


def _patch_unet(spec: ModelSpec, config: Mapping[str, Any], source: str) -> ModelSpec:
    """Sinusoid flags and projection kind as configured (the zoo's are SD2's)."""
    linear = bool(config.get("use_linear_projection", False))
    layers = []
    for layer in spec.layers:
        if layer.kind == "time_embed":  # add_time_proj is built with the same flags
            layer = _attrs(layer, flip_sin_to_cos=bool(config.get("flip_sin_to_cos", True)),
                           freq_shift=float(config.get("freq_shift", 0)))
        elif layer.kind in ATTENTION_KINDS:
            layer = _attrs(layer, linear_projection=linear)
        layers.append(layer)
    return replace(spec, layers=tuple(layers), meta=_meta(spec, UNET, source))


# The zoo names Tencent's module paths; diffusers names them differently.
_HUNYUAN_REFS = {"hdit_cond_embed": "time_extra_emb,text_embedder,text_embedding_padding",
                 "hdit_patch_embed": "pos_embed", "hdit_final": "norm_out,proj_out"}


def _patch_hunyuan(spec: ModelSpec, source: str) -> ModelSpec:
    layers = tuple(_attrs(l, ref_module=_HUNYUAN_REFS[l.kind]) if l.kind in _HUNYUAN_REFS else l
                   for l in spec.layers)
    return replace(spec, layers=layers, meta=_meta(spec, HUNYUAN_DIT, source))
