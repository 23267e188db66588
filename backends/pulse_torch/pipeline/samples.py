"""``--sample-every N --sample-prompt TEXT [--sample-prompt TEXT ...]`` (or ``--sample-prompts FILE``): images
from the weights of a checkpoint, during training, each prompt with its own seed, negative prompt,
guidance scale, steps and size (``pulse.train.validation_prompts``).

::

    RUN/checkpoints/step-<k> (written by every rank at step k) ─ StepWeights: the rank files mapped, each
        tensor read as it is copied (EMA with --ema) ─ the pipeline's backbone with them (no merged copy beside
        it) ─ DiffusionPipeline(prompt j, its seed) ─ RUN/samples/step-<k>-<i>.png
          (--lora-rank: the base backbone with                (prompt j's images: i = 2j, 2j + 1)
           peft adapters holding them, lora_model)

Rank 0 samples from the checkpoint the ranks just wrote (the gather is the
checkpoint: no extra collective), on its own device, while the other ranks
wait for it at their next message. The whole pipeline, in fp32, then sits on
that device beside rank 0's training state: `pulse train` refuses a run where
the two cannot fit before it launches (``pulse.cli.sample_fit``). Images are written atomically. A sample
that fails is a warning line and a record in log.json (``pulse.train.run_outputs.guard_samples``),
and training goes on with the device's cache emptied of the failed pipeline.
"""
from __future__ import annotations

import gc
import inspect
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from pulse.atomic_io import write_atomic_bytes
from pulse.data.pipeline_folder import read_pipeline, resolution_of
from pulse.train.validation_prompts import ValidationPrompt
from pulse_torch.export import load_trained, trained_weights
from pulse_torch.pipeline.encode import quiet

if TYPE_CHECKING:
    from pulse_torch.diffusers_adapter.lora import LoraSettings

IMAGES_PER_SAMPLE = 2
SAMPLE_DTYPE = torch.float32  # pulse.cli.sample_fit.SAMPLE_BYTES_PER_PARAM


def write_samples(pipeline: str, step_dir: Path, step: int, out_dir: Path,
                  prompts: str | Sequence[str | ValidationPrompt], steps: int, seed: int, device: str = "cpu",
                  ema: bool = False, lora: LoraSettings | None = None) -> list[Path]:
    """``IMAGES_PER_SAMPLE`` images of each prompt from checkpoint ``step_dir``; their paths, prompt by
    prompt. A prompt's own steps, seed, negative prompt, guidance and size win over ``steps``, ``seed`` and
    the pipeline's defaults (``pulse.train.validation_prompts``). ``lora``: the checkpoint holds a LoRA
    run's adapters, drawn with on the base backbone."""
    quiet()
    pipe = sampling_pipeline(pipeline, step_dir, step, device, ema, lora)
    resolution, _ = resolution_of(read_pipeline(pipeline))  # what it trains at (Hunyuan-DiT's would bin to 1024)
    images = [image for p in with_defaults(prompts, steps, seed) for image in draw(pipe, p, resolution)]
    folder_out = out_dir / "samples"
    folder_out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = folder_out / f"step-{step}-{i}.png"
        write_atomic_bytes(path, lambda f, image=image: image.save(f, format="PNG"))
        paths.append(path)
    return paths


def with_defaults(prompts: str | Sequence[str | ValidationPrompt], steps: int, seed: int) -> list[ValidationPrompt]:
    """Each prompt with ``steps`` and ``seed`` where it names none."""
    given = [prompts] if isinstance(prompts, str) else prompts
    return [replace(p, steps=p.steps or steps, seed=seed if p.seed is None else p.seed)
            for p in (q if isinstance(q, ValidationPrompt) else ValidationPrompt(q) for q in given)]


def draw(pipe: Any, prompt: ValidationPrompt, resolution: int) -> list:
    """One prompt's images, its generator seeded afresh (the same noise at every step: the images show the
    training; the same seed, the same images)."""
    generator = torch.Generator().manual_seed(prompt.seed)
    extra = {"use_resolution_binning": False} if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters else {}
    call = {"height": resolution, "width": resolution, **prompt.call_arguments(), **extra}
    return pipe(prompt.prompt, num_images_per_prompt=IMAGES_PER_SAMPLE, generator=generator, **call).images


def sampling_pipeline(pipeline: str, step_dir: Path, step: int, device: str, ema: bool, lora: LoraSettings | None):
    """The diffusers pipeline of folder ``pipeline`` with the backbone of checkpoint ``step_dir``, in fp32."""
    from diffusers import DiffusionPipeline

    folder = read_pipeline(pipeline)
    weights = trained_weights(step_dir, step, ema)
    if lora is not None:
        from pulse_torch.diffusers_adapter.lora import lora_model

        backbone = lora_model(folder, weights, lora, str(step_dir))
    else:
        backbone = load_trained(folder, weights, step_dir)
    # every part in fp32 (the trained weights are fp32 masters; transformers 5 would keep a text encoder in
    # its stored dtype beside them): what `pulse train` prices before launch (pulse.cli.sample_fit)
    pipe = DiffusionPipeline.from_pretrained(str(folder.root), local_files_only=True,
                                             **{folder.backbone_name: backbone}).to(device, SAMPLE_DTYPE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def release_device_cache(device: str) -> None:
    """After a failed sample: the pipeline's tensors freed and the device's cached blocks returned (an
    out-of-memory sample would otherwise leave the training that much less, and fail again)."""
    gc.collect()
    kind = torch.device(device).type
    backend = getattr(torch, kind, None)  # torch.cuda; torch.npu once torch_npu is imported
    if kind != "cpu" and hasattr(backend, "empty_cache"):
        backend.empty_cache()
