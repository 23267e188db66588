"""Predicted vs measured step time with and without activation recomputation (``Plan.recompute``).

    .venv/bin/python benchmarks/recompute.py [--steps 8] [--pp 2] [--workdir DIR]

tiny-unet on the pulse V over P gloo processes (``torchrun -m pulse_torch.train``), microbatch 2,
2P microbatches, each schedule (greedy V 1F1B, zero-bubble V) with no chunk and with every
chunk recomputing. The cost table and cluster are measured first by ``pulse profile`` (as
``validate.py`` does); the prediction is ``pulse.sim`` with ``MemoryModel(recompute=...)``.
Measured = mean step time after two warm-up steps (``validate.measure``).

Memory is predicted only: on the CPU a rank's resident memory is some 400 MB of interpreter,
libraries and allocator caches around the few MB of tiny-unet activations that
recomputation saves, and torch has no CPU counterpart of ``cuda.max_memory_allocated``; the
predicted peaks are printed next to the measured times. ``tests/test_torch_recompute.py``
checks instead that a recomputing forward keeps no graph. Writes
benchmarks/results/recompute.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from validate import MICROBATCH, RESULTS, measure, profile

from pulse.cli.common import ACT_BYTES
from pulse.costs import CostTable
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.plan import Plan
from pulse.schedule.generators import make_schedule
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel
from pulse.sim.step import StepTerms, step_time
from pulse.zoo.loading import load_model

MODEL = "tiny-unet"
SCHEDULES = ("greedy_v_1f1b", "zero_bubble_v")


@dataclass(frozen=True)
class Row:
    schedule: str
    recompute: str  # "none" or "all"
    predicted_s: float
    measured_s: float
    predicted_peak_bytes: int  # the worst rank's simulated peak (static + activations + buffers)
    predicted_activation_bytes: int  # its activations at that peak

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def rows_for(pp: int, steps: int, workdir: Path) -> list[Row]:
    spec = load_model(MODEL).with_act_bytes(ACT_BYTES["fp32"])
    costs_path, cluster_path = profile(MODEL, pp, workdir)
    costs, cluster = CostTable.load(costs_path), load_cluster(str(cluster_path))
    num_mb = 2 * pp
    placement = plan_symmetric(spec, costs, pp, folds=1, strict=False, cluster=cluster,
                               num_microbatches=num_mb).placement
    out = []
    for name in SCHEDULES:
        plan = Plan(model=MODEL, cluster="measured", pp=pp, dp=1, microbatch_size=MICROBATCH,
                    num_microbatches=num_mb, partitioner="pulse", placement=placement,
                    schedule=make_schedule(name, placement, num_mb, costs))
        for label, chunks in (("none", ()), ("all", tuple(range(len(placement.chunks))))):
            planned = replace(plan, recompute=chunks)
            result = simulate(spec, placement, plan.schedule, costs, cluster,
                              memory=MemoryModel(recompute=frozenset(chunks)))
            predicted = step_time(spec, placement, costs, cluster, result, StepTerms(dp=1, grad_bytes=4)).total
            worst = max(range(pp), key=lambda d: result.peak_memory[d])
            seconds = measure(planned, spec, workdir, f"{name}-{label}", steps, None)
            out.append(Row(name, label, predicted, seconds, result.peak_memory[worst],
                           result.memory[worst].activations))
            print(format_row(out[-1]), flush=True)
    return out


def format_row(r: Row) -> str:
    return (f"{r.schedule:<15} recompute {r.recompute:<5} predicted {r.predicted_s * 1e3:8.2f} ms  measured "
            f"{r.measured_s * 1e3:8.2f} ms  error {r.error:+6.1%}  "
            f"predicted peak {r.predicted_peak_bytes / 2**20:7.2f} MiB "
            f"(activations {r.predicted_activation_bytes / 2**20:6.2f} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="keep plans, logs and profiles here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_for(args.pp, args.steps, Path(args.workdir or tmp))
    by = {(r.schedule, r.recompute): r for r in rows}
    for name in SCHEDULES:
        off, on = by[(name, "none")], by[(name, "all")]
        print(f"{name}: recomputation costs {on.predicted_s / off.predicted_s - 1:+.1%} predicted, "
              f"{on.measured_s / off.measured_s - 1:+.1%} measured; predicted activations at the peak "
              f"{off.predicted_activation_bytes / 2**20:.2f} -> {on.predicted_activation_bytes / 2**20:.2f} MiB")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "recompute.json").write_text(json.dumps(
        {"model": MODEL, "pp": args.pp, "steps": args.steps, "microbatch_size": MICROBATCH,
         "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
