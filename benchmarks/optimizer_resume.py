"""Each ``--optimizer`` resumed through real ranks: ``pulse train`` straight for S steps against S/2 steps,
a checkpoint, ``--resume`` and S/2 more, the final weights compared tensor by tensor.

::

    python benchmarks/optimizer_resume.py [--workdir DIR] [--steps 6] [--optimizers adamw adafactor ...]

tiny-unet on this machine's CPUs (torchrun, gloo), pp 2 with GPipe (Prodigy: pp 1, its step size being the
whole model's). tests/test_optimizers.py checks the same in one process with seeded gradients; this runs
the whole loop: data, forward and backward through the pipeline, clipping, the checkpoint files.

Prints a table; writes ``benchmarks/results/optimizer_resume.json``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pulse.optimizers import NAMES, OPTIMIZERS  # noqa: E402

PULSE = str(ROOT / ".venv" / "bin" / "pulse")


def train(out: Path, optimizer: str, steps: int, *extra: str) -> None:
    pp = "2" if OPTIMIZERS[optimizer].elementwise else "1"
    cmd = [PULSE, "train", "--model", "tiny-unet", "--pp", pp, "--schedule", "gpipe", "--time-limit", "2",
           "--optimizer", optimizer, "--steps", str(steps), "--out-dir", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")


def compare(optimizer: str, workdir: Path, steps: int) -> dict:
    import torch

    straight, resumed = workdir / f"{optimizer}-straight", workdir / f"{optimizer}-resumed"
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)
    train(straight, optimizer, steps, "--save-final")
    train(resumed, optimizer, steps // 2, "--checkpoint-every", str(steps // 2))
    train(resumed, optimizer, steps, "--resume", "--save-final")
    a = torch.load(straight / "final_weights.pt", weights_only=True)
    b = torch.load(resumed / "final_weights.pt", weights_only=True)
    a, b = a.get("params", a), b.get("params", b)
    differ = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return {"optimizer": optimizer, "tensors": len(a), "bit_exact": all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": differ, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/pulse-optimizer-resume")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizers", nargs="+", default=list(NAMES), choices=NAMES)
    args = parser.parse_args()
    rows = [compare(name, Path(args.workdir), args.steps) for name in args.optimizers]
    print("| optimizer | tensors | bit-exact | max abs diff |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['optimizer']} | {r['tensors']} | {r['bit_exact']} | {r['max_abs_diff']:.3g} |")
    out = ROOT / "benchmarks" / "results" / "optimizer_resume.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
