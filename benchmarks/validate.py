"""Predicted vs measured step time: the simulator held against real gloo processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate.py [--steps 4] [--models tiny-unet ...] [--pp 2 4] [--workdir DIR]
    .venv/bin/python benchmarks/validate.py --from-json validate.json [--replan | --repredict [--ends-only]] --workdir DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate.py --pp 4 --keep benchmarks/results/validate.json
        (measure P = 4 again; the earlier run's other rows stay in the tables, each row names its commit)

For every model and pipeline depth P, and every link rate (the free link first):
  1. ``pulse profile`` measures afresh, right before the link's runs, on P processes at once
     (torchrun, as training runs), every layer's forward / input-backward / weight-backward /
     optimizer time and the links (per-message cost, latency, bandwidth, all-reduce) into a
     cost table and a cluster YAML; the configurations are planned on it;
  2. three emulated link rates are derived from the sequential plan so that moving one
     microbatch's boundary messages takes about 0.1x, 1x and 5x one device's compute for
     that microbatch (communication from negligible to dominant), plus the free link;
  3. each configuration (sequential + 1F1B, V + greedy, V + ZB-V, 2-fold wave + greedy) is
     planned on those measurements (link-aware: the partitioner sees the link it will get),
     predicted by ``pulse.sim`` (program engine + step model) on the measured cluster with
     the emulated bandwidth, and run for real (``torchrun -m pulse_torch.train``, with
     ``--emulate-bandwidth``); measured = mean step time after two warm-up steps (the run's
     throughput), over enough steps to span ~1 s; every configuration runs twice, in mirrored
     order with a profile between the halves and one after (A B C, profile, C B A, profile),
     and their run-to-run spread is printed: the noise floor of this host; each run is
     predicted on the mean of the profiles right before and right after it
     (``run_windows``, ``pulse.profiling.mean``), and each row on the mean of its runs';
     every profile and every run sits between two host-speed probes (``host_speed``: a fixed
     workload in this process), and every row is predicted a second time with its compute
     priced at the speed its runs saw against the profiles' (``error at host speed``): the
     first error is the simulator's plus this host's swings; the second takes out what the
     probe reads of them (about half, on the run at b8bcde5: README);
     a pair whose runs order it against the prediction runs twice more each (A B B A), then a
     profile, round after round, until the runs settle it (``measured_order``: its 95% interval on the step
     times excludes zero, or is within 1% of them) or three rounds are done.
     Why afresh, mirrored and bracketed: this host's speed drifts (the same layers timed
     10-18% apart a few minutes later), and a profile from half an hour before, profiles
     minutes away from a run, or a ranking measured along a drift, would be the drift's and
     not the simulator's.

Each row prints predicted, measured and the error; each (model, P, link) group says
whether the measured ranking of configurations equals the predicted one: no pair that the
runs order (its interval excludes zero) is ordered against the prediction. A pair the runs
cannot order is a tie, listed with its interval; the strict order of the means is printed
beside it. Rows with more
ranks than this machine has cores are marked: their ranks share cores, which the cost
table measured under the same sharing. Writes benchmarks/results/validate.json and .md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from pulse.cli.common import ACT_BYTES
from pulse.planner import memory_of
from pulse.zoo.loading import load_model
from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster, load_cluster
from pulse.partition import partition, plan_symmetric
from pulse.plan import Plan, load_plan
from pulse.profiling.mean import at_speed, mean_cluster, mean_costs
from pulse.schedule.generators import make_schedule
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, step_time
from pulse.spec import ModelSpec
from pulse.traffic import transfers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_order  # noqa: E402
from host_speed import HostSpeed  # noqa: E402
import run_windows  # noqa: E402
from run_windows import Profile, Timeline, Window  # noqa: E402
from measured_order import inversion_text, measured_gap  # noqa: E402,F401  (inversion_text: validate_mindspore's)
from validate_report import (BALANCED, RESULTS, Row, format_row, rows_of, summary,  # noqa: E402,F401
                             worst_error, write_results)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(sys.executable).parent
MICROBATCH = 2
# A diffusers UNet2DConditionModel config (the user's own modules, profiled and trained as they are).
DIFFUSERS_UNET = {"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64, 64], "layers_per_block": 1,
                  "sample_size": 32, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 32,
                  "attention_head_dim": 8, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                                "DownBlock2D"],
                  "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
MODELS = ("tiny-unet", "tiny-uvit", "tiny-dit", "diffusers-unet")
# label -> (partitioner, folds, schedule); PULSE's V is link-aware (it sees the link it will get)
STRATEGIES = {"seq+1f1b": ("sequential", 1, "1f1b"), "V+greedy": ("pulse", 1, "greedy_v_1f1b"),
              "V+zbv": ("pulse", 1, "zero_bubble_v"), "wave2+greedy": ("pulse", 2, "greedy_v_1f1b")}
COMM_RATIOS = (0.1, 1.0, 5.0)  # boundary-message time / device compute per microbatch
WARMUP_STEPS = 2
MEASURE_SECONDS, MAX_STEPS = 1.0, 60  # per run; every row is run twice
# a group's profiles after its first one: between its mirrored halves, after them, after each recheck round
MID, AFTER, RECHECKED = "-mid", "-after", "-recheck"
RECHECK_ROUNDS = 3  # at most, per pair the runs order against the prediction: A B B A each
HOST = HostSpeed()  # probed beside every profile and every run: the host's speed then
CODE = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip() or "unknown"  # the commit each row was measured at


def model_name(model: str, workdir: Path) -> str:
    """A zoo name, or ``diffusers:<folder>`` for the diffusers config written into ``workdir``."""
    if model != "diffusers-unet":
        return model
    folder = workdir / "diffusers-unet"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(DIFFUSERS_UNET))
    return f"diffusers:{folder}"


def profile_files(workdir: Path, pp: int, when: str = "") -> tuple[Path, Path, Path]:
    """One profile's files in a group's directory: costs, cluster and the host probes beside it;
    ``when``: "" for the profile before the group's runs, else where it sits (``MID``, ``AFTER``...)."""
    return (workdir / f"costs-pp{pp}{when}.yaml", workdir / f"cluster-pp{pp}{when}.yaml",
            workdir / f"probes-pp{pp}{when}.json")


def profile(model: str, pp: int, workdir: Path, when: str = "") -> tuple[Path, Path]:
    """``pulse profile`` on ``pp`` processes: (costs.yaml, cluster.yaml), probed before and after."""
    costs, cluster, probes = profile_files(workdir, pp, when)
    workdir.mkdir(parents=True, exist_ok=True)
    if not costs.exists():
        before = HOST.probe()
        run([str(BIN / "pulse"), "profile", *model_args(model), "--pp", str(pp), "--microbatch-size",
             str(MICROBATCH), "--out-costs", str(costs), "--out-cluster", str(cluster)], workdir / "profile.log")
        probes.write_text(json.dumps([before, HOST.probe()]))
    return costs, cluster


def loaded_profile(pp: int, where: Path, when: str, bandwidth: float | None) -> Profile:
    """A profile already taken: its cost table, its cluster at the group's link, its host probes."""
    costs, cluster, probes = profile_files(where, pp, when)
    return Profile(CostTable.load(costs), with_bandwidth(load_cluster(str(cluster)), bandwidth),
                   tuple(json.loads(probes.read_text())) if probes.exists() else ())


def profiler(name: str, pp: int, where: Path, bandwidth: float | None) -> Callable[[str], Profile]:
    """What a group's ``Timeline`` calls to profile now (a profile on disk is reused: --replan's)."""
    def take(when: str) -> Profile:
        profile(name, pp, where, when)
        return loaded_profile(pp, where, when, bandwidth)
    return take


def profiles_mean(profiles: list[Profile]) -> tuple[CostTable, Cluster]:
    return mean_costs([p.costs for p in profiles]), mean_cluster([p.cluster for p in profiles])


def model_args(model: str) -> list[str]:
    if model.startswith("diffusers:"):
        return ["--diffusers-config", model.split(":", 1)[1]]
    return ["--model", model]


def run(command: list[str], log: Path, env: dict | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"{command[:3]} failed with exit code {code}; see {log}")


def link_rates(spec: ModelSpec, costs: CostTable, pp: int) -> list[float]:
    """Rates at which one microbatch's boundary messages take COMM_RATIOS x a device's compute."""
    placement = partition("sequential", spec, costs, pp)
    per_mb = max(tr.total_bytes for tr in transfers(spec, placement)) * MICROBATCH
    compute = max(sum(costs.fwd[c.start:c.end]) + sum(costs.bwd[c.start:c.end]) for c in placement.chunks)
    return [float(f"{per_mb / (k * compute):.2g}") for k in COMM_RATIOS]


def with_bandwidth(cluster: Cluster, bandwidth: float | None) -> Cluster:
    """The measured cluster with every link at the emulated rate (latency and per-message costs kept)."""
    return cluster if bandwidth is None else cluster.with_link_bandwidth(bandwidth)


def build_plan(spec: ModelSpec, model: str, costs: CostTable, cluster: Cluster, pp: int, strategy: str,
               num_mb: int) -> Plan:
    partitioner, folds, schedule_name = STRATEGIES.get(strategy, ("pulse", 1, "greedy_v_1f1b"))
    if partitioner == "pulse":
        objective = "balance" if strategy == BALANCED else "time"
        placement = plan_symmetric(spec, costs, pp, folds=folds, strict=False, cluster=cluster,
                                   objective=objective, num_microbatches=num_mb).placement
    else:
        placement = partition(partitioner, spec, costs, pp, cluster=cluster)
    schedule = make_schedule(schedule_name, placement, num_mb, costs)
    return Plan(model=model, cluster="measured", pp=pp, dp=1, microbatch_size=MICROBATCH, num_microbatches=num_mb,
                partitioner=partitioner, placement=placement, schedule=schedule)


def predict(spec: ModelSpec, plan: Plan, costs: CostTable, cluster: Cluster) -> tuple[float, int]:
    assert plan.schedule is not None
    result = simulate(spec, plan.placement, plan.schedule, costs, cluster, memory=memory_of(plan.recompute))
    return step_time(spec, plan.placement, costs, cluster, result, StepTerms(dp=1, grad_bytes=4)).total, \
        result.total_link_bytes


def steps_for(predicted: float, least: int) -> int:
    """Steps for one measurement: at least ``least``, more for fast steps so that every
    measurement spans about MEASURE_SECONDS (delays on a shared host come in bursts of
    milliseconds: a 20 ms step measured eight times says little), at most MAX_STEPS."""
    return max(least, min(MAX_STEPS, math.ceil(MEASURE_SECONDS / max(predicted, 1e-3))))


def measure(plan: Plan, spec: ModelSpec, workdir: Path, name: str, steps: int, bandwidth: float | None,
            env: dict | None = None) -> list[float]:
    """Seconds of each step of one real run after two warm-up steps: their mean is the run's
    throughput (the figure a user sees; the simulator's prediction is an expectation too)."""
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.yaml", spec)
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(plan.pp), "-m", "pulse_torch.train",
               "--plan", str(out / "plan.yaml"), "--steps", str(steps + WARMUP_STEPS), "--out-dir", str(out)]
    if bandwidth is not None:
        command += ["--emulate-bandwidth", str(bandwidth)]
    run(command, out / "run.log", env)
    log = json.loads((out / "log.json").read_text())
    return [s["seconds"] for s in log["steps"][WARMUP_STEPS:]]


def group_dir(workdir: Path, bandwidth: float | None) -> Path:
    """Where one link's group keeps its profile, plans and runs."""
    return workdir / f"link-{'free' if bandwidth is None else int(bandwidth)}"


def group_measurements(name: str, pp: int, workdir: Path, bandwidth: float | None) -> tuple[Path, CostTable, Cluster]:
    """One link's group: its directory, and its first profile (taken now unless on disk already):
    the cost table and the measured cluster at that link, which the configurations are planned on."""
    where = group_dir(workdir, bandwidth)
    first = profiler(name, pp, where, bandwidth)("")
    return where, first.costs, first.cluster


def validate_model(model: str, pp: int, steps: int, workdir: Path, strategies: list[str]) -> list[Row]:
    """Every link's group of configurations, each profiled afresh right before it is measured."""
    name = model_name(model, workdir)
    spec = load_model(name).with_act_bytes(ACT_BYTES["fp32"])  # what the ranks send: fp32 training
    rates = link_rates(spec, CostTable.load(profile(name, pp, group_dir(workdir, None))[0]), pp)
    rows = []
    for bandwidth in [None, *rates]:
        where, costs, cluster = group_measurements(name, pp, workdir, bandwidth)
        plans = []
        for strategy in strategies + ([BALANCED] if bandwidth == rates[-1] else []):
            try:
                plans.append((strategy, build_plan(spec, name, costs, cluster, pp, strategy, 2 * pp)))
            except PlanError as exc:  # e.g. a 2-fold wave needs more layers than the model has
                print(f"  {model} pp{pp} {strategy}: skipped ({exc})".splitlines()[0], flush=True)
        rows += measure_group(model, bandwidth, plans, spec, steps, where, profiler(name, pp, where, bandwidth))
    return rows


def measure_group(model: str, bandwidth: float | None, plans: list[tuple[str, Plan]], spec: ModelSpec,
                  steps: int, workdir: Path, take_profile: Callable[[str], Profile]) -> list[Row]:
    """One link's configurations as a timeline of profiles and runs (``run_windows``): the profile
    the plans were made on, every configuration once (A B C), a profile, once more in mirrored
    order (C B A), a profile. A drift that is linear in time adds the same to every configuration's
    mean, so the measured ranking is not the drift's; each run is predicted on the profiles right
    around it, so its prediction sees the host as the run did within half a group (profiles at the
    group's two ends alone left every row of a tiny-dit group 8-16% off the same way at b8bcde5).

    Then every pair that the runs order against the prediction runs twice more, mirrored
    (A B B A), then a profile, round after round until its runs settle it
    (``measured_order.Gap.settled``) or ``RECHECK_ROUNDS`` are done: two runs each cannot tell a
    3% gap from this host's noise, and a verdict should rest on more data exactly where it is in
    doubt (``needs_runs``).

    Every run sits between two host-speed probes (``host_speed``), as every profile does: each
    row is predicted again at the speed its runs saw against their profiles' (``priced``)."""
    link = "free" if bandwidth is None else f"{bandwidth:.2g} B/s"
    timeline = Timeline(take_profile)
    first = timeline.profile("")
    planned_on = [predict(spec, plan, first.costs, first.cluster)[0] for _, plan in plans]  # sets each run's steps
    runs: dict[int, list[list[float]]] = {i: [] for i in range(len(plans))}  # each run's step seconds

    def run_in_turn(order: list[int], then: str) -> None:
        for i in order:
            strategy, plan = plans[i]
            tag = f"{model}-pp{plan.pp}-{strategy}-run{len(runs[i])}"
            before = HOST.probe()
            runs[i].append(measure(plan, spec, workdir, tag, steps_for(planned_on[i], steps), bandwidth))
            timeline.ran(i, (before + HOST.probe()) / 2)
        timeline.profile(then)

    def rows_now() -> list[Row]:
        return [priced(measured_row(model, link, strategy, plan, (math.nan, 0), runs[i]), spec, plan, timeline,
                       timeline.windows[i]) for i, (strategy, plan) in enumerate(plans)]

    run_in_turn(list(range(len(plans))), MID)
    run_in_turn(list(reversed(range(len(plans)))), AFTER)
    rows = rows_now()
    ranked = [i for i, (strategy, _) in enumerate(plans) if strategy != BALANCED]
    rounds: dict[tuple[int, int], int] = {}
    while pair := next((p for p in disputed(ranked, rows, runs) if needs_runs(runs, p, rounds.get(p, 0))), None):
        rounds[pair] = rounds.get(pair, 0) + 1
        gap = pair_gap(runs, pair)
        print(f"  {model} pp{plans[0][1].pp} {link}: {plans[pair[0]][0]} / {plans[pair[1]][0]} measured against "
              f"the prediction ({gap.difference / gap.mean:+.1%} ± {gap.half_width / gap.mean:.1%}): "
              f"two more runs each (round {rounds[pair]} of {RECHECK_ROUNDS})", flush=True)
        run_in_turn([pair[0], pair[1], pair[1], pair[0]], f"{RECHECKED}{sum(rounds.values())}")
        rows = rows_now()
    run_windows.save(workdir, plans[0][1].pp, [strategy for strategy, _ in plans], timeline.windows)
    for row in rows:
        print(format_row(row), flush=True)
    return rows


def priced(row: Row, spec: ModelSpec, plan: Plan, timeline: Timeline, windows: list[Window]) -> Row:
    """``row`` predicted as the mean of its runs' predictions, each on the mean of the two profiles
    around the run (``Timeline.between``); and again with each run's compute priced at the host's
    speed around it against its profiles' (``at_speed``; a row predicted before the runs had
    their own probes keeps its ``host_slowdown``). The links' emulated time does not scale."""
    means = [timeline.between(w, profiles_mean) for w in windows]
    predictions = [predict(spec, plan, costs, cluster) for costs, cluster in means]
    seconds = statistics.fmean(t for t, _ in predictions)
    row = replace(row, predicted_s=seconds, error=(seconds - row.measured_s) / row.measured_s,
                  pipeline_bytes=predictions[0][1])
    slower = [timeline.slowdown(w) for w in windows]
    if any(s is None for s in slower):
        if row.host_slowdown is None:
            return row
        slower = [row.host_slowdown] * len(windows)
    at_host = statistics.fmean(predict(spec, plan, at_speed(costs, s), cluster)[0]
                               for (costs, cluster), s in zip(means, slower))
    return replace(row, host_slowdown=statistics.fmean(slower), predicted_at_host_speed_s=at_host,
                   error_at_host_speed=(at_host - row.measured_s) / row.measured_s)


def measured_row(model: str, link: str, strategy: str, plan: Plan, predicted: tuple[float, int],
                 runs: list[list[float]]) -> Row:
    """One configuration's row from its prediction (seconds, pipeline bytes) and its runs' step seconds."""
    means = [statistics.fmean(r) for r in runs]
    measured = statistics.fmean(means)
    return Row(model, plan.pp, link, strategy, predicted[0], measured, (predicted[0] - measured) / measured,
               (max(means) - min(means)) / measured, plan.pp > (os.cpu_count() or 1), predicted[1],
               placement_text(plan), CODE, len(runs), tuple(x for r in runs for x in r))


def disputed(ranked: list[int], rows: list[Row], runs: dict[int, list[list[float]]]) -> list[tuple[int, int]]:
    """Pairs of configurations whose mean measured times order them against their predicted times."""
    mean = {i: statistics.fmean(statistics.fmean(r) for r in runs[i]) for i in ranked}
    return [(a, b) for k, a in enumerate(ranked) for b in ranked[k + 1:]
            if (rows[a].predicted_s < rows[b].predicted_s) != (mean[a] < mean[b])]


def needs_runs(runs: dict[int, list[list[float]]], pair: tuple[int, int], rounds: int) -> bool:
    """A pair measured against its prediction gets one more round at least (its steps' interval is
    too narrow while the runs are few: steps of a run are correlated), then more while unsettled."""
    return rounds == 0 or (rounds < RECHECK_ROUNDS and not pair_gap(runs, pair).settled)


def pair_gap(runs: dict[int, list[list[float]]], pair: tuple[int, int]):
    """The pair's measured gap over every step of its runs (``measured_order.measured_gap``)."""
    a, b = ([x for r in runs[i] for x in r] for i in pair)
    return measured_gap(a, b)


def replan(rows: list[Row], steps: int, workdir: Path) -> list[Row]:
    """``rows`` of an earlier run, each planned again on its group's profile (``workdir`` holds it):
    a group holding a row whose placement the current planner changes is predicted and measured again."""
    out = []
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.pp, r.link), []).append(r)
    for (model, pp, link), group in groups.items():
        name = model_name(model, workdir / model)
        spec = load_model(name).with_act_bytes(ACT_BYTES["fp32"])
        bandwidth = None if link == "free" else float(link.split()[0])
        where, costs, cluster = group_measurements(name, pp, workdir / model, bandwidth)
        plans = [(r.config, build_plan(spec, name, costs, cluster, pp, r.config, 2 * pp)) for r in group]
        if all(placement_text(p) == r.placement for r, (_, p) in zip(group, plans)):
            out += group
        else:
            for stale in [run_windows.windows_file(where, pp), *(f for f in where.glob(f"*-pp{pp}-*.*") if f.is_file())]:
                stale.unlink(missing_ok=True)  # the earlier runs' later profiles: these runs get their own
            out += measure_group(model, bandwidth, plans, spec, steps, where, profiler(name, pp, where, bandwidth))
    return out


def repredict(rows: list[Row], workdir: Path, ends_only: bool = False) -> list[Row]:
    """``rows`` of an earlier run predicted again by the current simulator, each from the plan that
    run trained (its ``plan.yaml``) and the profiles its runs sat between (``run_windows.load``; a
    group measured before runs had windows: its profiles before and after, or the one before):
    the measurements stay, so a change to the simulator is held against the same real runs. Each
    row's ``run`` then names both commits. ``ends_only``: every run on the group's first and last
    profiles instead (what the middle profiles change)."""
    out = []
    for r in rows:
        name = model_name(r.model, workdir / r.model)
        spec = load_model(name).with_act_bytes(ACT_BYTES["fp32"])
        bandwidth = None if r.link == "free" else float(r.link.split()[0])
        where = group_dir(workdir / r.model, bandwidth)
        windows = None if ends_only else (run_windows.load(where, r.pp) or {}).get(r.config)
        windows = windows or [Window("", AFTER if profile_files(where, r.pp, AFTER)[0].exists() else "")] * r.repeats
        timeline = Timeline.of_windows(lambda when: loaded_profile(r.pp, where, when, bandwidth), windows)
        plan, _ = load_plan(where / f"{r.model}-pp{r.pp}-{r.config}-run0" / "plan.yaml")
        measured_at = r.run.split()[1].rstrip(",") if r.run.startswith("measured ") else r.run
        run = CODE if measured_at == CODE else f"measured {measured_at}, predicted {CODE}"
        out.append(priced(replace(r, run=run), spec, plan, timeline, windows))
    return out


def kept_rows(path: Path, models: list[str], pps: list[int]) -> list[Row]:
    """The rows of an earlier run that this run does not measure again (another model or P)."""
    return [r for r in rows_of(json.loads(path.read_text())) if not (r.model in models and r.pp in pps)]


def placement_text(plan: Plan) -> str:
    return " ".join(f"{c.start}-{c.end - 1}@{c.device}" for c in plan.placement.chunks)


def rankings(rows: list[Row]) -> list[dict]:
    """Per (model, P, link): the configurations ordered by predicted and by measured time (the
    compute-balanced V apart: objectives() compares it with the link-aware one)."""
    return measured_order.rankings(rows, apart=(BALANCED,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--pp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=4, help="least measured steps per run (each row runs twice)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--workdir", default=None, help="keep plans, logs and profiles here")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="only re-render the tables of an earlier run's validate.json")
    parser.add_argument("--keep", default=None, metavar="FILE",
                        help="an earlier run's validate.json: its rows of the (model, P) pairs this run does not "
                             "measure are kept in the tables (each row says which run measured it)")
    parser.add_argument("--replan", action="store_true",
                        help="with --from-json and the run's --workdir: plan every row again on its profile "
                             "and measure again only the rows whose placement changed")
    parser.add_argument("--repredict", action="store_true",
                        help="with --from-json and the run's --workdir: predict every row again with the current "
                             "simulator, from the plan that was run; the measurements stay")
    parser.add_argument("--ends-only", action="store_true",
                        help="with --repredict: every run on its group's first and last profiles only, not on "
                             "the two right around it (what the profiles between the runs change)")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        rows = rows_of(doc)
        args.steps = doc["steps"]
        if (args.replan or args.repredict) and not args.workdir:
            parser.error("--replan and --repredict need the earlier run's --workdir (its profiles and plans)")
        if args.replan:
            rows = replan(rows, args.steps, Path(args.workdir))
        if args.repredict:
            rows = repredict(rows, Path(args.workdir), args.ends_only)
        write_results(rows, rankings(rows), args)
        print("\n".join(summary(rows, rankings(rows))))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pulse-validate-"))
    rows: list[Row] = kept_rows(Path(args.keep), args.models, args.pp) if args.keep else []
    start = time.time()
    for model in args.models:
        for pp in args.pp:
            rows += validate_model(model, pp, args.steps, workdir / model, args.strategies)
            write_results(rows, rankings(rows), args)  # a long run cut short keeps what it measured
    ranks = rankings(rows)
    write_results(rows, ranks, args)
    worst, at_speed_worst = worst_error(rows) or 0.0, worst_error(rows, True)
    same = sum(g["same"] for g in ranks)
    strict = sum(g["same_order_of_means"] for g in ranks)
    speed = "" if at_speed_worst is None else f" ({at_speed_worst:.1%} at the host's speed)"
    print(f"{len(rows)} rows in {time.time() - start:.0f} s; worst |error| {worst:.1%}{speed}; "
          f"rankings equal in {same}/{len(ranks)} groups ({strict} in the strict order of means); "
          f"wrote {RESULTS / 'validate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
