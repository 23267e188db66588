"""Cached latents against on-the-fly encoding: the tiny SD pipeline fine-tuned at pp 2 on real gloo processes.

    python benchmarks/finetune_data.py [--images 16] [--steps 12]

Builds the tiny random-weight pipeline of the tests and N captioned images, encodes them once with
`pulse cache-latents`, then runs the same `pulse train --pipeline ... --pp 2` twice: on the cache
(`--data`) and encoding on the fly (`--images`). Prints steps/s (median step time of log.json, step 0
left out) and the cache's one-off encoding time; writes benchmarks/results/finetune_data.json.
Both runs train on bit-identical batches (tests/test_finetune_onthefly.py), so the difference is the
encoders' time on the ranks that read latents or text.
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
RESULTS = ROOT / "benchmarks" / "results" / "finetune_data.json"
sys.path.insert(0, str(ROOT / "tests"))

from pipeline_helpers import image_folder, tiny_pipeline  # noqa: E402


def pulse(*args: str) -> float:
    """Run a pulse command (one thread per process); its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pulse {args[0]} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def train(pipe: Path, run: Path, steps: int, *data: str) -> dict:
    pulse("train", "--pipeline", str(pipe), *data, "--pp", "2", "--microbatch-size", "2", "--schedule", "gpipe",
          "--steps", str(steps), "--out-dir", str(run))
    log = json.loads((run / "log.json").read_text())
    seconds = sorted(s["seconds"] for s in log["steps"][1:])
    median = seconds[len(seconds) // 2]
    return {"median_step_seconds": median, "steps_per_s": 1.0 / median, "data": log["run"]["data"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_pipeline(root / "pipe")
        images = image_folder(root / "images", args.images)
        encode_seconds = pulse("cache-latents", "--pipeline", str(root / "pipe"), "--images", str(images),
                               "--out", str(root / "cache"))
        cached = train(root / "pipe", root / "run-cached", args.steps, "--data", str(root / "cache"))
        live = train(root / "pipe", root / "run-live", args.steps, "--images", str(images))
    rows = [("cached latents (--data)", cached), ("on the fly (--images)", live)]
    print(f"tiny SD pipeline, pp 2, 4 microbatches of 2, {args.steps} steps, gloo on this machine")
    print(f"{'data':<26}{'ms/step':>10}{'steps/s':>10}")
    for name, row in rows:
        print(f"{name:<26}{row['median_step_seconds'] * 1e3:>10.1f}{row['steps_per_s']:>10.2f}")
    print(f"on the fly / cached step time: {live['median_step_seconds'] / cached['median_step_seconds']:.2f}x; "
          f"the cache took {encode_seconds:.1f} s once (`pulse cache-latents`, {args.images} images, with start-up)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"images": args.images, "steps": args.steps, "cache_seconds": encode_seconds,
                                   "cached": cached, "on_the_fly": live}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
