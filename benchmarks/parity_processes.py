"""Training parity over real processes: ``benchmarks/parity.py --processes`` (2 ranks per backend).

::

    launcher:  weights.npz (pulse_torch build_model, seed 0, by reference name)
               data.npz    (every step's microbatches, numpy, drawn once: parity.make_data)
        ├── torchrun --nproc-per-node 2 parity_ranks.py --backend torch      (gloo)          -> torch.json
        └── msrun --worker_num 2 ...    parity_ranks.py --backend mindspore  (gloo + mccl)   -> mindspore.json
    table of per-step losses, |diff| and relative diff; JSON report

``run_processes`` is what ``tests/test_parity_processes.py`` calls with a few steps.

Measured (tiny-unet, 20 steps, 2 shared and loaded CPU cores): largest
relative loss difference 9.2e-6 (step 18), 1.1e-7 at step 1; the in-process
run of ``benchmarks/parity.py --model tiny-unet --steps 20`` drifts the same
(9.1e-6 at step 18), and each backend's losses here match its in-process
ones to 6e-8. torch ~0.4 s/step, MindSpore PyNative ~24 s/step.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import parity
import parity_ranks

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RANKS = HERE / "parity_ranks.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_inputs(model: str, steps: int, folder: Path) -> tuple[Path, Path, int]:
    """(weights.npz, data.npz, number of weight tensors): what both launches read."""
    spec, _, _ = parity_ranks.case(model)
    weights, data = folder / "weights.npz", folder / "data.npz"
    n_keys = parity.export_torch_weights(spec, weights)
    get = parity.make_data(spec, parity_ranks.SEED, steps)
    np.savez(data, **{f"{step}/{mb}/{name}": a for step in range(1, steps + 1)
                      for mb in range(parity_ranks.M) for name, a in get(step, mb).items()})
    return weights, data, n_keys


def launch_env() -> dict[str, str]:
    """This interpreter first on PATH (msrun runs ``python``), this tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "backends"), env.get("PYTHONPATH", "")])
    env.update({"OMP_NUM_THREADS": "1", "GLOG_v": "3", "GLOO_SOCKET_IFNAME": "lo",
                "PULSE_GLOO_PORT": str(free_port())})
    return env


def launch(backend: str, model: str, steps: int, weights: Path, data: Path, folder: Path,
           timeout: float) -> dict:
    """One job of 2 ranks; rank 0's report. Fails with the workers' output when the job does."""
    out = folder / f"{backend}.json"
    entry = [str(RANKS), "--backend", backend, "--model", model, "--steps", str(steps), "--weights", str(weights),
             "--data", str(data), "--out", str(out), "--timeout", "120"]
    if backend == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", *entry]
    else:
        cmd = [str(Path(sys.executable).parent / "msrun"), "--worker_num", "2", "--local_worker_num", "2",
               "--master_port", str(free_port()), "--log_dir", str(folder / "msrun_logs"), "--join", "True",
               "python", *entry]
    done = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out.exists():
        logs = "".join(p.read_text()[-2000:] for p in sorted((folder / "msrun_logs").glob("worker_*.log")))
        raise RuntimeError(f"{backend} launch failed ({done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stderr[-3000:]}\n{logs}")
    return json.loads(out.read_text())


def run_processes(model: str, steps: int, folder: Path, timeout: float = 1800) -> dict:
    """Both backends over real processes; the report (losses, differences, seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    weights, data, n_keys = write_inputs(model, steps, folder)
    runs = {b: launch(b, model, steps, weights, data, folder, timeout) for b in ("torch", "mindspore")}
    t, m = np.array(runs["torch"]["losses"]), np.array(runs["mindspore"]["losses"])
    absd = np.abs(t - m)
    reld = absd / np.maximum(np.abs(t), 1e-30)
    return {"model": model, "steps": steps, "pp": parity_ranks.P, "microbatches": parity_ranks.M,
            "microbatch_size": parity_ranks.MBS, "placement": "pulse", "schedule": "greedy_v_1f1b",
            "optimizer": "AdamW", "lr": parity_ranks.LR, "dtype": "float32", "weight_tensors": n_keys,
            "processes": {"torch": "torchrun, 2 ranks, gloo", "mindspore": "msrun, 2 workers, gloo send/recv + mccl "
                          "all-reduce"},
            "carriers": {b: r["carrier"] for b, r in runs.items()},
            "torch_loss": t.tolist(), "mindspore_loss": m.tolist(), "abs_diff": absd.tolist(),
            "rel_diff": reld.tolist(), "max_abs_diff": float(absd.max()), "max_rel_diff": float(reld.max()),
            "seconds": {b: r["seconds"] for b, r in runs.items()},
            "machine": platform.platform(), "python": platform.python_version()}


def print_table(report: dict) -> None:
    t, m = report["torch_loss"], report["mindspore_loss"]
    print(f"\n{'step':>5} {'torch loss':>14} {'mindspore loss':>16} {'abs diff':>10} {'rel diff':>10}")
    for i in range(len(t)):
        print(f"{i + 1:5d} {t[i]:14.8f} {m[i]:16.8f} {report['abs_diff'][i]:10.2e} {report['rel_diff'][i]:10.2e}")
    print(f"largest abs diff {report['max_abs_diff']:.2e}, largest rel diff {report['max_rel_diff']:.2e}")
    for b, s in report["seconds"].items():
        print(f"training time {b:9s}: {s:7.1f} s ({s / report['steps']:.3f} s/step, rank 0, start-up excluded)")


def main_processes(model: str, steps: int, out: Path) -> int:
    import tempfile

    print(f"{model}: pulse V at P={parity_ranks.P}, greedy_v_1f1b, M={parity_ranks.M} x {parity_ranks.MBS} "
          f"sample, AdamW lr {parity_ranks.LR}, float32, {steps} steps; 2 processes per backend", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = run_processes(model, steps, Path(tmp))
    print_table(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
