"""Frozen encoders in the pipeline's bubbles, in simulation: PULSE V vs DiffusionPipe-style pipelines.

For SD 2 (OpenCLIP ViT-H/14 text encoder + SD VAE encoder, 512 px) and Hunyuan-DiT
(bilingual CLIP + mT5-XL encoders + SDXL VAE encoder, 1024 px) on Ascend 910A, each
pipeline is priced with its frozen encoders

    cached    encoded offline: no encode work in the step (the floor)
    before    every encode on the first device before the pipeline starts
              (DiffusionPipe's "sequential" non-trainable part)
    bubbles   each encode in the earliest idle gap that hurts least (pulse.schedule.encode)

for two placements of the same backbone on the same devices: PULSE's skip-local
V (its list schedules, the better one) and a DiffusionPipe-style sequential
pipeline (DiffusionPipe's partition, skips relayed, 1F1B), with the same filling.
The encoders' times are the layers' roofline on the hardware figures
(pulse.costs.encoder_roofline); their hyper-parameters' sources are printed. These
are simulated figures, not measurements.

    python benchmarks/encoders_sim.py [--num-microbatches 16] [--cluster ascend-910a-1x8]

Writes benchmarks/results/encoders_sim.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pulse.costs import AnalyticProfiler, with_encoder_costs
from pulse.hardware import load_cluster
from pulse.partition import partition
from pulse.partition.symmetric import plan_symmetric
from pulse.schedule.generators import greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.sim.encodes import place_encodes
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, step_time
from pulse.tune.tuner import default_budget
from pulse.zoo import get_spec
from pulse.zoo.encoders import zoo_encoders

OUT = Path(__file__).resolve().parent / "results"
RUNS = (("sd2-unet", 2), ("hunyuan-dit", 1))  # (model, microbatch size)
MODES = ("cached", "before", "bubbles")


def pipelines(spec, costs, cluster, pp: int):
    """(name, placement, schedule makers) of the two strategies compared."""
    v = plan_symmetric(spec, costs, pp, folds=1, strict=False, cluster=cluster).placement
    seq = partition("diffusionpipe", spec, costs, pp, cluster=cluster)
    return (("PULSE V", v, (greedy_v_1f1b, zero_bubble_v)),
            ("DiffusionPipe-style seq 1F1B", seq, (lambda p, m, c: one_f_one_b(p, m),)))


def run_model(model: str, mbs: int, cluster_name: str, pp: int, num_mb: int) -> dict:
    spec, cluster = get_spec(model), load_cluster(cluster_name)
    budget = default_budget(cluster)
    encoders = zoo_encoders(spec)
    costs = with_encoder_costs(AnalyticProfiler(cluster.hardware).profile(spec, mbs), encoders, cluster.hardware)
    out = {"model": model, "cluster": cluster_name, "pp": pp, "microbatch_size": mbs, "num_microbatches": num_mb,
           "encoders": [{"name": e.name, "params": e.params, "gflops_per_sample": e.flops / 1e9,
                         "out_bytes_per_sample": e.out_bytes, "ms_per_microbatch": costs.encoder_seconds(e.name) * 1e3,
                         "source": e.source} for e in encoders.encoders],
           "backbone_ms_per_microbatch": sum(costs.fwd) * 1e3 + sum(costs.bwd) * 1e3, "rows": []}
    for name, placement, makers in pipelines(spec, costs, cluster, pp):
        for mode in MODES:
            plan_encoders = encoders.with_mode(mode) if mode != "cached" else None
            best = None
            for make in makers:
                schedule = make(placement, num_mb, costs)
                if plan_encoders is not None:
                    schedule = place_encodes(spec, placement, schedule, costs, cluster, plan_encoders, budget)
                result = simulate(spec, placement, schedule, costs, cluster, memory_budget=budget,
                                  encoders=plan_encoders)
                step = step_time(spec, placement, costs, cluster, result, StepTerms(dp=1))
                if best is None or step.total < best[1].total:
                    best = (result, step, schedule.name)
            result, step, schedule_name = best
            out["rows"].append({"pipeline": name, "encoders": mode, "schedule": schedule_name,
                                "step_ms": step.total * 1e3, "bubble": result.bubble_ratio,
                                "peak_memory_gib": max(result.peak_memory) / 2**30, "fits": result.fits_memory,
                                "p2p_mb": result.total_link_bytes / 1e6})
    return out


def table(run: dict) -> str:
    lines = [f"{run['model']} on {run['cluster']}: pp {run['pp']}, {run['num_microbatches']} microbatches of "
             f"{run['microbatch_size']} (backbone fwd+bwd {run['backbone_ms_per_microbatch']:.1f} ms/microbatch "
             "on one device)"]
    for e in run["encoders"]:
        lines.append(f"  encoder {e['name']:<5} {e['params'] / 1e6:7.1f}M params {e['gflops_per_sample']:8.1f} "
                     f"GFLOP/sample {e['ms_per_microbatch']:7.2f} ms/microbatch  source: {e['source']}")
    lines.append(f"  {'pipeline':<30}{'encoders':<9}{'schedule':<15}{'step ms':>9}{'vs cached':>10}"
                 f"{'vs before':>10}{'bubble':>8}{'peak GiB':>9}  fits")
    rows = run["rows"]
    for r in rows:
        same = {x["encoders"]: x for x in rows if x["pipeline"] == r["pipeline"]}
        lines.append(f"  {r['pipeline']:<30}{r['encoders']:<9}{r['schedule']:<15}{r['step_ms']:>9.1f}"
                     f"{r['step_ms'] / same['cached']['step_ms']:>9.2f}x{same['before']['step_ms'] / r['step_ms']:>9.2f}x"
                     f"{r['bubble']:>8.1%}{r['peak_memory_gib']:>9.2f}  {'yes' if r['fits'] else 'NO'}")
    by = {(r["pipeline"], r["encoders"]): r["step_ms"] for r in rows}
    lines.append(f"  PULSE V with encoders in bubbles vs DiffusionPipe-style with encoders in bubbles: "
                 f"{by[('DiffusionPipe-style seq 1F1B', 'bubbles')] / by[('PULSE V', 'bubbles')]:.2f}x; "
                 f"vs DiffusionPipe-style with encoders before: "
                 f"{by[('DiffusionPipe-style seq 1F1B', 'before')] / by[('PULSE V', 'bubbles')]:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="ascend-910a-1x8")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=16)
    args = parser.parse_args()
    started = time.monotonic()
    runs = [run_model(model, mbs, args.cluster, args.pp, args.num_microbatches) for model, mbs in RUNS]
    for run in runs:
        print(table(run))
        print()
    print(f"simulated in {time.monotonic() - started:.1f} s (analytic roofline costs on the hardware figures of "
          f"configs/hardware; not measurements)")
    OUT.mkdir(exist_ok=True)
    (OUT / "encoders_sim.json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"written to {OUT / 'encoders_sim.json'}")


if __name__ == "__main__":
    main()
