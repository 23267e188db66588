"""The device check (issue 30): what PULSE does on one GPU, in under 8 minutes.

    python benchmarks/gpu_check.py                      # sd2-unet, bf16, on cuda (about 15 GB of it)
    python benchmarks/gpu_check.py --model tiny-unet --device cpu --steps 2 --pairs 2 --out /tmp/check.json
                                                        # the same logic on a CPU (tests/test_gpu_check.py)

The model is a diffusers ``UNet2DConditionModel`` built from its config (random weights, nothing
downloaded): ``sd2-unet`` is Stable Diffusion 2's UNet at 512 px (865.9 M parameters, the zoo's
``sd2-unet``), ``tiny-unet`` the small one diffusers' own tests use (on 8 x 8 latents).

(a) profile   ``pulse profile --plan P --time-chunks`` of the model on the device under --precision,
              P (c)'s one-chunk plan (one rank: NCCL, its layers timed with a device synchronize after
              every call, then its one chunk whole): its cost table's totals, the chunk's figures.
(b) memory    a V plan of the model over --pp devices (the pulse partitioner on (a)'s costs,
              greedy_v_1f1b), every device's chunks in one process over the in-process fake network,
              on the device (``local_run``, the torch backend), --steps optimizer steps; each pipeline
              device's peak (``pulse_torch.memory.InProcessShares``: each executor's allocations
              charged to its device) beside the simulator's peak for that device (as `pulse train`
              predicts it). The whole process's peak too. No figures on a CPU (nothing counts them).
(c) overhead  PULSE's step (a one-chunk plan run by the executor, the same backend, then the training
              loop's update: the global norm clipped at 1.0, AdamW) against a plain PyTorch loop over
              the same diffusers UNet and the same batches (autocast, MSE in fp32, loss / M, the loss
              read once per step, clip_grad_norm_, AdamW): --pairs paired steps in alternating
              order, the median of their time ratios (target: at most 5% over). The results
              committed in gpu_check.json and gpu_time_check.json were taken when neither clipped.
(d) time      the simulator's step for (c)'s one-chunk plan priced with each --device-timings profile
              (`pulse profile --device-timing`: synchronize, PyTorch's default, and events), beside
              (c)'s measured PULSE step (target: within 15%): with the chunk timed whole (the table's
              spans) and from the layers' figures alone.

--parts picks which of a-d run (d needs a and c; b needs a).

Writes --out (default benchmarks/results/gpu_check.json) with the device's name.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pulse.backend_traits import load_traits
from pulse.costs import CostTable
from pulse.data.feed import DiffusionFeed
from pulse.data.noise import noise_schedule
from pulse.data.sources import load_source
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.placement import from_cuts
from pulse.plan import Plan
from pulse.testing.local import local_run
from pulse.train.loop import StepBatches, StepSettings, optimizer_update
from pulse.train.sampler import Sampler
from pulse.schedule.generators import make_schedule, one_f_one_b
from pulse.schedule.lower import lower
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, step_time
from pulse.spec import ModelSpec
from pulse.zoo.loading import load_model
from pulse_torch.diffusers_adapter import DiffusersAdapter, load_diffusers
from pulse_torch.diffusion import TARGET, eps_loss
from pulse_torch.job import AUTOCAST, with_autocast
from pulse_torch.memory import AllocatorQueries, InProcessShares
from pulse_torch.profiler import synchronizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
LR = 1e-5
CLIP = 1.0  # the global gradient norm's limit: `pulse train --clip`'s default, diffusers' --max_grad_norm's
# stabilityai/stable-diffusion-2-base unet/config.json (512 px: sample_size 64)
SD2 = {"_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": [5, 10, 20, 20],
       "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 1024,
       "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
       "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0,
       "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
       "norm_num_groups": 32, "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
       "sample_size": 64, "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                                             "CrossAttnUpBlock2D"],
       "upcast_attention": False, "use_linear_projection": True}
# diffusers' own tests' tiny UNet2DConditionModel, on 8 x 8 latents (a CPU runs the check's logic in seconds)
TINY = {"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64], "layers_per_block": 2,
        "sample_size": 8, "in_channels": 4, "out_channels": 4,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32, "attention_head_dim": 8}
MODELS = {"sd2-unet": SD2, "tiny-unet": TINY}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="sd2-unet")
    parser.add_argument("--device", default="cuda", help="cuda (the GPU), cpu (the logic only: tests)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="per step, (b) and (c)")
    parser.add_argument("--pp", type=int, default=2, help="(b): pipeline devices of the V plan")
    parser.add_argument("--steps", type=int, default=3, help="(b): optimizer steps")
    parser.add_argument("--pairs", type=int, default=10, help="(c): timed step pairs, after one warm-up pair")
    parser.add_argument("--repeats", type=int, default=3, help="(a): timed repetitions per layer figure")
    parser.add_argument("--warmup", type=int, default=1, help="(a): untimed steps before them")
    parser.add_argument("--device-timings", default="synchronize,events",
                        help="(a): the `pulse profile --device-timing` ways to profile with, comma-separated; "
                             "the first one's table plans (b)")
    parser.add_argument("--parts", default="abcd", help="which of the checks a, b, c, d to run")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tables-dir", default=None, help="(a): also keep each profile's costs-<timing>.yaml here")
    return parser


# -- the model ------------------------------------------------------------------------------
def write_model(name: str, folder: Path) -> str:
    """The model's config as a diffusers folder; the name a plan records for it."""
    (folder / "unet").mkdir(parents=True, exist_ok=True)
    (folder / "unet" / "config.json").write_text(json.dumps(MODELS[name]))
    return f"diffusers:{folder / 'unet'}"


def adapted(model: str, device: torch.device, precision: str) -> tuple[DiffusersAdapter, Any]:
    """The UNet on ``device`` and a backend over its own modules, under the precision's autocast."""
    torch.manual_seed(0)
    adapter = load_diffusers(model, device=device)
    backend = adapter.backend(lr=LR, seed=0)
    dtype = AUTOCAST[precision]
    return adapter, backend if dtype is None else with_autocast(backend, dtype)


def feed_of(spec: ModelSpec, microbatch_size: int, microbatches: int) -> DiffusionFeed:
    source = load_source(None, spec, 0)
    return DiffusionFeed(source, Sampler(source.num_samples, microbatch_size, microbatches, 1, 0),
                         noise_schedule("linear"), 0)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -- (a) profile ----------------------------------------------------------------------------
def profile(args: argparse.Namespace, model: str, folder: Path, timing: str) -> tuple[dict, CostTable]:
    costs_path, cluster_path = folder / f"costs-{timing}.yaml", folder / f"cluster-{timing}.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the job picks its device itself: keep it off a GPU
    plan = folder / f"one-chunk-{timing}.yaml"  # (c)'s plan: the profile also times its one chunk whole (spans)
    spec = load_model(model, {})
    Plan(model, "cpu-local", 1, 1, args.microbatch_size, args.microbatches, "one chunk", one_chunk(spec),
         one_f_one_b(one_chunk(spec), args.microbatches)).save(plan, spec)
    command = [sys.executable, "-m", "pulse.cli.main", "profile", "--plan", str(plan), "--time-chunks",
               "--precision", args.precision,
               "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--device-timing", timing,
               "--out-costs", str(costs_path), "--out-cluster", str(cluster_path)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pulse profile failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    costs = CostTable.load(costs_path)
    if args.tables_dir:
        Path(args.tables_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(costs_path, Path(args.tables_dir) / costs_path.name)
    fwd, bwd = replace(costs, spans=()).span(0, len(costs.layer_names))  # the layers' figures, the fit off
    whole = {k: t * 1e3 for a, b, k, t in costs.spans if (a, b) == (0, len(costs.layer_names))}
    return {"device_timing": timing, "source": costs.source, "layers": len(costs.layer_names),
            "microbatch_size": costs.microbatch_size, "forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3,
            "one_chunk_ms": whole,
            "optimizer_ms": sum(costs.optimizer or ()) * 1e3,
            "per_action_ms": {k: v * 1e3 for k, v in costs.per_action},
            "wall_seconds": seconds}, costs


# -- (b) peak memory per device against the prediction -----------------------------------------
def predicted_peaks(spec: ModelSpec, placement: Any, schedule: Any, costs: CostTable, precision: str) -> list[int]:
    """The simulator's peak per device, as `pulse train` predicts it: the torch backend's rule for what its
    ranks hold at this precision (``BackendTraits.memory``: fp32 weights, gradients and AdamW's moments, and
    autocast's low-precision weight copies per microbatch in flight)."""
    held = load_traits("torch").memory(precision)
    result = simulate(spec, placement, schedule, costs, load_cluster("cpu-local"), memory=held)
    return [int(b) for b in result.peak_memory]


def memory(args: argparse.Namespace, model: str, spec: ModelSpec, costs: CostTable) -> dict:
    device = torch.device(args.device)
    placement = plan_symmetric(spec, costs, args.pp, num_microbatches=args.microbatches).placement
    schedule = make_schedule("greedy_v_1f1b", placement, args.microbatches, costs)
    adapter, backend = adapted(model, device, args.precision)
    feed = feed_of(spec, args.microbatch_size, args.microbatches)
    batches = StepBatches(lambda step, replica, mb: feed.batch(step, replica, mb).map(backend.from_numpy), 0)
    run = local_run(spec, placement, lower(schedule, spec, placement), backend, batches, eps_loss)
    queries = AllocatorQueries.of(device)
    shares = InProcessShares(queries).watch(run.executors, backend.nbytes) if queries else None
    sync = synchronizer(device)
    losses, seconds = [], []
    for step in range(args.steps):
        batches.step = step
        start = time.perf_counter()
        run.step(optimize=True)
        sync()
        seconds.append(time.perf_counter() - start)
        losses.append(float(run.loss()))
    predicted = predicted_peaks(spec, placement, schedule, costs, args.precision)
    devices = [{"device": d, "layers": [[c.start, c.end] for c in placement.chunks if c.device == d],
                "peak_bytes": shares.peak[d] if shares else None, "predicted_peak_bytes": predicted[d]}
               for d in range(args.pp)]
    out = {"pp": args.pp, "schedule": schedule.name, "microbatches": args.microbatches, "steps": args.steps,
           "losses": losses, "step_seconds": seconds, "devices": devices,
           "process_peak_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None}
    del run, adapter, backend, shares
    release(device)
    return out


# -- (c) PULSE's step against a plain loop -------------------------------------------------------
def fixed_batches(spec: ModelSpec, args: argparse.Namespace, device: torch.device) -> list[dict[str, torch.Tensor]]:
    feed = feed_of(spec, args.microbatch_size, args.microbatches)
    return [{k: torch.from_numpy(v).to(device) for k, v in feed.batch(0, 0, mb).items()}
            for mb in range(args.microbatches)]


def one_chunk(spec: ModelSpec) -> Any:
    return from_cuts("sequential", [0, spec.num_layers], [0], 1, "relay", "single")


def pulse_step(spec: ModelSpec, backend: Any, batches: list[dict]) -> Callable[[], float]:
    """A one-chunk plan on one device, run by the executor, then the training loop's own update
    (``optimizer_update``: the global norm clipped to CLIP, `pulse train`'s default, and AdamW)."""
    placement = one_chunk(spec)
    schedule = lower(one_f_one_b(placement, len(batches)), spec, placement)
    run = local_run(spec, placement, schedule, backend, lambda mb: batches[mb], eps_loss)
    settings = StepSettings(clip=CLIP, lr=LR)

    def step() -> float:
        run.step()
        (ex,) = run.executors
        optimizer_update(backend, list(ex.chunks.values()), 0, settings)
        return float(run.loss())
    return step


def plain_step(adapter: DiffusersAdapter, precision: str, batches: list[dict]) -> Callable[[], float]:
    """The textbook loop over the same UNet: autocast forward, fp32 MSE, loss / M, the norm clipped, AdamW."""
    optimizer = torch.optim.AdamW(adapter.model.parameters(), lr=LR)
    dtype, device_type = AUTOCAST[precision], adapter.device.type

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=adapter.device)
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != TARGET}
            with torch.autocast(device_type, dtype=dtype) if dtype is not None else nullcontext():
                out = adapter.call_model(inputs)
            loss = F.mse_loss(out.float(), batch[TARGET].float())
            (loss / len(batches)).backward()
            total += loss.detach()  # read once per step, as PULSE's loop reads its loss
        torch.nn.utils.clip_grad_norm_(adapter.model.parameters(), CLIP)  # as diffusers' training scripts
        optimizer.step()
        return float(total) / len(batches)
    return step


def overhead(args: argparse.Namespace, model: str, spec: ModelSpec) -> dict:
    """Paired steps in alternating order; the median of per-pair ratios (robust to drift)."""
    device = torch.device(args.device)
    adapter, backend = adapted(model, device, args.precision)  # one UNet: both loops train its weights
    batches = fixed_batches(spec, args, device)
    runners = {"pulse": pulse_step(spec, backend, batches), "plain": plain_step(adapter, args.precision, batches)}
    sync = synchronizer(device)

    def timed(name: str) -> float:
        sync()
        start = time.perf_counter()
        runners[name]()
        sync()
        return time.perf_counter() - start

    for name in runners:  # warm-up: optimizer state, kernels chosen, caches
        timed(name)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(args.pairs):
        for name in (("pulse", "plain") if i % 2 == 0 else ("plain", "pulse")):
            times[name].append(timed(name))
    ratios = [a / b for a, b in zip(times["pulse"], times["plain"])]
    out = {"pairs": args.pairs, "pulse_step_ms": statistics.median(times["pulse"]) * 1e3,
           "plain_step_ms": statistics.median(times["plain"]) * 1e3,
           "overhead_pct": (statistics.median(ratios) - 1) * 100, "target_pct": 5.0}
    del runners, adapter, backend, batches
    release(device)
    return out


# -- (d) the simulated step against (c)'s measured one ---------------------------------------------
def predicted_step(spec: ModelSpec, costs: CostTable, microbatches: int) -> float:
    """The simulator's whole step (``pulse.sim.step``: actions, then the optimizer) of (c)'s one-chunk plan."""
    placement = one_chunk(spec)
    schedule = one_f_one_b(placement, microbatches)
    cluster = load_cluster("cpu-local")
    result = simulate(spec, placement, schedule, costs, cluster)
    return step_time(spec, placement, costs, cluster, result, StepTerms(dp=1)).total


def step_time_check(spec: ModelSpec, tables: dict[str, CostTable], measured_ms: float, microbatches: int) -> dict:
    """Each profile's prediction of (c)'s step: as `pulse train` prices the plan the profile timed (its
    one chunk measured whole: ``CostTable.spans``), and from the layers' figures alone (no spans)."""
    rows = {}
    for timing, costs in tables.items():
        predicted_ms = predicted_step(spec, costs, microbatches) * 1e3
        layers_ms = predicted_step(spec, replace(costs, spans=()), microbatches) * 1e3
        rows[timing] = {"predicted_step_ms": predicted_ms, "miss_pct": (predicted_ms / measured_ms - 1) * 100,
                        "from_layers_step_ms": layers_ms, "from_layers_miss_pct": (layers_ms / measured_ms - 1) * 100}
    return {"measured_step_ms": measured_ms, "by_device_timing": rows, "target_pct": 15.0}


# -- the check ------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def check(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; give --device cpu to run the logic on a CPU")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pulse-gpu-check-") as tmp:
        model = write_model(args.model, Path(tmp))
        spec = load_model(model, {})
        result: dict[str, Any] = {
            "device": device_name(device), "device_type": device.type, "torch": torch.__version__,
            "model": args.model, "parameters": spec.total_params, "precision": args.precision,
            "microbatch_size": args.microbatch_size}
        tables: dict[str, CostTable] = {}
        if "a" in args.parts:
            result["profiles"] = []
            for timing in args.device_timings.split(","):
                figures, tables[timing] = profile(args, model, Path(tmp), timing)
                result["profiles"].append(figures)
                print(f"(a) profile: {json.dumps(figures)}", flush=True)
        if "b" in args.parts and tables:
            result["memory"] = memory(args, model, spec, next(iter(tables.values())))
            print(f"(b) memory: {json.dumps(result['memory']['devices'])}", flush=True)
        if "c" in args.parts:
            result["overhead"] = overhead(args, model, spec)
            print(f"(c) overhead: {json.dumps(result['overhead'])}", flush=True)
        if "d" in args.parts and tables and "overhead" in result:
            result["time"] = step_time_check(spec, tables, result["overhead"]["pulse_step_ms"], args.microbatches)
            print(f"(d) time: {json.dumps(result['time'])}", flush=True)
    result["wall_seconds"] = time.perf_counter() - began
    return result


def write_result(result: dict, path: str) -> None:
    """``result`` as JSON at ``path``, and a line saying where, on what device, in how long."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['device']}, {result['wall_seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    write_result(check(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
