"""Frozen encoders cached, before the pipeline, or in its bubbles: measured on real gloo processes, with predictions.

    python benchmarks/encoders.py [--steps 30] [--pp 2,4] [--per-stage 2,1] [--images 32] [--weights light,heavy]
                                  [--workdir DIR]

The tiny SD pipeline of the tests with its own encoders ("light": ~2 ms per sample here, less
than the schedule's idle time) and with heavier ones ("heavy": an 8-layer text encoder and a
64/128-channel VAE, ~8 ms per sample, more than the idle time), and N captioned images. Per
encoder weight, pipeline depth P and microbatch count M = kP (V placement, greedy V schedule,
microbatches of 1 sample; k = 1 leaves larger bubbles than k = 2):

  `pulse profile --pipeline --images` layer costs, links and the encoders' E actions (costs.yaml)
  (a) cached      --data CACHE        latents and text embeddings encoded offline (`pulse cache-latents`)
  (b) before      --images --encoders before    every encode on device 0 before the pipeline
  (c) bubbles     --images --encoders bubbles   encodes in the schedule's idle gaps (this step's, or
                                                the step before's for the next step), outputs sent

each trained with the measured costs (`--costs --cluster`), so `plan.yaml`'s prediction is priced
on this machine. Prints predicted and measured ms/step (the mean after two warm-up steps, as
benchmarks/validate.py) with the error, and whether the encodes fit the cached schedule's idle time
(predicted: M x encoder seconds against bubble x P x step), and writes
benchmarks/results/encoders.json. P = 4 runs 4 ranks on this machine's 2 cores, where one rank's
bubble is another's compute: those rows are indicative (see benchmarks/validate.py).
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "encoders.json"
sys.path.insert(0, str(ROOT / "tests"))

from pipeline_helpers import image_folder, tiny_pipeline  # noqa: E402

HEAVY_TEXT = dict(num_hidden_layers=8, intermediate_size=512)
HEAVY_VAE = dict(block_out_channels=(64, 128), layers_per_block=2)
WEIGHTS = {"light": ({}, {}), "heavy": (HEAVY_TEXT, HEAVY_VAE)}
ROWS = (("cached", "--data"), ("before", "--images"), ("bubbles", "--images"))
WARMUP_STEPS = 2  # as benchmarks/validate.py: the first steps build optimizer state and warm caches


def pulse(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"pulse {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def run_row(root: Path, pp: int, per_stage: int, mode: str, data: str, steps: int, weight: str) -> dict:
    run = root / f"pp{pp}-m{per_stage * pp}-{mode}"
    source = str(root / "cache") if data == "--data" else str(root / "images")
    encoders = "cached" if data == "--data" else mode
    pulse("train", "--pipeline", str(root / "pipe"), data, source, "--pp", str(pp), "--microbatch-size", "1",
          "--num-microbatches", str(per_stage * pp), "--schedule", "greedy_v_1f1b", "--encoders", encoders,
          "--steps", str(steps + WARMUP_STEPS), "--costs", str(root / f"costs-pp{pp}.yaml"),
          "--cluster", str(root / f"cluster-pp{pp}.yaml"), "--out-dir", str(run))
    log = json.loads((run / "log.json").read_text())
    measured = statistics.fmean(s["seconds"] for s in log["steps"][WARMUP_STEPS:])
    predicted = log["run"]["predicted"]["step_seconds"]
    costs = yaml.safe_load((root / f"costs-pp{pp}.yaml").read_text())
    encode_seconds = per_stage * pp * sum(dict(costs.get("encoder_fwd", {})).values())  # M microbatches
    return {"weight": weight, "pp": pp, "microbatches": per_stage * pp, "mode": mode, "predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3,
            "error": predicted / measured - 1.0, "bubble": log["run"]["predicted"].get("bubble_ratio"),
            "encode_ms": encode_seconds * 1e3}


def measure(root: Path, weight: str, args: argparse.Namespace) -> list[dict]:
    text, vae = WEIGHTS[weight]
    root.mkdir(parents=True, exist_ok=True)
    tiny_pipeline(root / "pipe", text=text, vae=vae)
    image_folder(root / "images", args.images)
    pulse("cache-latents", "--pipeline", str(root / "pipe"), "--images", str(root / "images"), "--out",
          str(root / "cache"))
    rows = []
    for pp in (int(p) for p in args.pp.split(",")):
        said = pulse("profile", "--pipeline", str(root / "pipe"), "--images", str(root / "images"), "--pp", str(pp),
                     "--microbatch-size", "1",
                     "--out-costs", str(root / f"costs-pp{pp}.yaml"), "--out-cluster", str(root / f"cluster-pp{pp}.yaml"))
        print(f"{weight}: " + next((line for line in said.splitlines() if "encoders" in line), "(no encoders)"))
        for per_stage, (mode, data) in ((k, row) for k in map(int, args.per_stage.split(",")) for row in ROWS):
            rows.append(run_row(root, pp, per_stage, mode, data, args.steps, weight))
            r = rows[-1]
            print(f"  pp {pp} M {r['microbatches']} {mode:<8} predicted {r['predicted_ms']:7.1f} ms  measured {r['measured_ms']:7.1f} ms"
                  f"  error {r['error']:+.1%}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--per-stage", default="2,1", help="microbatches per pipeline stage: M = k x P")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--weights", default="light,heavy")
    parser.add_argument("--workdir", default=None, help="keep every run's plan, log and profile here")
    args = parser.parse_args()
    rows = []
    for weight in args.weights.split(","):
        if args.workdir:  # kept: plans, logs, profiles
            rows += measure(Path(args.workdir) / weight, weight, args)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(Path(tmp), weight, args)
    print(f"\ntiny SD pipeline, V placement, greedy_v_1f1b, microbatches of 1, {args.steps} steps, gloo here")
    print(f"{'encoders':<9}{'P':>2}{'M':>3} {'mode':<9}{'predicted ms':>13}{'measured ms':>13}{'error':>8}"
          f"{'vs cached':>11}{'(predicted)':>12}{'vs before':>11}{'encodes ms':>12}{'idle ms':>9}")
    for r in rows:
        group = {x["mode"]: x for x in rows
                 if (x["pp"], x["microbatches"], x["weight"]) == (r["pp"], r["microbatches"], r["weight"])}
        cached = group["cached"]
        r["cached_idle_ms"] = cached["bubble"] * r["pp"] * cached["predicted_ms"]  # device-ms the encodes may fill
        r["vs_cached"] = r["measured_ms"] / cached["measured_ms"]
        r["vs_cached_predicted"] = r["predicted_ms"] / cached["predicted_ms"]
        r["vs_before"] = r["measured_ms"] / group["before"]["measured_ms"]
        print(f"{r['weight']:<9}{r['pp']:>2}{r['microbatches']:>3} {r['mode']:<9}{r['predicted_ms']:>13.1f}"
              f"{r['measured_ms']:>13.1f}{r['error']:>+8.1%}{r['vs_cached']:>10.2f}x{r['vs_cached_predicted']:>11.2f}x"
              f"{r['vs_before']:>10.2f}x{r['encode_ms']:>12.1f}{r['cached_idle_ms']:>9.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"steps": args.steps, "images": args.images, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
