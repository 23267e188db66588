"""Frozen encoders cached, before the pipeline, or in its bubbles: measured on real gloo processes, with predictions.

    python benchmarks/encoders.py [--steps 12] [--pp 2,4] [--images 32] [--weights light,heavy]

The tiny SD pipeline of the tests with its own encoders ("light": ~2 ms per sample here, less
than the schedule's idle time) and with heavier ones ("heavy": an 8-layer text encoder and a
64/128-channel VAE, ~8 ms per sample, more than the idle time), and N captioned images. Per
encoder weight and pipeline depth P (V placement, greedy V schedule, 2P microbatches of 1):

  `pulse profile --pipeline`          layer costs, links and the encoders' forward seconds (costs.yaml)
  (a) cached      --data CACHE        latents and text embeddings encoded offline (`pulse cache-latents`)
  (b) before      --images --encoders before    every encode on device 0 before the pipeline
  (c) bubbles     --images --encoders bubbles   encodes in the schedule's idle gaps, outputs sent

each trained with the measured costs (`--costs --cluster`), so `plan.yaml`'s prediction is priced
on this machine. Prints predicted and measured ms/step (median of the steps after the first) with
the error, and writes benchmarks/results/encoders.json. P = 4 runs 4 ranks on this machine's 2
cores: its rows are indicative (see benchmarks/validate.py on shared cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "encoders.json"
sys.path.insert(0, str(ROOT / "tests"))

from pipeline_helpers import image_folder, tiny_pipeline  # noqa: E402

HEAVY_TEXT = dict(num_hidden_layers=8, intermediate_size=512)
HEAVY_VAE = dict(block_out_channels=(64, 128), layers_per_block=2)
WEIGHTS = {"light": ({}, {}), "heavy": (HEAVY_TEXT, HEAVY_VAE)}
ROWS = (("cached", "--data"), ("before", "--images"), ("bubbles", "--images"))


def pulse(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"pulse {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def run_row(root: Path, pp: int, mode: str, data: str, steps: int, weight: str) -> dict:
    run = root / f"pp{pp}-{mode}"
    source = str(root / "cache") if data == "--data" else str(root / "images")
    encoders = "cached" if data == "--data" else mode
    pulse("train", "--pipeline", str(root / "pipe"), data, source, "--pp", str(pp), "--microbatch-size", "1",
          "--num-microbatches", str(2 * pp), "--schedule", "greedy_v_1f1b", "--encoders", encoders,
          "--steps", str(steps), "--costs", str(root / f"costs-pp{pp}.yaml"),
          "--cluster", str(root / f"cluster-pp{pp}.yaml"), "--out-dir", str(run))
    log = json.loads((run / "log.json").read_text())
    measured = statistics.median(s["seconds"] for s in log["steps"][1:])
    predicted = log["run"]["predicted"]["step_seconds"]
    return {"weight": weight, "pp": pp, "mode": mode, "predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3,
            "error": predicted / measured - 1.0, "bubble": log["run"]["predicted"].get("bubble_ratio")}


def measure(root: Path, weight: str, args: argparse.Namespace) -> list[dict]:
    text, vae = WEIGHTS[weight]
    tiny_pipeline(root / "pipe", text=text, vae=vae)
    image_folder(root / "images", args.images)
    pulse("cache-latents", "--pipeline", str(root / "pipe"), "--images", str(root / "images"), "--out",
          str(root / "cache"))
    rows = []
    for pp in (int(p) for p in args.pp.split(",")):
        said = pulse("profile", "--pipeline", str(root / "pipe"), "--pp", str(pp), "--microbatch-size", "1",
                     "--out-costs", str(root / f"costs-pp{pp}.yaml"), "--out-cluster", str(root / f"cluster-pp{pp}.yaml"))
        print(f"{weight}: " + next((line for line in said.splitlines() if "encoders" in line), "(no encoders)"))
        for mode, data in ROWS:
            rows.append(run_row(root, pp, mode, data, args.steps, weight))
            r = rows[-1]
            print(f"  pp {pp} {mode:<8} predicted {r['predicted_ms']:7.1f} ms  measured {r['measured_ms']:7.1f} ms"
                  f"  error {r['error']:+.1%}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--weights", default="light,heavy")
    args = parser.parse_args()
    rows = []
    for weight in args.weights.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(Path(tmp), weight, args)
    print(f"\ntiny SD pipeline, V placement, greedy_v_1f1b, 2P microbatches of 1, {args.steps} steps, gloo here")
    print(f"{'encoders':<9}{'P':>2} {'mode':<9}{'predicted ms':>13}{'measured ms':>13}{'error':>8}{'vs cached':>11}"
          f"{'vs before':>11}")
    for r in rows:
        same = {x["mode"]: x["measured_ms"] for x in rows if x["pp"] == r["pp"] and x["weight"] == r["weight"]}
        print(f"{r['weight']:<9}{r['pp']:>2} {r['mode']:<9}{r['predicted_ms']:>13.1f}{r['measured_ms']:>13.1f}"
              f"{r['error']:>+8.1%}{r['measured_ms'] / same['cached']:>10.2f}x{r['measured_ms'] / same['before']:>10.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"steps": args.steps, "images": args.images, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
