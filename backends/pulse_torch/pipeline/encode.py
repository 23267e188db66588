"""The pipeline's frozen VAE and text encoder: images and captions to what the backbone trains on.

::

    pixels (B, 3, R, R) in [-1, 1] ─ vae.encode ─ latent_dist.mean (default) or .sample(seeded generator)
                                    ─ (x - shift_factor) * scaling_factor            ─▶ latents (B, C, R/f, R/f)
    captions ─ tokenizer (padded to model_max_length, truncated) ─ text_encoder(input_ids)[0]
                                                                   ─▶ encoder_hidden_states (B, L, D)
                                                                      attention_mask (B, L)

As diffusers' ``train_text_to_image.py``: the text encoder sees the padded
ids without a mask (SD was trained so); the mask is kept beside them for
models that want one. Everything runs under ``torch.no_grad`` in eval mode.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pulse.errors import PulseError
from pulse.data.pipeline_folder import PipelineError, PipelineFolder

LATENT_MODES = ("mean", "sample")


def load_component(folder: PipelineFolder, name: str, path) -> Any:
    """``library.Class.from_pretrained(path)`` for the class ``model_index.json`` names; one line if it fails."""
    import importlib

    entry = folder.index.get(name)
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        raise PipelineError(f"{folder.root}/model_index.json: '{name}' should be [library, class], got {entry!r}")
    library, cls_name = entry
    if library not in ("diffusers", "transformers"):
        raise PipelineError(f"{folder.root}/model_index.json: '{name}' comes from '{library}' "
                            "(only diffusers and transformers parts load here)")
    try:
        cls = getattr(importlib.import_module(library), cls_name)
    except (ImportError, AttributeError) as exc:
        raise PipelineError(f"{folder.root}: '{name}' needs {library}.{cls_name}, which is not available "
                            f"({exc}); install the diffusers extra: pip install -e '.[diffusers]'") from None
    try:
        return cls.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged part fails deep inside the library, in any type
        reason = " ".join(str(exc).split())[:200]
        raise PipelineError(f"{path}: cannot load {cls_name} ({reason})") from None


def quiet() -> None:
    """diffusers' and transformers' logging off (progress bars, 'accelerate' advice, and their own error
    lines before an exception): the progress line is ours, and a failure is said once, by us."""
    import diffusers
    import transformers

    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity(library.utils.logging.CRITICAL)
        library.utils.logging.disable_progress_bar()


class Encoder:
    """The frozen VAE, text encoder and tokenizer of one pipeline folder, each loaded on first use
    (a training rank that never reads the latents never loads the VAE)."""

    def __init__(self, folder: PipelineFolder, latents: str = "mean", seed: int = 0, device: str = "cpu") -> None:
        if folder.backbone_name != "unet" or len(folder.text_encoders) != 1:
            raise PipelineError(f"{folder.root}: encoding supports UNet pipelines with one text encoder "
                                f"(SD 1.x / 2.x); this one has {folder.backbone_name}/ and "
                                f"{len(folder.text_encoders)} text encoder(s)")
        if latents not in LATENT_MODES:
            raise PulseError(f"--latents must be one of {', '.join(LATENT_MODES)}, got {latents!r}")
        quiet()
        self.folder, self.device = folder, torch.device(device)
        self.mode, self.seed = latents, seed

    @functools.cached_property
    def vae(self) -> Any:
        return load_component(self.folder, "vae", self.folder.vae).to(self.device).eval().requires_grad_(False)

    @functools.cached_property
    def text_encoder(self) -> Any:
        model = load_component(self.folder, "text_encoder", self.folder.text_encoders[0])
        return model.to(self.device).eval().requires_grad_(False)

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_component(self.folder, "tokenizer", self.folder.tokenizers[0])

    @property
    def scaling(self) -> float:
        return float(self.vae.config.scaling_factor)

    @property
    def shift(self) -> float:
        return float(getattr(self.vae.config, "shift_factor", None) or 0.0)

    @property
    def scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def max_length(self) -> int:
        return int(self.tokenizer.model_max_length)

    def describe(self) -> str:
        how = "latent_dist.mean" if self.mode == "mean" else f"latent_dist.sample (seed {self.seed}, per image)"
        shift = f" - {self.shift:g}" if self.shift else ""
        return f"({how}{shift}) * {self.scaling:g}"

    @torch.no_grad()
    def latents(self, pixels: np.ndarray, first_index: int) -> np.ndarray:
        """(B, C, h, w) float32 for (B, 3, R, R) pixels; a sample's noise is seeded by its image's index."""
        x = torch.from_numpy(pixels).to(self.device, self.vae.dtype)
        dist = self.vae.encode(x).latent_dist
        if self.mode == "mean":
            z = dist.mean
        else:  # one generator per image: the same sample whatever the batch it was encoded in
            noise = [torch.randn(dist.mean.shape[1:], generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + first_index + i)) for i in range(x.shape[0])]
            z = dist.mean + dist.std * torch.stack(noise).to(dist.mean.device, dist.mean.dtype)
        return ((z - self.shift) * self.scaling).float().cpu().numpy()

    @torch.no_grad()
    def text(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(encoder_hidden_states (B, L, D) float32, attention_mask (B, L) int64) for ``captions``."""
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_length, truncation=True,
                                return_tensors="pt")
        hidden = self.text_encoder(tokens.input_ids.to(self.device), return_dict=False)[0]
        return hidden.float().cpu().numpy(), tokens.attention_mask.long().numpy()
