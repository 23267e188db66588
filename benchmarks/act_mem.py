"""A cost table's measured ``act_mem`` beside the spec's analytic ``saved_bytes``, layer by layer.

    .venv/bin/python benchmarks/act_mem.py --model tiny-unet [--precision bf16] [--microbatch-size 1]
    .venv/bin/python benchmarks/act_mem.py --model diffusers:benchmarks/sd2_unet_config.json \\
        --model-option resolution=256 [--precision bf16]

::

    the model a window at a time, as `pulse profile` holds it (pulse.profiling.windows; a diffusers
    model's skeleton, each window materialized then released)
      ─ each window's layers as one chunk each, one step, every layer's forward counted as the profile
        counts it (pulse_torch.saved_bytes: what autograd saved, parameters and autocast's copies not)
      ─ the spec's saved_bytes at the precision's activation bytes (4 fp32, 2 bf16) x the microbatch

One thread on the CPU; prints every layer and a JSON line of totals (MiB), the ratios' range and the
process's peak resident memory (it never holds the whole model).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

import torch  # noqa: E402

from pulse.args.model_args import parse_options  # noqa: E402
from pulse.profiling.layers import saved_per_layer, windowed  # noqa: E402
from pulse.sim.memory import PRECISION_BYTES  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.profile_layers import profile_layers  # noqa: E402
from pulse_torch.saved_bytes import counting_chunks  # noqa: E402

MIB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-unet")
    parser.add_argument("--model-option", action="append", default=[])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--microbatch-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_model(args.model, parse_options(args.model_option))
    layers = profile_layers(args, "cpu")
    model = windowed(spec, layers.backend_of, layers.real_layers, args.microbatch_size)
    start = time.perf_counter()
    measured = [b for window in model.each_window(
        lambda w: saved_per_layer(model.run(w, eps_loss, split=False), counting_chunks)) for b in window]
    spec_bytes = [l.saved_bytes * args.microbatch_size for l in spec.with_act_bytes(PRECISION_BYTES[args.precision]).layers]
    for layer, m, s in zip(spec.layers, measured, spec_bytes):
        print(f"  {layer.name:18s} measured {m / MIB:9.2f} MiB   spec {s / MIB:9.2f} MiB   x{m / s if s else float('nan'):.3f}")
    ratios = [m / s for m, s in zip(measured, spec_bytes) if s]
    print(json.dumps({"model": spec.name, "precision": args.precision, "microbatch_size": args.microbatch_size,
                      "layers": spec.num_layers, "measured_MiB": round(sum(measured) / MIB, 1),
                      "spec_MiB": round(sum(spec_bytes) / MIB, 1), "ratio": round(sum(measured) / sum(spec_bytes), 3),
                      "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                      "seconds": round(time.perf_counter() - start, 1),
                      "peak_resident_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}))


if __name__ == "__main__":
    main()
