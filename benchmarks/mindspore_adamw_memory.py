"""What one AdamW step holds on MindSpore's CPU runtime: its own optimizer against the same update op by op.

    python benchmarks/mindspore_adamw_memory.py [--tensors 40] [--elements 8388608]

Each mode runs in a fresh process: ``--tensors`` float32 parameters of ``--elements`` each (320 M parameters,
1.25 GiB, by default) and as many gradients, then two AdamW steps; the process's resident set (``VmRSS``) is
read once built and after each step.

    experimental      mindspore.experimental.optim.AdamW over every parameter (what the MindSpore backend stepped
                      per chunk until round 4, session 13), a compiled graph
    per-tensor        the same, one optimizer a parameter
    eager             the backend's ``pulse_mindspore.optimizers.EagerAdamW``: torch.optim.AdamW's update in PyNative
                      ops, four ``ops.assign`` a parameter

The floor is the weights, gradients and two moments: 4 x 1.25 GiB. Writes
benchmarks/results/mindspore_adamw_memory.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("experimental", "per-tensor", "eager")
GiB = 2**30


def resident_gib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024 / GiB


def one_mode(mode: str, tensors: int, elements: int) -> dict:
    """Run in this process (``--child``): the resident set once built and after each of two steps."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, Tensor, ops

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    params = [Parameter(Tensor(rng.random(elements, dtype=np.float32)), name=f"p{i}") for i in range(tensors)]
    grads = tuple(Tensor(rng.random(elements, dtype=np.float32)) for _ in range(tensors))
    out = {"mode": mode, "built_gib": resident_gib(), "steps_gib": []}
    if mode == "eager":
        from pulse_mindspore.optimizers import EagerAdamW

        optimizer = EagerAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
        for _ in (1, 2):
            optimizer(grads)
            float(params[-1][0].asnumpy())  # the queued ops done
            out["steps_gib"].append(resident_gib())
        return out
    from mindspore.experimental.optim import AdamW

    width = tensors if mode == "experimental" else 1
    optimizers = [(AdamW(params[i:i + width], lr=1e-3, weight_decay=1e-2), slice(i, i + width))
                  for i in range(0, tensors, width)]
    for _ in (1, 2):
        for optimizer, part in optimizers:
            optimizer(grads[part])
        float(params[-1][0].asnumpy())
        out["steps_gib"].append(resident_gib())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--elements", type=int, default=8 * 2**20)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "mindspore_adamw_memory.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_mode(args.child, args.tensors, args.elements)))
        return 0
    rows = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--tensors", str(args.tensors),
                               "--elements", str(args.elements)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{mode}: {rows[-1]}", flush=True)
    floor = 4 * args.tensors * args.elements * 4 / GiB
    print(f"| mode | built (GiB) | after step 1 / 2 (GiB) | floor (GiB) |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['built_gib']:.2f} | {r['steps_gib'][0]:.2f} / {r['steps_gib'][1]:.2f} | {floor:.2f} |")
    args.out.write_text(json.dumps({"tensors": args.tensors, "elements": args.elements, "floor_gib": floor,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
