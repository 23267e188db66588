"""MindSpore on a CPU, asynchronous or blocking: why ``pulse_mindspore.cpu_mode`` must act before the first op.

    python benchmarks/mindspore_launch_blocking.py [--steps 300] [--repeats 3]

Each mode runs in a fresh process: a 3x3 conv (8 channels) and a GroupNorm on a 2x8x16x16 input,
``mindspore.value_and_grad`` for 20 warm-up steps, then ``--steps`` timed steps, reading each thread's
CPU time from ``/proc/self/task`` around the timed part:

    asynchronous  MindSpore's default PyNative pipeline (front-end, backward and backend queue threads)
    blocking      ``mindspore.runtime.launch_blocking()`` before the first op (what importing
                  ``pulse_mindspore.layers`` does on a CPU)
    switched      the same call after the 20 warm-up steps ran asynchronously

Prints the median of ``--repeats`` runs per mode (wall, process CPU, the busiest threads) and writes
benchmarks/results/mindspore_launch_blocking.json. The figure that matters is process CPU: on a shared
machine the spinning queue threads take cores from everything else.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "mindspore_launch_blocking.json"
MODES = ("asynchronous", "blocking", "switched")
CHILD = """
import json, os, sys, time
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

mode, steps = sys.argv[1], int(sys.argv[2])
tick = os.sysconf("SC_CLK_TCK")


def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        out[stat[stat.index("(") + 1:stat.rindex(")")] + ":" + tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


conv, norm = nn.Conv2d(8, 8, 3, pad_mode="pad", padding=1), nn.GroupNorm(2, 8)
x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 16, 16)).astype(np.float32))
step = ms.value_and_grad(lambda x: ops.sum(norm(conv(x)) ** 2), None, conv.trainable_params() + norm.trainable_params())
if mode == "blocking":
    ms.runtime.launch_blocking()
for _ in range(20):
    loss, _ = step(x)
loss.asnumpy()
if mode == "switched":
    ms.runtime.launch_blocking()
before, wall, cpu = threads(), time.perf_counter(), time.process_time()
for _ in range(steps):
    loss, _ = step(x)
loss.asnumpy()
wall, cpu, after = time.perf_counter() - wall, time.process_time() - cpu, threads()
busy = {name.split(":")[0]: round(t - before.get(name, 0.0), 2) for name, t in after.items()
        if t - before.get(name, 0.0) >= 0.05}
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "threads_cpu_s": busy}))
"""


def run_mode(mode: str, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps)], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"mindspore_launch_blocking: the {mode} run failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for mode in MODES:
        runs = [run_mode(mode, args.steps) for _ in range(args.repeats)]
        middle = sorted(runs, key=lambda r: r["cpu_s"])[len(runs) // 2]
        rows[mode] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                      "cpu_s": statistics.median(r["cpu_s"] for r in runs), "threads_cpu_s": middle["threads_cpu_s"]}
        print(f"{mode:13s} {rows[mode]['wall_s']:6.2f} s wall {rows[mode]['cpu_s']:6.2f} s CPU  "
              f"{middle['threads_cpu_s']}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "modes": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
