"""Training parity: the same pipeline plan trained by the PyTorch and the MindSpore backends.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/parity.py [--model tiny-uvit] [--steps 50]

Both backends get, as far as the two frameworks allow, the same run:

* model: ``--model`` (default tiny-uvit), float32;
* weights: ``pulse_torch.model.build_model(spec, seed=0)``, written by reference
  checkpoint name to an .npz, loaded by name into every chunk of BOTH
  backends (``pulse_mindspore.weights.import_weights`` on the MindSpore side);
* plan: the pulse V placement at P = 2 (analytic cpu-local costs),
  ``greedy_v_1f1b``, M = 2 microbatches of 1 sample, sends/receives added,
  run by ``pulse.testing.local.local_run`` on the in-process fake network;
* data: each step's microbatches (noised latent, timesteps, the data's other
  inputs, the noise target) as training draws them, from the synthetic source
  (``pulse.data.feed.synthetic_feed``), made ONCE as numpy arrays and handed to
  both backends as the identical arrays (a DiT's learned-variance channels get
  a zero gradient on both sides, ``eps_loss``);
* optimizer: AdamW lr 1e-3 (betas 0.9/0.999, eps 1e-8, no weight decay, no
  clipping), one step per training step via ``LocalRun.step(optimize=True)``.

Prints the per-step losses every 10 steps (torch, MindSpore, absolute and
relative difference), the largest differences over all steps, the step-1
difference (before any update: only float summation order differs, so ~1e-6
relative is expected) and the wall time of each backend. Later steps drift
apart slowly as float32 rounding differences are amplified by Adam's
normalised updates; that drift is what this measures. Each microbatch loss
is a float32 scalar on both sides (1 ulp ~ 6e-8 at a loss near 0.8), so a
difference of 0 means "equal after float32 rounding", not identical arithmetic.

Measured (tiny-uvit, 50 steps, OMP_NUM_THREADS=1, CPU): torch ~0.03 s/step,
MindSpore PyNative ~0.28 s/step with blocking launches (~18 s in all; 3.8 s/step
before, ``pulse_mindspore.cpu_mode.launch_blocking_on_cpu``), so the defaults were kept.

Writes benchmarks/results/parity.json.

``--processes``: the same comparison over real processes, 2 ranks per backend
(``benchmarks/parity_ranks.py`` under torchrun, gloo; and under msrun, gloo
send/recv plus mccl all-reduce), on the pulse V plan of ``--model``
(default there: tiny-unet) for ``--steps`` (default there: 20). The launcher
writes the weights and every step's batches to files both launches read.
Prints the loss table and writes benchmarks/results/parity_processes.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "parity.json"
RESULTS_PROCESSES = HERE / "results" / "parity_processes.json"
P, M, MBS, LR, SEED = 2, 2, 1, 1e-3, 0


def make_data(spec, seed: int, steps: int):
    """numpy batches by (step, microbatch) of training's synthetic feed for steps 1..``steps``, made
    once and cached: both backends read the same arrays."""
    from pulse.data.feed import synthetic_feed

    feed = synthetic_feed(spec, MBS, M, 1, seed, steps=steps + 1)
    cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def get(step: int, mb: int) -> dict[str, np.ndarray]:
        if (step, mb) not in cache:
            cache[step, mb] = {k: np.ascontiguousarray(v) for k, v in feed.batch(step, 0, mb).items()}
        return cache[step, mb]

    return get


class StepBatches:
    """The ``Batches`` callable of one backend: microbatch ``mb`` of the current ``step``."""

    def __init__(self, data, convert) -> None:
        self.data, self.convert, self.step = data, convert, 0

    def __call__(self, mb: int):
        return {k: self.convert(v) for k, v in self.data(self.step, mb).items()}


def export_torch_weights(spec, path: Path) -> int:
    from pulse_torch.layers import reference_key
    from pulse_torch.model import build_model

    net = build_model(spec, seed=SEED)
    entries = {}
    for lname, module in net.layers.items():
        layer = spec.layers[spec.index(lname)]
        for pname, p in module.named_parameters():
            entries[reference_key(layer, pname)] = p.detach().float().numpy()
    np.savez(path, **entries)
    return len(entries)


def load_torch_chunks(spec, run, path: Path) -> int:
    import torch

    from pulse_torch.layers import reference_key

    n = 0
    with np.load(path) as data:
        for ex in run.executors:
            for chunk in ex.chunks.values():
                for lname, module in chunk.layers.items():
                    layer = spec.layers[spec.index(lname)]
                    for pname, p in module.named_parameters():
                        with torch.no_grad():
                            p.copy_(torch.from_numpy(data[reference_key(layer, pname)]))
                        n += 1
    return n


def load_mindspore_chunks(spec, run, path: Path) -> int:
    from pulse_mindspore.weights import import_weights

    return sum(len(import_weights(spec, chunk.layers, path, strict=True))
               for ex in run.executors for chunk in ex.chunks.values())


def train(name: str, spec, placement, program, data, weights: Path, steps: int) -> tuple[list[float], float, int]:
    from pulse.testing.local import local_run

    if name == "torch":
        import torch

        from pulse_torch.backend import TorchBackend
        from pulse_torch.diffusion import eps_loss
        backend = TorchBackend(dtype=torch.float32, seed=SEED, lr=LR)
        batches = StepBatches(data, lambda a: torch.from_numpy(np.ascontiguousarray(a)))
        run = local_run(spec, placement, program, backend, batches, eps_loss)
        loaded = load_torch_chunks(spec, run, weights)
    else:
        import mindspore as ms

        from pulse_mindspore.backend import MindSporeBackend
        from pulse_mindspore.diffusion import eps_loss
        from pulse_mindspore.model import to_tensor
        backend = MindSporeBackend(dtype=ms.float32, seed=SEED, lr=LR)
        batches = StepBatches(data, to_tensor)
        run = local_run(spec, placement, program, backend, batches, eps_loss)
        loaded = load_mindspore_chunks(spec, run, weights)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batches.step = step
        run.step(optimize=True)
        losses.append(float(run.loss()))
        if step % 10 == 0 or step == steps:
            print(f"  {name:9s} step {step:3d}/{steps}  loss {losses[-1]:.6f}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)
    return losses, time.perf_counter() - start, loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, choices=("tiny-uvit", "tiny-unet", "tiny-dit"),
                        help="default: tiny-uvit (in one process), tiny-unet (--processes)")
    parser.add_argument("--steps", type=int, default=None, help="default: 50 (in one process), 20 (--processes)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--processes", action="store_true", help="2 real processes per backend (torchrun, msrun)")
    args = parser.parse_args(argv)
    if args.processes:
        from parity_processes import main_processes

        return main_processes(args.model or "tiny-unet", args.steps or 20, args.out or RESULTS_PROCESSES)
    args.model, args.steps, args.out = args.model or "tiny-uvit", args.steps or 50, args.out or RESULTS

    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_hardware
    from pulse.partition import partition
    from pulse.schedule.generators import make_schedule
    from pulse.schedule.lower import lower
    from pulse.zoo import get_spec

    spec = get_spec(args.model).with_act_bytes(4)  # float32 on the wire
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    placement = partition("pulse", spec, costs, P)
    program = lower(make_schedule("greedy_v_1f1b", placement, M), spec, placement)
    data = make_data(spec, SEED, args.steps)
    print(f"{args.model}: {len(spec.layers)} layers, {sum(l.params for l in spec.layers):,} parameters; "
          f"pulse V at P={P}, greedy_v_1f1b, M={M} x {MBS} sample, AdamW lr {LR}, float32, {args.steps} steps")

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.npz"
        n_keys = export_torch_weights(spec, weights)
        print(f"weights: {n_keys} tensors from pulse_torch build_model(seed={SEED}), by reference name")
        for name in ("torch", "mindspore"):
            losses, seconds, loaded = train(name, spec, placement, program, data, weights, args.steps)
            results[name] = {"losses": losses, "seconds": seconds, "tensors_loaded": loaded}

    t, m = np.array(results["torch"]["losses"]), np.array(results["mindspore"]["losses"])
    absd = np.abs(t - m)
    reld = absd / np.maximum(np.abs(t), 1e-30)
    print(f"\n{'step':>5} {'torch loss':>14} {'mindspore loss':>16} {'abs diff':>10} {'rel diff':>10}")
    for i in range(len(t)):
        step = i + 1
        if step == 1 or step % 10 == 0 or step == len(t):
            print(f"{step:5d} {t[i]:14.8f} {m[i]:16.8f} {absd[i]:10.2e} {reld[i]:10.2e}")
    ia, ir = int(absd.argmax()), int(reld.argmax())
    print(f"\nstep 1 (before any update): torch {t[0]:.8f}  mindspore {m[0]:.8f}  "
          f"abs diff {absd[0]:.2e}  rel diff {reld[0]:.2e}")
    print(f"largest abs diff over all steps: {absd[ia]:.2e} (step {ia + 1})")
    print(f"largest rel diff over all steps: {reld[ir]:.2e} (step {ir + 1})")
    for name in ("torch", "mindspore"):
        s = results[name]["seconds"]
        print(f"wall time {name:9s}: {s:7.1f} s  ({s / args.steps:.3f} s/step)")

    report = {
        "model": args.model, "steps": args.steps, "pp": P, "microbatches": M, "microbatch_size": MBS,
        "placement": "pulse", "schedule": "greedy_v_1f1b", "optimizer": "AdamW", "lr": LR, "dtype": "float32",
        "weight_seed": SEED, "weight_tensors": n_keys,
        "torch_loss": t.tolist(), "mindspore_loss": m.tolist(),
        "abs_diff": absd.tolist(), "rel_diff": reld.tolist(),
        "step1": {"torch": float(t[0]), "mindspore": float(m[0]), "abs_diff": float(absd[0]),
                  "rel_diff": float(reld[0])},
        "max_abs_diff": {"value": float(absd[ia]), "step": ia + 1},
        "max_rel_diff": {"value": float(reld[ir]), "step": ir + 1},
        "seconds": {k: v["seconds"] for k, v in results.items()},
        "tensors_loaded": {k: v["tensors_loaded"] for k, v in results.items()},
        "machine": platform.platform(), "python": platform.python_version(),
    }
    try:
        import mindspore
        import torch
        report["versions"] = {"torch": torch.__version__, "mindspore": mindspore.__version__,
                              "numpy": np.__version__}
    except ImportError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
