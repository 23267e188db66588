"""Tiny offline Stable-Diffusion-style pipelines and captioned image folders for tests (nothing downloaded).

::

    tiny_pipeline(dir)   StableDiffusionPipeline(unet, vae, text_encoder, tokenizer, scheduler).save_pretrained(dir)
                         UNet: block channels (32, 64), cross-attention 32, latent 8x8x4
                         VAE:  block channels (8, 16) -> scale factor 2: 16x16 RGB images
                         CLIP: 2 layers of width 32, 77 tokens; tokenizer from a vocab/merges written here
                         scheduler: DDPM, scaled_linear betas (as SD)
    image_folder(dir, n) n random RGB PNGs with captions (metadata.jsonl or .txt beside each image)

Weights are random (seeded): building and saving takes about a second.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

UNET = dict(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=8)
VAE = dict(block_out_channels=(8, 16), layers_per_block=1, in_channels=3, out_channels=3, latent_channels=4,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           norm_num_groups=4, sample_size=16)
TEXT = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
            max_position_embeddings=77, projection_dim=32, layer_norm_eps=1e-5, pad_token_id=1,
            bos_token_id=0, eos_token_id=2)
WORDS = ["a", "red", "blue", "green", "cat", "dog", "photo", "of", "the", "small", "big", "square"]
RESOLUTION = 16  # UNet sample_size 8 x VAE scale factor 2


def write_tokenizer_files(folder: Path) -> tuple[Path, Path]:
    """A CLIP BPE vocabulary of single letters, whole words and the merges that build them."""
    letters = sorted({c for w in WORDS for c in w})
    vocab = {"<|startoftext|>": 0, "<|padding|>": 1, "<|endoftext|>": 2}
    merges: list[str] = []
    for c in letters:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for word in WORDS:  # left-to-right merges: "c a", "ca t</w>"
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merge = f"{parts[0]} {parts[1]}"
            if merge not in merges:
                merges.append(merge)
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return folder / "vocab.json", folder / "merges.txt"


def tiny_pipeline(folder: Path, seed: int = 0, text: dict | None = None, vae: dict | None = None):
    """Build, save and return a tiny ``StableDiffusionPipeline`` at ``folder`` (``text``, ``vae``: config
    overrides, e.g. heavier encoders for a benchmark)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**UNET)
    vae = AutoencoderKL(**{**VAE, **(vae or {})})
    vocab, merges = write_tokenizer_files(Path(folder) / "_tokenizer_src")
    tokenizer = CLIPTokenizer(str(vocab), str(merges), pad_token="<|padding|>", model_max_length=77)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), **{**TEXT, **(text or {})}))
    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                              num_train_timesteps=1000, clip_sample=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(folder)
    for f in (vocab, merges):
        f.unlink()
    vocab.parent.rmdir()
    return pipe


HUNYUAN = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
               cross_attention_dim=32, cross_attention_dim_t5=16, pooled_projection_dim=8, hidden_size=16,
               text_len=77, text_len_t5=256, activation_fn="gelu-approximate")
# HunyuanDiTPipeline assumes a VAE scale factor of 8 (its rotary grid is height // 8): 4 blocks, 64 px images
HUNYUAN_VAE = {**VAE, "block_out_channels": (8, 8, 16, 16), "down_block_types": ("DownEncoderBlock2D",) * 4,
               "up_block_types": ("UpDecoderBlock2D",) * 4, "sample_size": 64}
HUNYUAN_RESOLUTION = 64


def tiny_hunyuan_pipeline(folder: Path, seed: int = 0):
    """Build, save and return a tiny ``HunyuanDiTPipeline``: BERT (77 tokens) + T5 encoder (256), v-prediction."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel, BertTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "_vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    size = len(WORDS) + 5
    bert = BertModel(BertConfig(vocab_size=size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=37, max_position_embeddings=128))
    t5 = T5EncoderModel(T5Config(vocab_size=size, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2))
    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.03, clip_sample=False,
                              prediction_type="v_prediction", steps_offset=1)
    pipe = HunyuanDiTPipeline(vae=AutoencoderKL(**HUNYUAN_VAE), text_encoder=bert,
                              tokenizer=BertTokenizer(str(vocab), model_max_length=77),
                              transformer=HunyuanDiT2DModel(**HUNYUAN), scheduler=scheduler, safety_checker=None,
                              feature_extractor=None, requires_safety_checker=False, text_encoder_2=t5,
                              tokenizer_2=BertTokenizer(str(vocab), model_max_length=256))
    vocab.unlink()
    pipe.save_pretrained(folder)
    return pipe


CAPTIONS = ["a red square", "a blue cat", "a photo of the green dog", "a small red cat", "the big blue dog",
            "a photo of a square"]


def image_folder(folder: Path, count: int = 4, size: int = 20, layout: str = "jsonl", seed: int = 0) -> Path:
    """``count`` random RGB PNGs of ``size`` px with captions: ``metadata.jsonl`` or a ``.txt`` per image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        name = f"img{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8)).save(folder / name)
        caption = CAPTIONS[i % len(CAPTIONS)]
        if layout == "jsonl":
            rows.append(json.dumps({"file_name": name, "text": caption}))
        else:
            (folder / name).with_suffix(".txt").write_text(caption + "\n")
    if rows:
        (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


# the tests that build a tiny pipeline need the whole PyTorch stack
torch_stack = pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                                     for m in ("torch", "diffusers", "transformers")),
                                 reason="needs torch, diffusers and transformers")


def pipeline_fixture(tmp_path_factory):
    """A session's tiny pipeline folder (use as ``pytest.fixture(scope="session")(pipeline_fixture)``)."""
    folder = tmp_path_factory.getbasetemp() / "tiny-sd-pipeline"
    if not (folder / "model_index.json").is_file():
        tiny_pipeline(folder)
    return folder


class TableComm:
    """The manifest's all-reduce for ranks saved one after another in one process (rank 0 last sees the sum)."""

    def __init__(self) -> None:
        self.total = None

    def all_reduce(self, t, group, timeout=None):
        self.total = t.clone() if self.total is None else self.total + t
        return self.total.clone()
