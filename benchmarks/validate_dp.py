"""Data-parallel steps, predicted vs measured: the gradient buckets held against real gloo processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_dp.py [--models tiny-unet tiny-uvit] [--workdir DIR]

``benchmarks/validate.py``'s rows are all one replica (dp 1); the tuner picks plain data parallelism in
most headline rows, and prices its all-reduce as DDP runs it (``pulse.grad_buckets``: buckets of whole
layers launched as the backward makes them final). This holds that price against real runs, the way
validate.py holds the pipeline's. Per model and per group of ranks (2, then 4):

  1. ``pulse profile --pp P --dp D`` (the group's shape) times every layer with all its processes at once
     and the links, the all-reduce of each group size included, into a cost table and a cluster;
  2. each configuration trains for real (``pulse train --costs --cluster``: planned and its ranks cut on
     that profile) in mirrored order with a profile between the halves and one after (A B C, profile,
     C B A, profile: this host's speed drifts, ``run_windows``); a run is predicted on the mean of the
     profiles right around it (``pulse.planner.price_plan``, the bucket cap the run used);
  3. measured: the mean step after WARMUP steps of each run; a row: the mean of its two runs.
  4. every profile and every run sits between two host-speed probes (``host_speed``: this host's speed
     swings 15-20% within a minute); each row is predicted a second time with its compute priced at the
     speed its runs saw against the profiles' (``at host speed``), as validate.py does.

Configurations (global batch 16, microbatches of 2): plain data parallelism, with DDP's 25 MiB buckets
(one per rank here) and with a bucket per layer (``--bucket-cap-mb 0.001``: the all-reduces launch
inside the backward); beside them a pipeline of the same ranks without replicas, and on four ranks
two V pipelines of two replicas. Four ranks share this machine's two cores: their profile measured the
same sharing. Writes benchmarks/results/validate_dp.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pulse.costs import CostTable
from pulse.grad_buckets import BUCKET_CAP_BYTES
from pulse.hardware import load_cluster
from pulse.plan import load_plan
from pulse.planner import price_plan
from pulse.profiling.mean import at_speed, mean_cluster, mean_costs
from pulse.zoo import get_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_speed import HostSpeed, slowdown  # noqa: E402
from validate import run  # noqa: E402  (a command into its log, one thread a rank)

BIN = Path(sys.executable).parent
RESULTS = Path(__file__).resolve().parent / "results"
GLOBAL_BATCH, MICROBATCH = 16, 2
WARMUP, MEASURED = 2, 10
LAYER_BUCKETS_MB = 0.001  # below any layer's gradients: a bucket per layer
MODELS = ("tiny-unet", "tiny-uvit")
HOST = HostSpeed()  # probed around every profile and every run


@dataclass(frozen=True)
class Config:
    label: str
    pp: int
    dp: int
    bucket_mb: float | None = None  # None: DDP's default cap

    @property
    def ranks(self) -> int:
        return self.pp * self.dp

    def train_args(self) -> list[str]:
        shape = ["--partitioner", "sequential", "--schedule", "1f1b"] if self.pp == 1 else \
            ["--partitioner", "pulse", "--schedule", "zero_bubble_v"]
        buckets = [] if self.bucket_mb is None else ["--bucket-cap-mb", str(self.bucket_mb)]
        num_mb = GLOBAL_BATCH // (self.dp * MICROBATCH)
        return ["--pp", str(self.pp), "--dp", str(self.dp), "--microbatch-size", str(MICROBATCH),
                "--num-microbatches", str(num_mb), *shape, *buckets]

    @property
    def bucket_cap(self) -> int:
        return BUCKET_CAP_BYTES if self.bucket_mb is None else int(self.bucket_mb * 2**20)


# (the group's profile shape (pp, dp), its configurations)
GROUPS = (((2, 1), (Config("dp2", 1, 2), Config("dp2, a bucket per layer", 1, 2, LAYER_BUCKETS_MB),
                    Config("pp2 (no replicas)", 2, 1))),
          ((2, 2), (Config("V pp2 x dp2", 2, 2), Config("V pp2 x dp2, a bucket per layer", 2, 2, LAYER_BUCKETS_MB),
                    Config("dp4", 1, 4))))


@dataclass(frozen=True)
class Profile:
    costs: CostTable
    cluster: object
    probes: tuple[float, float]  # the host's speed right before and after it


def profile(model: str, shape: tuple[int, int], where: Path, when: str) -> Profile:
    costs, cluster = where / f"costs{when}.yaml", where / f"cluster{when}.yaml"
    before = HOST.probe()
    run([str(BIN / "pulse"), "profile", "--model", model, "--pp", str(shape[0]), "--dp", str(shape[1]),
         "--microbatch-size", str(MICROBATCH), "--out-costs", str(costs), "--out-cluster", str(cluster)],
        where / "profile.log")
    return Profile(CostTable.load(costs), load_cluster(str(cluster)), (before, HOST.probe()))


def train(model: str, config: Config, where: Path, name: str) -> tuple[list[float], Path, float]:
    """The run's measured steps, its plan, and the host's speed probed around it."""
    out = where / name
    before = HOST.probe()
    run([str(BIN / "pulse"), "train", "--model", model, *config.train_args(), "--costs", str(where / "costs.yaml"),
         "--cluster", str(where / "cluster.yaml"), "--steps", str(WARMUP + MEASURED), "--out-dir", str(out)],
        where / "train.log")
    probe = (before + HOST.probe()) / 2
    log = json.loads((out / "log.json").read_text())
    return [s["seconds"] for s in log["steps"][WARMUP:]], out / "plan.yaml", probe


def predicted(plan_path: Path, config: Config, profiles: list[Profile], probe: float) -> tuple[float, float]:
    """The run's step on the mean of the profiles around it, plainly and at the host speed probed around it."""
    plan, _ = load_plan(plan_path)
    spec = get_spec(plan.model)
    costs = mean_costs([p.costs for p in profiles])
    cluster = mean_cluster([p.cluster for p in profiles])
    factor = slowdown([probe], [x for p in profiles for x in p.probes])
    return tuple(float(price_plan(spec, table, cluster, plan, bucket_cap=config.bucket_cap).predicted["step_seconds"])
                 for table in (costs, at_speed(costs, factor)))


def validate_group(model: str, shape: tuple[int, int], configs: tuple[Config, ...], where: Path) -> list[dict]:
    """A B C, profile, C B A, profile: each run predicted on the profiles right around it."""
    where.mkdir(parents=True, exist_ok=True)
    profiles = {"": profile(model, shape, where, "")}
    runs: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(configs))}
    halves = ((list(range(len(configs))), "", "-mid"), (list(reversed(range(len(configs)))), "-mid", "-after"))
    for order, before, after in halves:
        done = [(i, *train(model, configs[i], where, f"run{i}{after}")) for i in order]
        profiles[after] = profile(model, shape, where, after)
        for i, steps, plan_path, probe in done:
            runs[i].append((statistics.mean(steps),
                            *predicted(plan_path, configs[i], [profiles[before], profiles[after]], probe)))
            m, p, at = runs[i][-1]
            print(f"  {model} {configs[i].label}: measured {m * 1e3:.1f} ms, predicted {p * 1e3:.1f} ms "
                  f"({at * 1e3:.1f} at host speed)", flush=True)
    rows = []
    for i, config in enumerate(configs):
        measured = statistics.mean(m for m, _, _ in runs[i])
        guess = statistics.mean(p for _, p, _ in runs[i])
        at_host = statistics.mean(a for _, _, a in runs[i])
        rows.append({"model": model, "config": config.label, "pp": config.pp, "dp": config.dp,
                     "bucket_cap_mb": config.bucket_mb, "ranks": config.ranks,
                     "measured_s": measured, "predicted_s": guess, "error": guess / measured - 1,
                     "predicted_at_host_speed_s": at_host, "error_at_host_speed": at_host / measured - 1,
                     "runs_s": [m for m, _, _ in runs[i]], "predicted_runs_s": [p for _, p, _ in runs[i]]})
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "", "| model | configuration | ranks | measured ms (two runs) | predicted ms | error "
             "| at host speed | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = " / ".join(f"{s * 1e3:.1f}" for s in r["runs_s"])
        lines.append(f"| {r['model']} | {r['config']} | {r['ranks']} | {r['measured_s'] * 1e3:.1f} ({runs}) | "
                     f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} | {r['predicted_at_host_speed_s'] * 1e3:.1f} | "
                     f"{r['error_at_host_speed']:+.1%} |")
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    at_host = max((abs(r["error_at_host_speed"]) for r in rows), default=0.0)
    return "\n".join(lines + ["", f"Worst |error|: {worst:.1%} ({at_host:.1%} at host speed) over {len(rows)} rows."]) \
        + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--workdir", default=None, help="keep profiles, plans and logs here")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pulse-validate-dp-"))
    started, rows = time.time(), []
    for model in args.models:
        for shape, configs in GROUPS:
            print(f"{model}, {shape[0] * shape[1]} ranks:", flush=True)
            rows += validate_group(model, shape, configs, workdir / model / f"ranks{shape[0] * shape[1]}")
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_dp.py " + " ".join(sys.argv[1:])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "validate_dp.json").write_text(json.dumps({"command": command, "rows": rows,
                                                          "seconds": round(time.time() - started)}, indent=1))
    text = markdown(rows, command)
    (RESULTS / "validate_dp.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
