"""What a pipeline's frozen encoders make for its backbone, and under which input names it reads them.

::

    SD 1.x / 2.x (unet/):       text_encoder ─ encoder_hidden_states (L, D), attention_mask (L)
                                model input "context" ◀─ encoder_hidden_states
    Hunyuan-DiT (transformer/): text_encoder (CLIP/BERT, 77 tokens)  ─ text_clip, text_clip_mask
                                text_encoder_2 (mT5, 256 tokens)     ─ text_t5, text_t5_mask
                                per image: image_meta_size (original h, w, target h, w, crop top, left), style 0
                                model inputs of the same names
    SDXL (unet/, text_time):    text_encoder (CLIPTextModel)      ─ hidden_states[-2] (L, D1) ┐ concatenated:
                                text_encoder_2 (…WithProjection)  ─ hidden_states[-2] (L, D2) ┘ prompt_embeds
                                                                  ─ text_embeds (pooled, projected) (P)
                                per image: time_ids (original h, w, crop top, left, target h, w)
                                model inputs "context" ◀─ prompt_embeds, "text_embeds", "time_ids"

As the pipelines' own ``encode_prompt`` does: SD's and SDXL's text encoders see
the padded ids without a mask (``train_text_to_image.py``,
``train_text_to_image_sdxl.py``); Hunyuan-DiT's encoders get the attention
mask, and the masks go to the model. Framework-free:
``pulse_torch.pipeline.encode`` runs it, the cache and training read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pulse.data.pipeline_folder import PipelineError, PipelineFolder, part_config, resolution_of
from pulse.zoo.unet_blocks import ATTENTION_KINDS

IMAGE_META = "image_meta_size"
STYLE = "style"
TIME_IDS = "time_ids"
PENULTIMATE = -2  # hidden_states[-2]: the layer SDXL reads of both text encoders

if TYPE_CHECKING:
    from pulse.encoders import Encoder


@dataclass(frozen=True)
class TextEncoding:
    """One text encoder's output arrays. Encodings naming the same ``hidden`` array are concatenated on
    the feature axis, in recipe order (SDXL's prompt_embeds)."""

    index: int  # folder.text_encoders[index] with folder.tokenizers[index]
    hidden: str  # (L, D) float32 array
    mask: str | None  # (L,) int64 array: the tokenizer's attention mask (None: not kept)
    max_length: int | None  # tokens (None: the tokenizer's model_max_length)
    pass_mask: bool  # the encoder sees the mask (Hunyuan-DiT) or only padded ids (SD, SDXL)
    hidden_layer: int | None = None  # None: the output's first entry (last_hidden_state); else hidden_states[i]
    pooled: str | None = None  # (P,) float32 array: the output's first entry, projected and pooled (SDXL)


@dataclass(frozen=True)
class EncodingRecipe:
    texts: tuple[TextEncoding, ...]
    inputs: dict[str, str] = field(default_factory=dict)  # model input -> array name
    image_meta: bool = False  # per-image image_meta_size and style arrays (Hunyuan-DiT v1.1)
    time_ids: bool = False  # per-image SDXL add_time_ids (original size, crop top-left, target size)

    @property
    def text_arrays(self) -> tuple[str, ...]:
        """What encoding a caption makes (the empty prompt's arrays: what --caption-dropout replaces)."""
        names = [n for t in self.texts for n in (t.hidden, t.mask, t.pooled) if n is not None]
        return tuple(dict.fromkeys(names))

    @property
    def arrays(self) -> tuple[str, ...]:
        """Every array a shard holds, the latents first."""
        sizes = (IMAGE_META, STYLE) if self.image_meta else (TIME_IDS,) if self.time_ids else ()
        return ("latents", *self.text_arrays, *sizes)


SD_RECIPE = EncodingRecipe((TextEncoding(0, "encoder_hidden_states", "attention_mask", None, False),),
                           {"context": "encoder_hidden_states"})
# train_text_to_image_sdxl.py's encode_prompt: both encoders' penultimate states, text_encoder_2's pooled output
SDXL_RECIPE = EncodingRecipe((TextEncoding(0, "prompt_embeds", None, None, False, PENULTIMATE),
                              TextEncoding(1, "prompt_embeds", None, None, False, PENULTIMATE, "text_embeds")),
                             {"context": "prompt_embeds", "text_embeds": "text_embeds", TIME_IDS: TIME_IDS},
                             time_ids=True)


def is_sdxl(folder: PipelineFolder) -> bool:
    """Is the backbone an SDXL UNet (``addition_embed_type="text_time"``)?"""
    return folder.backbone_name == "unet" and part_config(folder.backbone).get("addition_embed_type") == "text_time"


def _sdxl_recipe(folder: PipelineFolder) -> EncodingRecipe:
    """SDXL base: text_encoder/ and text_encoder_2/ with both tokenizers; a refiner (text_encoder_2 only)
    is one line."""
    names = [p.name for p in folder.text_encoders], [p.name for p in folder.tokenizers]
    if names != (["text_encoder", "text_encoder_2"], ["tokenizer", "tokenizer_2"]):
        raise PipelineError(f"{folder.root}: an SDXL UNet with text encoders {names[0]} and tokenizers {names[1]}: "
                            "encoding supports SDXL base pipelines (text_encoder/ + text_encoder_2/, tokenizer/ + "
                            "tokenizer_2/), not the refiner")
    return SDXL_RECIPE


def recipe_for(folder: PipelineFolder) -> EncodingRecipe:
    """The recipe of the folder's backbone: a UNet with one text encoder (SD), an SDXL UNet with two,
    or a Hunyuan-DiT with two."""
    config = part_config(folder.backbone)
    kind = config.get("_class_name")
    if is_sdxl(folder):
        return _sdxl_recipe(folder)
    if folder.backbone_name == "unet" and len(folder.text_encoders) == 1:
        return SD_RECIPE
    if kind == "HunyuanDiT2DModel" and len(folder.text_encoders) == 2 and len(folder.tokenizers) == 2:
        texts = (TextEncoding(0, "text_clip", "text_clip_mask", int(config.get("text_len", 77)), True),
                 TextEncoding(1, "text_t5", "text_t5_mask", int(config.get("text_len_t5", 256)), True))
        meta = bool(config.get("use_style_cond_and_image_meta_size", True))
        names = [n for t in texts for n in (t.hidden, t.mask)] + ([IMAGE_META, STYLE] if meta else [])
        return EncodingRecipe(texts, {n: n for n in names}, meta)
    raise PipelineError(f"{folder.root}: encoding supports UNet pipelines with one text encoder (SD 1.x / 2.x), SDXL "
                        f"and Hunyuan-DiT with two; this one has {folder.backbone_name}/ ({kind}) and "
                        f"{len(folder.text_encoders)} text encoder(s)")


def image_meta(original: tuple[int, int], resolution: int) -> list[float]:
    """Hunyuan-DiT's size condition of one image: original (h, w), target (h, w), crop (top, left).

    The crop is ``load_image``'s: the shorter side resized to ``resolution``, then center-cropped.
    """
    h, w = original
    scale = resolution / min(w, h)
    rw, rh = max(resolution, round(w * scale)), max(resolution, round(h * scale))
    return [float(h), float(w), float(resolution), float(resolution), float((rh - resolution) // 2),
            float((rw - resolution) // 2)]


def sdxl_time_ids(original: tuple[int, int], resolution: int) -> list[float]:
    """SDXL's add_time_ids of one image, as ``train_text_to_image_sdxl.py`` builds them: original (h, w),
    the crop's (top, left), target (h, w). The crop is the one ``load_image`` takes (``image_meta``'s):
    the shorter side resized to ``resolution``, then center-cropped; a flip does not change it."""
    h, w, _, _, top, left = image_meta(original, resolution)
    return [h, w, top, left, float(resolution), float(resolution)]


def pipeline_encoders(folder: PipelineFolder) -> tuple["Encoder", ...]:
    """The frozen encoders of an SD-style or SDXL pipeline folder as plan tasks (``pulse.encoders``),
    counted from its own configs (the zoo's figures would be another model): its text encoder(s) feeding
    the UNet's ``context`` (SDXL: both as one task, which also makes ``text_embeds`` and ``time_ids``),
    its VAE encoder feeding the first layer."""
    from pulse.zoo.encoders import vae_encoder

    recipe = recipe_for(folder)
    if recipe is not SD_RECIPE and recipe is not SDXL_RECIPE:
        raise PipelineError(f"{folder.root}: encoders in the pipeline (--encoders before|bubbles) support SD-style "
                            "and SDXL UNet pipelines; cache this one with `pulse cache-latents` (--encoders cached)")
    vae = part_config(folder.vae)
    resolution, _ = resolution_of(folder)
    names = ", ".join(f"{p.name}/config.json" for p in (*folder.text_encoders, folder.vae))
    source = f"{folder.root}: {names}"
    text = _text_task(folder, recipe, source)
    return (text, vae_encoder("vae", resolution=resolution, channels=tuple(int(c) for c in vae["block_out_channels"]),
                              per_block=int(vae.get("layers_per_block", 2)),
                              latent_channels=int(vae.get("latent_channels", 4)), source=source))


def _text_task(folder: PipelineFolder, recipe: EncodingRecipe, source: str) -> "Encoder":
    """SD: the text encoder feeding ``context``. SDXL: both text encoders as one task (``SDXL_TEXT_FEEDS``):
    text_encoder_2's pooled output and the image's time ids come out of the same encode as the context."""
    from pulse.zoo.encoders import SDXL_TIME_IDS, paired_text_encoder, transformer_encoder

    towers = []
    for index in range(len(recipe.texts)):
        config = part_config(folder.text_encoders[index])
        tokens = int(part_config(folder.tokenizers[index], "tokenizer_config.json").get("model_max_length", 77))
        towers.append(transformer_encoder(
            "text", layers=int(config["num_hidden_layers"]), width=int(config["hidden_size"]),
            ffn=int(config["intermediate_size"]), tokens=tokens, vocab=int(config["vocab_size"]),
            positions=int(config.get("max_position_embeddings", tokens)), gated=False, feeds="context",
            readers=ATTENTION_KINDS, source=source))
    if recipe is SD_RECIPE:
        return towers[0]
    second = part_config(folder.text_encoders[1])
    return paired_text_encoder("text", *towers, width=int(second["hidden_size"]),
                               projection=int(second["projection_dim"]), time_ids=SDXL_TIME_IDS, source=source)
