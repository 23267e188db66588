"""Where a real step's time goes, against what ``pulse profile``'s per-layer figures add up to.

    python benchmarks/step_parts.py                     # sd2-unet, bf16, on cuda
    python benchmarks/step_parts.py --model tiny-unet --device cpu --precision fp32 --microbatch-size 1

The same diffusers UNet (random weights, gpu_check's configs), three plans on one device: ``one chunk``
(the whole model, 1F1B over gpu_check's fixed batches, as a pp 1 step trains it), ``fit chunks`` (layer 0,
then chunks of 3 layers: the chunks the profile fits its per-action costs on) and ``per layer`` (one chunk
per layer: the runs the profile times its layers in); these two run every forward before the backwards
and make their batches from the feed, as the profile's runs do. For each: the step's wall time with and
without the optimizer step (their difference: AdamW as ``local_run`` steps it, no clipping), and the F and
B actions' time summed per step, and on CUDA where one step makes the host wait for the device
(``host_syncs``: torch's sync debug mode, each synchronizing call by the line of PULSE's code under it).
On an accelerator, under each --timings way of ``pulse profile
--device-timing``: ``events`` reads each action between device events (the first timing's plans are the
top-level keys), ``synchronize`` waits for the device after every call and reads the host's clock. For the
one chunk, ``time_optimizer``'s figure (the profile's way to time an optimizer step: the clipping norm's
squared sum, then AdamW) and those pieces apart. Steps alternate between with and without the optimizer,
after --warmup of each. Writes --out (default benchmarks/results/step_parts.json; the one committed was
taken before the fit chunks and the synchronize runs were added).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (the models, batches and backends of the device check)

from pulse.profiling.layers import fit_cuts, time_optimizer  # noqa: E402
from pulse.profiling.runs import one_chunk_per_layer  # noqa: E402
from pulse.schedule.generators import one_f_one_b  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.profiler import device_timed, synchronizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "step_parts.json"
REPO = Path(__file__).resolve().parents[1]
SYNC_WARNING = "called a synchronizing"  # torch's words under set_sync_debug_mode("warn")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(gpu_check.MODELS), default="sd2-unet")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps with, and as many without, the optimizer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timings", default="events,synchronize",
                        help="on an accelerator: each plan timed on the device's events, then with a device "
                             "synchronize after every call (`pulse profile --device-timing`'s two ways)")
    parser.add_argument("--out", default=str(RESULTS))
    return parser


def measure(run: Any, backend: Any, device: torch.device, steps: int, warmup: int) -> dict:
    """Alternating steps with and without the optimizer: wall medians, and F / B seconds per step."""
    sync, ex = synchronizer(device), run.executors[0]
    walls: dict[bool, list[float]] = {True: [], False: []}
    actions: dict[str, list[float]] = {}
    clock = getattr(backend, "device_clock", None)
    for i in range(2 * (warmup + steps)):
        optimize = i % 2 == 0
        ex.timeline = [] if i >= 2 * warmup else None
        sync()
        start = time.perf_counter()
        run.step(optimize=optimize)
        sync()
        if i < 2 * warmup:
            continue
        walls[optimize].append(time.perf_counter() - start)
        per_kind: dict[str, float] = {}
        for a in ex.timeline:
            per_kind[a.kind] = per_kind.get(a.kind, 0.0) + a.seconds(clock)
        for kind, seconds in per_kind.items():
            actions.setdefault(kind, []).append(seconds)
    ex.timeline = None
    with_opt, without = statistics.median(walls[True]), statistics.median(walls[False])
    return {"step_ms": with_opt * 1e3, "step_without_optimizer_ms": without * 1e3,
            "optimizer_ms": (with_opt - without) * 1e3,
            "actions_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(actions.items())}}


def optimizer_parts(run: Any, backend: Any, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Wall medians (the device waited for) of the loop's pieces after the actions: the clipping norm's
    squared sum as the backend computes it, one foreach norm over the same gradients (what
    ``torch.nn.utils.clip_grad_norm_`` launches), and the AdamW step."""
    (chunk,) = run.executors[0].chunks.values()
    sync = synchronizer(device)
    grads = [g for g in backend.gradients(chunk).values()]

    def foreach_norm() -> float:
        return float(torch.stack(torch._foreach_norm(grads)).double().square().sum())

    pieces = {"grad_square_sum": lambda: backend.grad_square_sum([chunk]), "foreach_norm": foreach_norm,
              "optimizer_step": lambda: backend.optimizer_step(chunk)}
    out = {}
    for name, work in pieces.items():
        times = []
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            work()
            sync()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:]) * 1e3
    out["tensors"] = len(grads)
    return out


def host_syncs(step: Callable[[], Any], device: torch.device, set_mode: Callable[[str], None] | None = None) -> dict:
    """Where one ``step()`` makes the host wait for the device: every synchronizing CUDA call torch reports
    under ``torch.cuda.set_sync_debug_mode("warn")`` (not all: torch.distributed's are not covered), by
    the innermost line of this repository's code under it, most frequent first. A wait inside a chunk's
    actions drains the device's queue, and on a host-bound step the device then idles while the host
    queues the next kernels: the lead for the 0.5 ms an action costs on the H200 (RESULTS). {} where the
    device has no such mode (a CPU)."""
    if device.type != "cuda":
        return {}
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(REPO))]
        if ours:
            where = ours[-1]
            sites[f"{Path(where.filename).relative_to(REPO)}:{where.lineno} ({where.name})"] += 1
        else:
            sites[f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        set_mode("warn")
        try:
            step()
        finally:
            set_mode("default")
    return {"syncs": sum(sites.values()), "sites": dict(sites.most_common(15))}


def timed_backend(model: str, device: torch.device, precision: str, timing: str) -> Any:
    """A fresh UNet and backend (a diffusers model's chunks are built once), timed as ``timing`` says."""
    gpu_check.release(device)
    _, backend = gpu_check.adapted(model, device, precision)
    return device_timed(backend, device, timing)


def plan_runs(args: argparse.Namespace, spec: Any, model: str, device: torch.device, timing: str) -> dict:
    """Each plan's figures under one timing; the one chunk's optimizer pieces too."""
    out: dict[str, Any] = {}

    def syncs_of(step: Callable[[], Any]) -> dict:  # under synchronize every call waits, by design
        return {} if timing == "synchronize" else host_syncs(step, device)
    backend = timed_backend(model, device, args.precision, timing)
    batches = gpu_check.fixed_batches(spec, args, device)
    placement = gpu_check.one_chunk(spec)
    one = local_run(spec, placement, lower(one_f_one_b(placement, args.microbatches), spec, placement),
                    backend, lambda mb: batches[mb], eps_loss)
    out["one_chunk"] = measure(one, backend, device, args.steps, args.warmup)
    out["one_chunk"]["host_syncs"] = syncs_of(lambda: one.step(optimize=True))
    out["one_chunk"]["time_optimizer_ms"] = time_optimizer(one, backend, 3)[0] * 1e3
    out["one_chunk"]["optimizer_parts_ms"] = optimizer_parts(one, backend, device)
    print(f"one chunk ({timing}): {json.dumps(out['one_chunk'])}", flush=True)
    del one, backend
    for plan, cuts in (("fit_chunks", fit_cuts(spec.num_layers)), ("per_layer", None)):
        backend = timed_backend(model, device, args.precision, timing)
        run = one_chunk_per_layer(spec, backend, eps_loss, args.microbatch_size, split=False, seed=0,
                                  microbatches=args.microbatches, cuts=cuts)
        out[plan] = measure(run, backend, device, args.steps, args.warmup)
        out[plan]["chunks"] = len(run.executors[0].chunks)
        out[plan]["host_syncs"] = syncs_of(lambda: run.step(optimize=True))
        print(f"{plan} ({timing}): {json.dumps(out[plan])}", flush=True)
        del run, backend
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    began = time.perf_counter()
    timings = ["host"] if device.type == "cpu" else args.timings.split(",")
    out: dict[str, Any] = {"device": gpu_check.device_name(device), "torch": torch.__version__, "model": args.model,
                           "precision": args.precision, "microbatch_size": args.microbatch_size,
                           "microbatches": args.microbatches, "clock": timings[0]}
    with tempfile.TemporaryDirectory(prefix="pulse-step-parts-") as tmp:
        model = gpu_check.write_model(args.model, Path(tmp))
        spec = load_model(model, {})
        out.update(plan_runs(args, spec, model, device, timings[0]))
        for timing in timings[1:]:
            out[timing] = plan_runs(args, spec, model, device, timing)
    out["wall_seconds"] = time.perf_counter() - began
    gpu_check.write_result(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
