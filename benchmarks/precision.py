"""Mixed precision against fp32: the same plan, weights and microbatches, 50 steps each (in-process, pp 2).

    python benchmarks/precision.py [--steps 50] [--model tiny-unet]

Prints one row per precision (first and last loss, the last loss against fp32's, seconds per step)
and writes benchmarks/results/precision.json. The loop is ``pulse.train.loop.optimizer_update``
(cosine schedule with warm-up, clipping at 1.0; fp16 with dynamic loss scaling), on the fake
in-process network: the step's arithmetic is what ``pulse train`` runs, the timing is not a
multi-process one.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from pulse.costs import AnalyticProfiler
from pulse.data.feed import synthetic_feed
from pulse.hardware import load_hardware
from pulse.partition import partition
from pulse.testing.local import local_run
from pulse.train.loop import ScaledLoss, StepSettings, optimizer_update
from pulse.train.schedules import DynamicLossScale
from pulse.schedule.generators import make_schedule
from pulse.schedule.lower import lower
from pulse.zoo import get_spec
from pulse_torch.backend import TorchBackend
from pulse_torch.diffusion import eps_loss
from pulse_torch.job import AUTOCAST, with_autocast

RESULTS = Path(__file__).resolve().parent / "results" / "precision.json"


def train(model: str, precision: str, steps: int, pp: int = 2, microbatches: int = 4) -> dict:
    spec = get_spec(model)
    placement = partition("pulse", spec, AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 2), pp)
    backend = TorchBackend(dtype=torch.float32, seed=0)
    if AUTOCAST[precision] is not None:
        backend = with_autocast(backend, AUTOCAST[precision])
    scaler = DynamicLossScale() if precision == "fp16" else None
    loss = eps_loss if scaler is None else ScaledLoss(eps_loss, backend, scaler)
    program = lower(make_schedule("greedy_v_1f1b", placement, microbatches), spec, placement)
    feed = synthetic_feed(spec, 2, microbatches)  # every step trains on step 0's batches
    run = local_run(spec, placement, program, backend, lambda mb: feed.batch(0, 0, mb).map(torch.from_numpy), loss)
    settings = StepSettings(clip=1.0, lr=2e-3, lr_schedule="cosine", warmup_steps=5, total_steps=steps)
    losses, start = [], time.perf_counter()
    for step in range(steps):
        stats = run.step()
        losses.append(float(np.mean([v for s in stats.values() for v in s.losses.values()])))
        chunks = [c for ex in run.executors for c in ex.chunks.values()]
        optimizer_update(backend, chunks, step, settings, scaler)
    return {"precision": precision, "losses": losses, "seconds_per_step": (time.perf_counter() - start) / steps,
            "skipped_steps": scaler.skipped if scaler is not None else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model", default="tiny-unet")
    parser.add_argument("--precisions", default="fp32,bf16")
    args = parser.parse_args()
    rows = [train(args.model, p, args.steps) for p in args.precisions.split(",")]
    ref = rows[0]["losses"][-1]
    print(f"{args.model}, pp 2 V + greedy, {args.steps} steps, same weights and microbatches")
    print(f"{'precision':<10}{'first loss':>12}{'last loss':>12}{'vs fp32':>10}{'s/step':>9}{'skipped':>9}")
    for r in rows:
        r["last_vs_fp32"] = r["losses"][-1] / ref - 1.0
        print(f"{r['precision']:<10}{r['losses'][0]:>12.4f}{r['losses'][-1]:>12.4f}{r['last_vs_fp32']:>+10.2%}"
              f"{r['seconds_per_step']:>9.3f}{r['skipped_steps']:>9d}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"model": args.model, "steps": args.steps, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
