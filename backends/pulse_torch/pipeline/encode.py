"""The pipeline's frozen VAE and text encoder(s): images and captions to what the backbone trains on.

::

    pixels (B, 3, R, R) in [-1, 1] ─ vae.encode ─ latent_dist.mean (default) or .sample(seeded generator)
                                    ─ (x - shift_factor) * scaling_factor            ─▶ latents (B, C, R/f, R/f)
    captions ─ per text encoder of the recipe (pulse.data.pipeline_text): tokenizer (padded to its length,
               truncated) ─ text_encoder(input_ids [, attention_mask])[0] ─▶ hidden states (B, L, D), mask (B, L)
               SDXL: hidden_states[-2] of both encoders, concatenated ─▶ prompt_embeds (B, L, D1 + D2);
                     text_encoder_2's output[0] (pooled, projected) ─▶ text_embeds (B, P)

As the pipelines' own ``encode_prompt``: SD's and SDXL's text encoders see the
padded ids without a mask (``train_text_to_image.py``, ``..._sdxl.py``);
Hunyuan-DiT's see the mask. Everything runs under ``torch.no_grad`` in eval mode.

Each part is loaded in the precision it is held in (``pulse.data.frozen_precision``: the training
precision, diffusers' ``weight_dtype``; fp32 for ``pulse cache-latents``), never loaded then cast:
a bf16 text encoder never exists in fp32. Outputs are returned as float32 either way.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy as np
import torch

from pulse.errors import PulseError
from pulse.data.pipeline_folder import PipelineError, PipelineFolder
from pulse.data.frozen_precision import frozen_precision
from pulse.data.pipeline_text import recipe_for

LATENT_MODES = ("mean", "sample")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_component(folder: PipelineFolder, name: str, path, dtype: torch.dtype | None = None) -> Any:
    """``library.Class.from_pretrained(path)`` for the class ``model_index.json`` names; one line if it fails.
    ``dtype``: the weights' dtype (a model's ``torch_dtype``); None: the library's default."""
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
    settings = {} if dtype is None else {"torch_dtype": dtype}  # a tokenizer takes none
    try:
        return cls.from_pretrained(str(path), local_files_only=True, **settings)
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
    """The frozen VAE, text encoder(s) and tokenizer(s) of one pipeline folder, each loaded on first use
    (a training rank that never reads the latents never loads the VAE); what they make: ``recipe``.
    ``precision``: the training precision, which sets each part's dtype (``pulse.data.frozen_precision``)."""

    def __init__(self, folder: PipelineFolder, latents: str = "mean", seed: int = 0, device: str = "cpu",
                 precision: str = "fp32") -> None:
        self.recipe = recipe_for(folder)
        if latents not in LATENT_MODES:
            raise PulseError(f"--latents must be one of {', '.join(LATENT_MODES)}, got {latents!r}")
        quiet()
        self.folder, self.device = folder, torch.device(device)
        self.mode, self.seed, self.precision = latents, seed, precision
        self.text_encoders: dict[int, Any] = {}  # loaded ones, by index
        self.tokenizers: dict[int, Any] = {}

    def dtype_of(self, part: str) -> torch.dtype:
        """The dtype ``part`` ("text", "vae") is held in."""
        return TORCH_DTYPES[frozen_precision(self.folder, part, self.precision)]

    @functools.cached_property
    def vae(self) -> Any:
        model = load_component(self.folder, "vae", self.folder.vae, self.dtype_of("vae"))
        return model.to(self.device).eval().requires_grad_(False)

    def text_encoder(self, index: int) -> Any:
        if index not in self.text_encoders:
            name = "text_encoder" if index == 0 else f"text_encoder_{index + 1}"
            model = load_component(self.folder, name, self.folder.text_encoders[index], self.dtype_of("text"))
            self.text_encoders[index] = model.to(self.device).eval().requires_grad_(False)
        return self.text_encoders[index]

    def tokenizer(self, index: int) -> Any:
        if index not in self.tokenizers:
            name = "tokenizer" if index == 0 else f"tokenizer_{index + 1}"
            self.tokenizers[index] = load_component(self.folder, name, self.folder.tokenizers[index])
        return self.tokenizers[index]

    @property
    def scaling(self) -> float:
        return float(self.vae.config.scaling_factor)

    @property
    def shift(self) -> float:
        return float(getattr(self.vae.config, "shift_factor", None) or 0.0)

    def describe(self) -> str:
        how = "latent_dist.mean" if self.mode == "mean" else f"latent_dist.sample (seed {self.seed}, per image)"
        shift = f" - {self.shift:g}" if self.shift else ""
        return f"({how}{shift}) * {self.scaling:g}"

    @contextlib.contextmanager
    def _kernels(self, part: str, path) -> Iterator[None]:
        """One line where the device has no kernel for an op in the part's dtype (a CPU build without
        bf16 or fp16 for one of the part's ops), instead of torch's traceback from deep in the model."""
        dtype = self.dtype_of(part)
        try:
            yield
        except (RuntimeError, NotImplementedError) as exc:
            said = " ".join(str(exc).split())
            if dtype == torch.float32 or "not implemented for" not in said:
                raise
            raise PipelineError(f"{path}: this torch has no {dtype} kernel on {self.device.type} for an op of the "
                                f"{part} encoder ({said[:160]}): train with --precision fp32, or encode once in fp32 "
                                "with `pulse cache-latents` and train on --data") from None

    @torch.no_grad()
    def latents(self, pixels: np.ndarray, first_index: int) -> np.ndarray:
        """(B, C, h, w) float32 for (B, 3, R, R) pixels; a sample's noise is seeded by its image's index."""
        x = torch.from_numpy(pixels).to(self.device, self.vae.dtype)
        with self._kernels("vae", self.folder.vae):
            dist = self.vae.encode(x).latent_dist
        if self.mode == "mean":
            z = dist.mean
        else:  # one generator per image: the same sample whatever the batch it was encoded in
            noise = [torch.randn(dist.mean.shape[1:], generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + first_index + i)) for i in range(x.shape[0])]
            z = dist.mean + dist.std * torch.stack(noise).to(dist.mean.device, dist.mean.dtype)
        return ((z - self.shift) * self.scaling).float().cpu().numpy()

    @torch.no_grad()
    def text(self, captions: list[str]) -> dict[str, np.ndarray]:
        """Every text array of the recipe for ``captions``: hidden states (B, L, D) float32, masks (B, L) int64."""
        parts: dict[str, list[np.ndarray]] = {}
        for enc in self.recipe.texts:
            for name, array in self._encode(enc, captions).items():
                parts.setdefault(name, []).append(array)
        # encodings naming one hidden array (SDXL's two encoders) are joined on the feature axis, as diffusers does
        return {name: arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1)
                for name, arrays in parts.items()}

    def _encode(self, enc, captions: list[str]) -> dict[str, np.ndarray]:
        """One text encoder's arrays for ``captions`` (``enc``: a ``pulse.data.pipeline_text.TextEncoding``)."""
        tokenizer = self.tokenizer(enc.index)
        tokens = tokenizer(captions, padding="max_length", max_length=enc.max_length or tokenizer.model_max_length,
                           truncation=True, return_tensors="pt")
        mask = tokens.attention_mask.long()
        extra = {"attention_mask": mask.to(self.device)} if enc.pass_mask else {}
        if enc.hidden_layer is not None:
            extra["output_hidden_states"] = True
        model = self.text_encoder(enc.index)
        with self._kernels("text", self.folder.text_encoders[enc.index]):
            output = model(tokens.input_ids.to(self.device), return_dict=False, **extra)
        hidden = output[0] if enc.hidden_layer is None else output[-1][enc.hidden_layer]
        out = {enc.hidden: hidden.float().cpu().numpy()}
        if enc.mask is not None:
            out[enc.mask] = mask.numpy()
        if enc.pooled is not None:
            if output[0].ndim != 2:  # diffusers takes the pooled text only from a projecting encoder
                raise PipelineError(f"{self.folder.text_encoders[enc.index]}: its output is not pooled text "
                                    f"embeddings (shape {tuple(output[0].shape)}): SDXL's text_encoder_2 is a "
                                    "CLIPTextModelWithProjection")
            out[enc.pooled] = output[0].float().cpu().numpy()
        return out
