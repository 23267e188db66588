"""SDXL fine-tuning at pp 2: cached vs on-the-fly encoding, full fine-tune vs LoRA, on the tiny SDXL pipeline.

    python benchmarks/finetune_sdxl.py [--images 16] [--steps 12] [--lora-rank 4]

Builds the tiny random-weight ``StableDiffusionXLPipeline`` of the tests (tests/sdxl_helpers.py: two CLIP text
encoders, text_time UNet) and N captioned images, encodes them once with `pulse cache-latents` (prompt_embeds,
text_embeds, time_ids), then runs `pulse train --pipeline ... --pp 2` four times: on the cache (`--data`) and
encoding on the fly (`--images`), each as a full fine-tune and with `--lora-rank R`, and the frozen encoders run
inside the pipeline (`--encoders bubbles`: in the schedule's idle gaps; `--encoders before`: all on the first
device before the pipeline starts), full fine-tune. Per run: median step time
of log.json (step 0 left out), pipeline bytes per step, trainable parameters and the optimizer state the plan
predicts for them (``MemoryModel.optimizer_bytes`` each: fp32 master, m, v), the predicted peak per device.
Writes benchmarks/results/finetune_sdxl.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "finetune_sdxl.json"
sys.path.insert(0, str(ROOT / "tests"))

from pipeline_helpers import image_folder  # noqa: E402
from sdxl_helpers import tiny_sdxl_pipeline  # noqa: E402
from pulse.sim.memory import MemoryModel  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def pulse(*args: str, check: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    """Run a pulse command (one thread per process); its wall seconds and the finished process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], env=ENV, capture_output=True, text=True)
    if check and done.returncode:
        sys.exit(f"pulse {args[0]} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start, done


def train(pipe: Path, run: Path, steps: int, *extra: str) -> dict:
    """One pp-2 run; what its log.json says and its plan predicted."""
    pulse("train", "--pipeline", str(pipe), *extra, "--pp", "2", "--microbatch-size", "2", "--schedule", "gpipe",
          "--steps", str(steps), "--out-dir", str(run))
    log = json.loads((run / "log.json").read_text())
    seconds = sorted(s["seconds"] for s in log["steps"][1:])
    median = seconds[len(seconds) // 2]
    predicted = log["run"]["predicted"]
    # a LoRA plan states its adapters; a full fine-tune trains every parameter of the UNet
    trainable = int(predicted.get("trainable_params") or load_model(PREFIX + str(pipe / "unet")).total_params)
    return {"median_step_seconds": median, "steps_per_s": 1.0 / median,
            "pipeline_bytes_per_step": log["steps"][-1]["pipeline_bytes"], "trainable_params": trainable,
            "optimizer_bytes_predicted": trainable * MemoryModel().optimizer_bytes,
            "peak_memory_bytes_predicted": predicted.get("peak_memory_bytes_per_device"),
            "first_loss": log["steps"][0]["loss"], "last_loss": log["steps"][-1]["loss"], "data": log["run"]["data"]}


def print_table(rows: dict[str, dict], steps: int, rank: int) -> None:
    print(f"tiny SDXL pipeline, pp 2, 4 microbatches of 2, {steps} steps, gloo on this machine "
          f"(LoRA rank {rank})")
    print(f"{'run':<27}{'ms/step':>9}{'steps/s':>9}{'p2p KB/step':>13}{'trainable':>11}{'optimizer (pred.)':>19}"
          f"{'peak/device (pred.)':>22}")
    for name, r in rows.items():
        peak = "/".join(f"{b / 2**20:.1f}" for b in r["peak_memory_bytes_predicted"] or []) + " MiB"
        print(f"{name:<27}{r['median_step_seconds'] * 1e3:>9.1f}{r['steps_per_s']:>9.2f}"
              f"{r['pipeline_bytes_per_step'] / 1e3:>13.1f}{r['trainable_params']:>11,}"
              f"{r['optimizer_bytes_predicted'] / 2**20:>15.2f} MiB{peak:>22}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=4)
    args = parser.parse_args()
    lora = ("--lora-rank", str(args.lora_rank))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_sdxl_pipeline(root / "pipe")
        images = image_folder(root / "images", args.images)
        encode_seconds, _ = pulse("cache-latents", "--pipeline", str(root / "pipe"), "--images", str(images),
                                  "--out", str(root / "cache"))
        cache, live = ("--data", str(root / "cache")), ("--images", str(images))
        rows = {name: train(root / "pipe", root / f"run{i}", args.steps, *flags) for i, (name, flags) in enumerate([
            ("cache, full", cache), ("on the fly, full", live), ("cache, LoRA", (*cache, *lora)),
            ("on the fly, LoRA", (*live, *lora)), ("in bubbles, full", (*live, "--encoders", "bubbles")),
            ("before the pipeline, full", (*live, "--encoders", "before"))])}
    print_table(rows, args.steps, args.lora_rank)
    ratio = rows["on the fly, full"]["median_step_seconds"] / rows["cache, full"]["median_step_seconds"]
    print(f"on the fly / cached step time (full): {ratio:.2f}x; the cache took {encode_seconds:.1f} s once "
          f"(`pulse cache-latents`, {args.images} images, with start-up)")
    bubbles = rows["in bubbles, full"]["median_step_seconds"] / rows["cache, full"]["median_step_seconds"]
    print(f"encoders in the bubbles / cached step time (full): {bubbles:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"images": args.images, "steps": args.steps, "lora_rank": args.lora_rank,
                                   "cache_seconds": encode_seconds, "runs": rows,
                                   "load_average": os.getloadavg()},
                                  indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
