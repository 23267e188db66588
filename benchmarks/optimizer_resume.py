"""Each ``--optimizer`` resumed through real ranks: ``pulse train`` straight for S steps against S/2 steps,
a checkpoint, ``--resume`` and S/2 more, the final weights compared tensor by tensor.

::

    python benchmarks/optimizer_resume.py [--workdir DIR] [--steps 6] [--optimizers adamw adafactor ...]
                                          [--backend torch|mindspore]

tiny-unet on this machine's CPUs (torchrun, gloo; or msrun), pp 2 with GPipe (Prodigy: pp 1, its step size being the
whole model's). tests/test_optimizers.py checks the same in one process with seeded gradients; this runs
the whole loop: data, forward and backward through the pipeline, clipping, the checkpoint files.

Prints a table; writes ``benchmarks/results/optimizer_resume.json`` (rows by backend and optimizer, kept
from earlier runs of the others).
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


def train(out: Path, optimizer: str, steps: int, backend: str, *extra: str) -> None:
    pp = "2" if OPTIMIZERS[optimizer].elementwise else "1"
    cmd = [PULSE, "train", "--backend", backend, "--model", "tiny-unet", "--pp", pp, "--schedule", "gpipe", "--time-limit", "2",
           "--optimizer", optimizer, "--steps", str(steps), "--out-dir", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")


def final_weights(folder: Path, backend: str) -> dict:
    """``--save-final``'s weights as numpy arrays by name (PyTorch's .pt, MindSpore's .npz)."""
    import numpy as np

    if backend == "mindspore":
        with np.load(folder / "final_weights.npz") as arrays:
            return {k: arrays[k] for k in arrays.files}
    import torch

    saved = torch.load(folder / "final_weights.pt", weights_only=True)
    return {k: v.numpy() for k, v in saved.get("params", saved).items()}


def compare(optimizer: str, workdir: Path, steps: int, backend: str) -> dict:
    import numpy as np

    straight, resumed = workdir / f"{backend}-{optimizer}-straight", workdir / f"{backend}-{optimizer}-resumed"
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)
    train(straight, optimizer, steps, backend, "--save-final")
    train(resumed, optimizer, steps // 2, backend, "--checkpoint-every", str(steps // 2))
    train(resumed, optimizer, steps, backend, "--resume", "--save-final")
    a, b = final_weights(straight, backend), final_weights(resumed, backend)
    differ = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
    return {"backend": backend, "optimizer": optimizer, "tensors": len(a),
            "bit_exact": all(np.array_equal(a[k], b[k]) for k in a), "max_abs_diff": differ, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/pulse-optimizer-resume")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizers", nargs="+", default=None, choices=NAMES,
                        help="default: every one the backend builds")
    parser.add_argument("--backend", choices=("torch", "mindspore"), default="torch")
    args = parser.parse_args()
    names = args.optimizers or [n for n in NAMES if args.backend in OPTIMIZERS[n].backends]
    rows = [compare(name, Path(args.workdir), args.steps, args.backend) for name in names]
    print("| backend | optimizer | tensors | bit-exact | max abs diff |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['optimizer']} | {r['tensors']} | {r['bit_exact']} | {r['max_abs_diff']:.3g} |")
    out = ROOT / "benchmarks" / "results" / "optimizer_resume.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.is_file() else []
    mine = {(r["backend"], r["optimizer"]) for r in rows}
    kept = [r for r in old if (r.get("backend", "torch"), r["optimizer"]) not in mine]  # rows before --backend: torch
    out.write_text(json.dumps(kept + rows, indent=1) + "\n")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
