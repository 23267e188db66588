"""What MindSpore's CPU runtime keeps resident beyond the tensors a program holds: SD v2's decoder end, alone.

    python benchmarks/mindspore_pool_pages.py [--steps 6] [--resolution 256]
        [--empty-cache] [--set-memory INIT INCREASE]   # the pool's two knobs, e.g. --set-memory 0.1GB 0.1GB

The SD v2 UNet config (``benchmarks/sd2_unet_config.json``, random weights) is planned as ``pulse train
--backend mindspore --pp 2 --microbatch-size 1 --num-microbatches 2`` plans it; then one process, with no
executor, communicator or optimizer, builds all four chunks and repeats a step of: the forward of every
chunk for two microbatches (no tape: the MindSpore backend reruns the forward under ``mindspore.vjp`` in
B), then the backward of chunk 3 (worker 0's decoder end, layers 35-46) for both, then ``zero_grad``.

After each action it reads:

    held      bytes of every tensor the program holds (weights, chunk 3's gradients, the forwards' outputs
              and inputs): what a sampling probe of live tensors (PyTorch's malloc figure) would see
    resident  the process's VmRSS above its start
    reserved  malloc's bytes in use above the start: MindSpore's CPU pool takes its blocks from malloc

The question it answers: is worker 0's resident excess at real size (2.66 GiB against 1.75 predicted,
docs/RESULTS.md "MindSpore at real size") in PULSE's runtime, or in MindSpore's pool? Writes
benchmarks/results/mindspore_pool_pages.json (``_empty_cache`` / ``_set_memory`` with a knob) and prints a
table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30
CHUNK = 3  # worker 0's second chunk: the decoder end


def plan_sd2(workdir: Path, resolution: int) -> Path:
    """The plan ``pulse train`` makes for the real-size MindSpore run (written, not launched)."""
    from pulse.cli.main import main as pulse

    (workdir / "cfg").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmarks" / "sd2_unet_config.json", workdir / "cfg" / "config.json")
    code = pulse(["train", "--backend", "mindspore", "--diffusers-config", str(workdir / "cfg"),
                  "--model-option", f"resolution={resolution}", "--pp", "2", "--microbatch-size", "1",
                  "--num-microbatches", "2", "--plan-only", "--out-dir", str(workdir / "plan")])
    if code != 0:
        raise SystemExit(f"planning failed (exit {code})")
    return workdir / "plan" / "plan.yaml"


def measure(plan_path: Path, steps: int, empty_cache: bool = False, set_memory: list[str] | None = None) -> dict:
    import mindspore as ms
    from mindspore import ops

    from pulse.data.feed import synthetic_feed
    from pulse.plan import load_plan
    from pulse.runtime.wiring import Wiring
    from pulse.train.resident import malloc_in_use, status_bytes
    from pulse.zoo.loading import load_model
    from pulse_mindspore.backend import MindSporeBackend

    ms.set_device("CPU")
    if set_memory:
        ms.runtime.set_memory(init_size=set_memory[0], increase_size=set_memory[1])
    plan, spec = load_plan(plan_path, load_model)
    wiring = Wiring(spec, plan.placement)
    rss0, malloc0 = status_bytes("VmRSS"), malloc_in_use() or 0
    backend = MindSporeBackend(seed=0, lr=1e-3)
    chunks = [backend.build_chunk(spec, io) for io in wiring.ios]
    feed = synthetic_feed(spec, 1, 2)
    rows: list[dict] = []

    def read(step: int, action: str, held: list) -> None:
        tensors = {id(t): t for t in held if t is not None}
        row = {"step": step, "action": action, "held_gib": sum(int(t.nbytes) for t in tensors.values()) / GiB,
               "resident_gib": (status_bytes("VmRSS") - rss0) / GiB,
               "reserved_gib": ((malloc_in_use() or 0) - malloc0) / GiB}
        rows.append(row)
        print(f"{step:>4} {action:<12} {row['held_gib']:8.3f} {row['resident_gib']:10.3f} "
              f"{row['reserved_gib']:10.3f} {row['resident_gib'] - row['held_gib']:10.3f}", flush=True)

    weights = [p for c in chunks for p in c.params.values()]
    print(f"{'step':>4} {'action':<12} {'held':>8} {'resident':>10} {'reserved':>10} {'beyond':>10}  (GiB)")
    read(0, "built", weights)
    for step in range(steps):
        saved, kept = [], []
        for m in range(2):
            env = {k: backend.place(v) for k, v in feed.batch(0, 0, m).items()}
            for c, chunk in enumerate(chunks):
                out, ctx = backend.forward(chunk, env, wiring.ios[c].grad_names if c else frozenset())
                env.update(out)
            saved.append((ctx, out))
            kept += list(env.values())
            read(step, f"F mb{m}", weights + list(chunks[CHUNK].grads.values()) + kept)
        for m, (ctx, out) in enumerate(saved):
            backend.backward(ctx, {k: ops.ones_like(v) for k, v in out.items() if v.dtype == ms.float32})
            read(step, f"B{CHUNK} mb{m}", weights + list(chunks[CHUNK].grads.values()) + kept)
            if empty_cache:
                ms.runtime.empty_cache()
                read(step, "empty_cache", weights + list(chunks[CHUNK].grads.values()) + kept)
        del saved, kept, ctx, out, env
        backend.zero_grad(chunks[CHUNK])
        read(step, "zero_grad", weights)
    return {"plan": str(plan_path), "chunk": CHUNK, "steps": steps, "empty_cache": empty_cache,
            "set_memory": set_memory, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--empty-cache", action="store_true", help="mindspore.runtime.empty_cache() after each B")
    parser.add_argument("--set-memory", nargs=2, metavar=("INIT", "INCREASE"),
                        help="mindspore.runtime.set_memory(init_size=INIT, increase_size=INCREASE) first")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pulse-pool-") as tmp:
        result = measure(plan_sd2(Path(tmp), args.resolution), args.steps, args.empty_cache, args.set_memory)
    rows = result["rows"]
    last = [r for r in rows if r["step"] == args.steps - 1]
    result.update(resolution=args.resolution, seconds=round(time.time() - started, 1),
                  final_resident_beyond_held_gib=round(rows[-1]["resident_gib"] - rows[-1]["held_gib"], 3),
                  last_step_peak_resident_gib=round(max(r["resident_gib"] for r in last), 3),
                  last_step_peak_held_gib=round(max(r["held_gib"] for r in last), 3))
    RESULTS.mkdir(exist_ok=True)
    suffix = "_empty_cache" if args.empty_cache else "_set_memory" if args.set_memory else ""
    (RESULTS / f"mindspore_pool_pages{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
