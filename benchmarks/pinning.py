"""CPU ranks pinned to their own cores or left to the kernel: measured step time, same plans.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pinning.py [--rounds 3] [--steps 40]

tiny-uvit on 2 gloo processes (fp32, microbatch 2, 4 microbatches), sequential + 1F1B and a
2-fold wave + greedy, each plan written by ``pulse simulate --out``. Every round runs each plan
pinned (the default) and with ``PULSE_PIN_CORES=0``, alternating, so a slow minute of the host
hits both; a run's figure is ``validate.measure``'s: the mean step time after two warm-up steps.
Prints the table and writes benchmarks/results/pinning.json.
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

from validate import BIN, RESULTS, ROOT, measure

from pulse.plan import load_plan
from pulse.zoo.loading import load_model

PLANS = {"seq+1f1b": ["--partitioner", "sequential", "--schedule", "1f1b"],
         "wave2+greedy": ["--folds", "2", "--schedule", "greedy_v_1f1b"]}


def write_plan(name: str, out: Path) -> Path:
    path = out / f"{name}.yaml"
    subprocess.run([str(BIN / "pulse"), "simulate", "--model", "tiny-uvit", "--pp", "2", "--microbatch-size", "2",
                    "--num-microbatches", "4", "--precision", "fp32", "--hardware", "cpu-local", *PLANS[name],
                    "--out", str(path)], check=True, capture_output=True, cwd=ROOT)
    return path


def run(plan: Path, steps: int, pinned: bool, out: Path) -> float:
    loaded, spec = load_plan(str(plan), load_model)
    return measure(loaded, spec, out, "run", steps, None, {"PULSE_PIN_CORES": "1" if pinned else "0"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in PLANS:
            plan = write_plan(name, Path(tmp))
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for pinned in (False, True):
                    times[pinned].append(run(plan, args.steps, pinned, Path(tmp) / f"{name}-{r}-{pinned}"))
                    print(f"  {name} round {r + 1} {'pinned' if pinned else 'unpinned'}: "
                          f"{times[pinned][-1] * 1e3:.1f} ms/step", flush=True)
            rows.append({"plan": name, "unpinned_ms": [t * 1e3 for t in times[False]],
                         "pinned_ms": [t * 1e3 for t in times[True]]})
    print("| plan | unpinned ms/step (mean of rounds) | pinned ms/step | change |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        u, p = statistics.fmean(r["unpinned_ms"]), statistics.fmean(r["pinned_ms"])
        print(f"| {r['plan']} | {u:.1f} | {p:.1f} | {p / u - 1:+.1%} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "steps": args.steps, "rows": rows}
    (RESULTS / "pinning.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
