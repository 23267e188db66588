"""``--sample-every N --sample-prompt TEXT [--sample-prompt TEXT ...]``: images from the weights of a
checkpoint, during training.

::

    RUN/checkpoints/step-<k> (written by every rank at step k) ─ StepWeights: the rank files mapped, each
        tensor read as it is copied (EMA with --ema) ─ the pipeline's backbone with them (no merged copy beside
        it) ─ DiffusionPipeline(prompts, seeded) ─ RUN/samples/step-<k>-<i>.png
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
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from pulse.atomic_io import write_atomic_bytes
from pulse.data.pipeline_folder import read_pipeline, resolution_of
from pulse_torch.export import load_trained, trained_weights
from pulse_torch.pipeline.encode import quiet

if TYPE_CHECKING:
    from pulse_torch.diffusers_adapter.lora import LoraSettings

IMAGES_PER_SAMPLE = 2
SAMPLE_DTYPE = torch.float32  # pulse.cli.sample_fit.SAMPLE_BYTES_PER_PARAM


def write_samples(pipeline: str, step_dir: Path, step: int, out_dir: Path, prompts: str | Sequence[str], steps: int,
                  seed: int, device: str = "cpu", ema: bool = False, lora: LoraSettings | None = None) -> list[Path]:
    """``IMAGES_PER_SAMPLE`` images of each prompt from checkpoint ``step_dir`` (one batch); their paths,
    prompt by prompt. ``lora``: the checkpoint holds a LoRA run's adapters, drawn with on the base backbone."""
    from diffusers import DiffusionPipeline

    quiet()
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
    generator = torch.Generator().manual_seed(seed)  # the same noise at every step: the images show the training
    resolution, _ = resolution_of(folder)  # what it trains at (Hunyuan-DiT's pipeline would bin it to 1024)
    extra = {"use_resolution_binning": False} if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters else {}
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    images = pipe(prompts, num_inference_steps=steps, num_images_per_prompt=IMAGES_PER_SAMPLE, height=resolution,
                  width=resolution, generator=generator, **extra).images
    folder_out = out_dir / "samples"
    folder_out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = folder_out / f"step-{step}-{i}.png"
        write_atomic_bytes(path, lambda f, image=image: image.save(f, format="PNG"))
        paths.append(path)
    return paths


def release_device_cache(device: str) -> None:
    """After a failed sample: the pipeline's tensors freed and the device's cached blocks returned (an
    out-of-memory sample would otherwise leave the training that much less, and fail again)."""
    gc.collect()
    kind = torch.device(device).type
    backend = getattr(torch, kind, None)  # torch.cuda; torch.npu once torch_npu is imported
    if kind != "cpu" and hasattr(backend, "empty_cache"):
        backend.empty_cache()
