"""A tiny offline Stable Diffusion XL pipeline for tests and the SDXL benchmark (nothing downloaded).

::

    tiny_sdxl_pipeline(dir)   StableDiffusionXLPipeline(...).save_pretrained(dir)
        unet/            addition_embed_type "text_time": channels (32, 64), transformer depths (1, 2),
                         cross-attention 64 = text_encoder 32 + text_encoder_2 32, pooled 32 + 6 time ids x 8
        vae/             pipeline_helpers.VAE: scale factor 2, 16x16 RGB images -> 4 x 8 x 8 latents
        text_encoder/    CLIPTextModel, 2 layers of width 32 (SDXL reads its penultimate hidden states)
        text_encoder_2/  CLIPTextModelWithProjection, 2 layers of width 32, projection 32 (the pooled text_embeds)
        tokenizer/, tokenizer_2/  CLIP BPE tokenizers over pipeline_helpers.WORDS, 77 tokens (the second pads
                         with "!" as SDXL's does)
        scheduler/       EulerDiscreteScheduler, scaled_linear betas (SDXL's)

Weights are random (seeded): building and saving takes about a second.
"""
from __future__ import annotations

from pathlib import Path

from pipeline_helpers import TEXT, VAE, write_tokenizer_files

PER_ID, POOLED = 8, 32  # sinusoid width per time id; text_encoder_2's projection (the pooled text_embeds)
SDXL_UNET = dict(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=64,
                 attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=PER_ID,
                 projection_class_embeddings_input_dim=POOLED + 6 * PER_ID, norm_num_groups=8)
SDXL_RESOLUTION = 16  # UNet sample_size 8 x VAE scale factor 2
SDXL_INPUTS = ("context", "text_embeds", "time_ids")  # what the UNet reads besides the noised latents


def tiny_sdxl_pipeline(folder: Path, seed: int = 0):
    """Build, save and return a tiny ``StableDiffusionXLPipeline`` at ``folder``."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(seed)
    folder = Path(folder)
    vocab, merges = write_tokenizer_files(folder / "_tokenizer_src")
    tokenizer = CLIPTokenizer(str(vocab), str(merges), pad_token="<|padding|>", model_max_length=77)
    tokenizer_2 = CLIPTokenizer(str(vocab), str(merges), pad_token="!", model_max_length=77)
    config = {**TEXT, "vocab_size": len(tokenizer_2), "projection_dim": POOLED}  # "!" is one token more
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=AutoencoderKL(**VAE), text_encoder=CLIPTextModel(CLIPTextConfig(**config)),
                                     text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**config)),
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                     unet=UNet2DConditionModel(**SDXL_UNET), scheduler=scheduler,
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(folder)
    for f in (vocab, merges):
        f.unlink()
    vocab.parent.rmdir()
    return pipe


def sdxl_fixture(tmp_path_factory):
    """A session's tiny SDXL pipeline folder (use as ``pytest.fixture(scope="session")(sdxl_fixture)``)."""
    folder = tmp_path_factory.getbasetemp() / "tiny-sdxl-pipeline"
    if not (folder / "model_index.json").is_file():
        tiny_sdxl_pipeline(folder)
    return folder
