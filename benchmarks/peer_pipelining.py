"""The peer in the repository: torch.distributed.pipelining's own schedules beside PULSE, same model,
same emulated link, real processes, one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peer_pipelining.py [--pp 2 4] [--steps 6] [--probe]
        [--pulse-schedules auto zero_bubble_v] [--workdir DIR] [--quick] [--rerender JSON]

The model: a random-weight diffusers ``UNet2DConditionModel`` built offline from a config
(``peer_stages.UNET_CONFIG``: validate.py's "diffusers-unet", 3 levels, cross-attention at the
two upper ones; 77 text tokens), fp32, microbatches of 2 samples, M = 2P microbatches a step.

* **PULSE**, as a user runs it: ``pulse profile --diffusers-config DIR --pp P`` once, then
  ``pulse train --diffusers-config DIR --pp P --schedule auto --costs costs.yaml --cluster
  cluster.yaml [--emulate-bandwidth B]`` (the planner sees the link it will get); per-step
  seconds and pipeline bytes from the run's ``log.json``.
* **TP** (torch.distributed.pipelining, ``peer_tp``): the UNet cut by hand into P stages
  (GPipe, 1F1B) or 2P (interleaved 1F1B, interleaved zero bubble, ZBV), cut points balancing
  the units' measured forward times; each stage's forward takes and returns the main
  activation, every skip still pending (relayed across each boundary it spans) and temb; the
  text context and timesteps reach every rank's stages as ``schedule.step`` keyword arguments
  (no link). Same weights recipe, batch shape, microbatches and steps.
* **The link**: PULSE's ``--emulate-bandwidth`` (``ThrottledCommunicator`` and the shared
  inbound-link board); TP's point-to-point ops pass through the same two objects
  (``peer_link``). Bytes: tensor payload handed to send, all ranks, per step, on both sides.
* **Links**: free, and the rate at which moving one microbatch's boundary tensors (the largest
  boundary of TP's P-stage cut, forward) takes 5x a device's compute (the slowest stage's
  forward + backward of one microbatch: 3x its forward, measured in this process before the
  runs).

Per-step time: median of the steps after ``--warmup`` (rank 0's wall clock, each step ending in
an all-reduce on both sides; PULSE's also holds its gradient-norm all-reduce for clipping).
PULSE runs before and after TP's schedules (steps pooled: a host whose speed drifts over minutes
weighs on both sides); ``--pulse-schedules`` adds PULSE runs with other ``--schedule`` values
beside ``auto``, the headline. Speed-up: TP's fastest schedule's median / PULSE auto's; also on
each run's best step (a run on a shared host is only ever slowed). ``--workdir`` keeps the
profiles: a rerun there reuses them.

What torch.distributed.pipelining (torch 2.13) needed to train this model, each a finding of
this benchmark (``--probe`` reruns every schedule without each one and records the error):

1. ``contiguous_grads``: a relayed skip that a stage concatenates gets its gradient from
   ``torch.cat``'s backward as a strided slice; pipelining allocates the previous stage's
   receive buffer with the same strides (``empty_strided``) and gloo refuses it ("input tensor
   has to be contiguous"). Every schedule fails at its first backward without it. Fix: a hook
   on each stage input returns its gradient contiguous (a sent tensor is then contiguous too).
2. ``fresh_outputs`` (zero-bubble schedules only: interleaved zero bubble, ZBV): their
   input-backward ends with ``t.detach_()`` on every stage output, and the weight-backward after
   it still needs what the stage's own units saved; a skip or temb that a stage returns and also
   feeds to its later units then fails ("Trying to use a saved tensor that has been detached
   in-place"), and a returned input or view cannot be detached in place at all. Whether it
   bites depends on the cut: a first stage of time embedding, conv_in and the first resnet
   (``skip_cuts``) fails; the balanced cuts measured here ran without it in the probe. Fix:
   a stage returns clones of every output but a fresh h. Applied to the zero-bubble schedules
   only (GPipe, 1F1B and interleaved 1F1B never detach_ their outputs).
3. Not a failure: pipelining hands each rank's ``schedule.step`` keyword arguments to that
   rank's own stages, which keeps the text context and timesteps off the links.

This host has 2 cores: P = 4 puts two ranks on each (both sides pinned alike, one torch thread
per rank, OMP_NUM_THREADS=1); the load average before and after is recorded. Writes
benchmarks/results/peer_pipelining.json and .md (``--out`` elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer_stages import (CONTEXT_LEN, UNET_CONFIG, WORKAROUNDS, balanced_cuts, boundary_bytes,  # noqa: E402
                         build_model, make_batch, stages_for, unet_units, unit_forward_seconds)
from peer_tp import SCHEDULES, ZERO_BUBBLE, TPRun, run_tp, workarounds_for  # noqa: E402

ROOT = HERE.parent
BIN = Path(sys.executable).parent
RESULTS = HERE / "results"
MICROBATCH = 2
RATIO = 5.0  # slow link: one microbatch's boundary tensors take RATIO x a device's compute
TP_SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")  # gpipe: --schedules


def calibrate(pp: int, repeats: int = 5) -> dict:
    """One process: the units' forward times (least of ``repeats``), TP's cuts (P and 2P stages)
    balancing them, the P-stage cut's boundary bytes per microbatch, and the slow link's rate:
    the largest boundary's bytes over RATIO x the slowest stage's compute per microbatch, taken as
    3x its forward (backward ~2x forward; the least of several forwards is steadier on a shared
    host than one timed backward)."""
    torch.manual_seed(0)
    model = build_model(0)
    units = unet_units(model)
    forward = unit_forward_seconds(model, units, make_batch(MICROBATCH, seed=100), repeats)
    cuts = {n: balanced_cuts(forward, n) for n in (pp, 2 * pp)}
    sizes = boundary_bytes(stages_for(model, units, cuts[pp]), make_batch(MICROBATCH * 2, seed=101), 2)
    stage_forward = [sum(forward[a:b]) for a, b in zip(cuts[pp], cuts[pp][1:])]
    compute = 3 * max(stage_forward)
    return {"units": [f"{u.kind}:{u.path}" for u in units], "unit_forward_ms": [round(f * 1e3, 2) for f in forward],
            "cuts": cuts, "boundary_bytes_per_microbatch": sizes,
            "stage_forward_ms": [round(f * 1e3, 2) for f in stage_forward], "device_compute_ms": compute * 1e3,
            "slow_bandwidth": float(f"{max(sizes) / (RATIO * compute):.2g}")}


def write_model_folder(workdir: Path) -> Path:
    folder = workdir / "unet"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(UNET_CONFIG))
    return folder


def run_logged(command: list[str], log: Path) -> None:
    """Run ``command`` from the repository root, one thread per process, its output appended to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed with exit code {code}; see {log}")


def pulse_profile(folder: Path, pp: int, workdir: Path) -> tuple[Path, Path]:
    """``pulse profile`` on ``pp`` ranks, once per workdir: (costs.yaml, cluster.yaml)."""
    costs, cluster = workdir / f"costs-pp{pp}.yaml", workdir / f"cluster-pp{pp}.yaml"
    if not costs.exists():
        run_logged([str(BIN / "pulse"), "profile", "--diffusers-config", str(folder), "--pp", str(pp),
                    "--microbatch-size", str(MICROBATCH), "--out-costs", str(costs), "--out-cluster", str(cluster)],
                   workdir / "profile.log")
    return costs, cluster


def pulse_run(folder: Path, pp: int, microbatches: int, steps: int, bandwidth: float | None, workdir: Path,
              profile: tuple[Path, Path] | None, schedule: str = "auto", tag: str = "") -> dict:
    """``pulse train --schedule SCHEDULE`` on ``pp`` gloo processes; its log.json's figures."""
    out = workdir / f"pulse-pp{pp}-{link_name(bandwidth)}-{schedule}{tag}"
    command = [str(BIN / "pulse"), "train", "--diffusers-config", str(folder), "--pp", str(pp), "--dp", "1",
               "--microbatch-size", str(MICROBATCH), "--num-microbatches", str(microbatches), "--schedule", schedule,
               "--steps", str(steps), "--out-dir", str(out)]
    if profile is not None:
        command += ["--costs", str(profile[0]), "--cluster", str(profile[1])]
    if bandwidth is not None:
        command += ["--emulate-bandwidth", str(bandwidth)]
    out.mkdir(parents=True, exist_ok=True)
    run_logged(command, out / "train.log")
    log = json.loads((out / "log.json").read_text())
    rows = log["steps"]
    return {"asked": schedule, "schedule": log["run"]["schedule"], "placement": log["run"]["placement"],
            "seconds": [s["seconds"] for s in rows], "bytes_per_step": rows[-1]["pipeline_bytes"],
            "losses": [s["loss"] for s in rows], "predicted_s": log["run"]["predicted"]["step_seconds"],
            "command": " ".join(c if c != str(BIN / "pulse") else "pulse" for c in command)}


def pooled(runs: list[dict], warmup: int) -> dict:
    """One PULSE configuration run before and after TP's (a host whose speed drifts over minutes
    weighs on both sides alike): the median of both runs' steps after their warm-up."""
    timed = [t for run in runs for t in (run["seconds"][warmup:] or run["seconds"])]
    return {**runs[0], "median_s": statistics.median(timed), "runs": runs,
            "run_medians_s": [statistics.median(r["seconds"][warmup:] or r["seconds"]) for r in runs]}


def link_name(bandwidth: float | None) -> str:
    return "free" if bandwidth is None else f"{bandwidth:.2g}Bps"


def tp_config(pp: int, microbatches: int, steps: int, warmup: int, cuts: dict, schedules: tuple[str, ...],
              bandwidth: float | None, workdir: Path, workarounds: tuple[str, ...] = WORKAROUNDS) -> TPRun:
    return TPRun(pp=pp, microbatches=microbatches, microbatch_size=MICROBATCH, steps=steps, warmup=warmup,
                 cuts={int(k): v for k, v in cuts.items()}, schedules=schedules, bandwidth=bandwidth,
                 workarounds=workarounds, out=str(workdir / f"tp-pp{pp}-{link_name(bandwidth)}.json"))


def group(pp: int, bandwidth: float | None, pulses: list[dict], tp: list[dict]) -> dict:
    """One (P, link) row: PULSE (``pulses[0]``: ``--schedule auto``, the user's path; the rest: other
    schedules asked for), every TP schedule, PULSE's speed-up over TP's fastest."""
    ran = [t for t in tp if t["error"] is None and t["median_s"]]
    fastest = min(ran, key=lambda t: t["median_s"]) if ran else None
    pulse = pulses[0] if pulses else None
    speedup = fastest["median_s"] / pulse["median_s"] if pulse and fastest else None
    return {"pp": pp, "link": link_name(bandwidth), "bandwidth": bandwidth, "pulse": pulse,
            "pulse_other": [dict(p, speedup=fastest["median_s"] / p["median_s"] if fastest else None)
                            for p in pulses[1:]],
            "tp": tp, "tp_fastest": fastest["schedule"] if fastest else None, "speedup": speedup}


def measure_group(args: argparse.Namespace, folder: Path, pp: int, cuts: dict, bandwidth: float | None,
                  profile: tuple[Path, Path] | None) -> dict:
    """PULSE (each of ``--pulse-schedules``), TP's schedules, PULSE again in mirrored order."""
    m, schedules = 2 * pp, [] if args.tp_only else list(args.pulse_schedules)
    before = {s: pulse_run(folder, pp, m, args.steps, bandwidth, args.workdir, profile, s) for s in schedules}
    tp = run_tp(tp_config(pp, m, args.steps, args.warmup, cuts, tuple(args.schedules), bandwidth, args.workdir))
    after = {s: pulse_run(folder, pp, m, args.steps, bandwidth, args.workdir, profile, s, "-after")
             for s in (reversed(schedules) if args.bracket else ())}
    return group(pp, bandwidth, [pooled([before[s], *([after[s]] if s in after else [])], args.warmup)
                                 for s in schedules], tp)


def probe(pp: int, cuts: dict, workdir: Path) -> list[dict]:
    """TP's schedules for one step with each workaround left out where they use it: what fails
    without it (one launch each: a failure ends its process group). ``fresh_outputs`` is probed
    on the measured cuts and on ``skip_cuts`` (whether detach_ breaks depends on the cut)."""
    rows = []
    for missing in WORKAROUNDS:
        kept = tuple(w for w in WORKAROUNDS if w != missing)
        for name in TP_SCHEDULES:
            if missing not in workarounds_for(name, WORKAROUNDS):
                continue
            tries = [("balanced", cuts)] + ([("skip", skip_cuts(pp))] if missing == "fresh_outputs" else [])
            for label, tried in tries:
                cfg = tp_config(pp, 2 * pp, 1, 0, tried, (name,), None, workdir / "probe", kept)
                cfg = TPRun(**{**cfg.__dict__, "timeout_s": 120.0})
                (workdir / "probe").mkdir(parents=True, exist_ok=True)
                result = run_tp(cfg)[0]
                rows.append({"pp": pp, "without": missing, "schedule": name, "cuts": label,
                             "stage_cuts": tried[2 * pp if name in ZERO_BUBBLE else pp], "error": result["error"]})
                print(f"  P={pp} without {missing} {name} ({label} cuts): {result['error'] or 'runs'}"[:200],
                      flush=True)
    return rows


def skip_cuts(pp: int) -> dict[int, list[int]]:
    """2P stages whose first holds time, conv_in and the first resnet: it returns conv_in's output
    (a skip) that its own resnet also read and saved; the rest split evenly by unit count."""
    n = len(unet_units(build_model(0)))
    rest = [3 + round(i * (n - 3) / (2 * pp - 1)) for i in range(2 * pp)]
    return {2 * pp: [0, *rest]}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def markdown(report: dict) -> str:
    """The report as tables: PULSE against TP's fastest per (P, link), every run, the probe."""
    lines = [f"# torch.distributed.pipelining beside PULSE (measured, {report['host']['cores']} cores)", "",
             f"Model: diffusers UNet2DConditionModel {UNET_CONFIG['block_out_channels']}, fp32, "
             f"microbatch {MICROBATCH}, M = 2P; median step after {report['warmup']} warm-up steps of "
             f"{report['steps']}; load average {report['host']['load_before']} before, "
             f"{report['host']['load_after']} after. Command: `{report['command']}`", "",
             "| P | link (B/s) | PULSE (`--schedule auto`) s/step | MB/step | TP fastest | s/step | MB/step "
             "| PULSE speed-up | on best steps |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in report["groups"]:
        p, fast = g["pulse"], next((t for t in g["tp"] if t["schedule"] == g["tp_fastest"]), None)
        pulse = (f"{p['median_s']:.3f} ({p['schedule']}; runs {', '.join(f'{x:.3f}' for x in p['run_medians_s'])}) | "
                 f"{p['bytes_per_step'] / 1e6:.2f}") if p else "- | -"
        tp = (f"{fast['schedule']} | {fast['median_s']:.3f} | {fast['bytes_per_step'] / 1e6:.2f}" if fast
              else "- | - | -")
        ratio = f"{g['speedup']:.2f}x" if g["speedup"] else "-"
        best = f"{g['speedup_best']:.2f}x" if g.get("speedup_best") else "-"
        lines.append(f"| {g['pp']} | {_rate(g['bandwidth'])} | {pulse} | {tp} | {ratio} | {best} |")
    lines += ["", "Every run (TP's step time over PULSE auto's: how much faster PULSE is):", "",
              "| P | link (B/s) | run | s/step (median) | best step | MB/step | TP / PULSE |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for g in report["groups"]:
        lines += [_run_row(g, r) for r in _runs(g)]
    if report.get("probe"):
        source = f" (from the --probe run at commit {report['probe_commit']})" if report.get("probe_commit") else ""
        lines += ["", f"TP without each workaround (one step, free link){source}:", "",
                  "| P | left out | schedule | result |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['pp']} | {r['without']} | {r['schedule']} ({r['cuts']} cuts {r['stage_cuts']}) | "
                  f"{r['error'] or 'runs'} |" for r in report["probe"]]
    return "\n".join(lines) + "\n"


def _rate(bandwidth: float | None) -> str:
    return "free" if bandwidth is None else f"{bandwidth:.2g}"


def _runs(g: dict) -> list[tuple[str, dict]]:
    pulses = ([g["pulse"]] if g["pulse"] else []) + g.get("pulse_other", [])
    return ([(f"PULSE --schedule {p['asked']} ({p['schedule']})", p) for p in pulses]
            + [(f"TP {t['schedule']}", t) for t in g["tp"]])


def _run_row(g: dict, named: tuple[str, dict]) -> str:
    name, r = named
    head = f"| {g['pp']} | {_rate(g['bandwidth'])} | {name} | "
    if r.get("error"):
        return head + f"fails: {r['error'][:80]} | - | - | - |"
    ratio = f"{r['median_s'] / g['pulse']['median_s']:.2f}x" if g["pulse"] and name.startswith("TP") else ""
    best = f"{r['best_s']:.3f}" if r.get("best_s") else "-"
    return head + f"{r['median_s']:.3f} | {best} | {r['bytes_per_step'] / 1e6:.2f} | {ratio} |"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(TP_SCHEDULES))
    parser.add_argument("--links", nargs="+", choices=("free", "slow"), default=["free", "slow"])
    parser.add_argument("--pulse-schedules", nargs="+", default=["auto"], metavar="SCHEDULE",
                        help="PULSE's --schedule for each PULSE run; the first (auto: the user's path) is the "
                             "headline, the others are reported beside it")
    parser.add_argument("--no-bracket", dest="bracket", action="store_false",
                        help="run PULSE once, before TP (default: before and after, steps pooled)")
    parser.add_argument("--probe", action="store_true", help="also run TP without each workaround, one step")
    parser.add_argument("--tp-only", action="store_true", help="skip PULSE (smoke tests)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: P = 2, free link, 2 steps, TP 1F1B, PULSE on analytic costs")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/peer_pipelining"))
    parser.add_argument("--out", type=Path, default=RESULTS / "peer_pipelining.json")
    parser.add_argument("--rerender", type=Path, metavar="JSON", help="rewrite --out's JSON and tables from "
                                                                       "this report, running nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.pp, args.steps, args.warmup, args.schedules, args.links = [2], 2, 1, ["1f1b"], ["free"]
        args.bracket = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rerender:  # the tables again from a run's JSON (derived figures recomputed), nothing run
        write(best_steps(json.loads(args.rerender.read_text())), args.out)
        return 0
    torch.set_num_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = write_model_folder(args.workdir)
    report = {"benchmark": "peer_pipelining", "command": "OMP_NUM_THREADS=1 .venv/bin/python "
              f"benchmarks/peer_pipelining.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
              "commit": _commit(), "torch": torch.__version__, "model": UNET_CONFIG, "context_len": CONTEXT_LEN,
              "microbatch_size": MICROBATCH, "steps": args.steps, "warmup": args.warmup, "ratio": RATIO,
              "workarounds": list(WORKAROUNDS), "host": {"cores": os.cpu_count(), "load_before": load()},
              "calibration": {}, "groups": []}
    for pp in args.pp:
        cal = calibrate(pp, 1 if args.quick else 5)
        report["calibration"][str(pp)] = cal
        print(f"P={pp}: TP cuts {cal['cuts']}, boundary bytes/microbatch {cal['boundary_bytes_per_microbatch']}, "
              f"slow link {cal['slow_bandwidth']:.3g} B/s", flush=True)
        profile = None if args.quick or args.tp_only else pulse_profile(folder, pp, args.workdir)
        for link in args.links:
            bandwidth = cal["slow_bandwidth"] if link == "slow" else None
            row = measure_group(args, folder, pp, cal["cuts"], bandwidth, profile)
            report["groups"].append(row)
            print(summary_line(row), flush=True)
    if args.probe:
        report["probe"] = [row for pp in args.pp for row in probe(pp, report["calibration"][str(pp)]["cuts"],
                                                                    args.workdir)]
    report["host"]["load_after"] = load()
    write(best_steps(report), args.out)
    return 0


def best_steps(report: dict) -> dict:
    """Each run's fastest step after warm-up, and PULSE's speed-up on them. On a shared host a run is
    only ever slowed, so the best steps are the least disturbed view; the medians stay the headline."""
    warmup = report["warmup"]
    for g in report["groups"]:
        for r in ([g["pulse"]] if g["pulse"] else []) + g.get("pulse_other", []) + g["tp"]:
            steps = [t for run in r.get("runs", [r]) for t in (run["seconds"][warmup:] or run["seconds"])]
            r["best_s"] = min(steps) if steps and not r.get("error") else None
        fastest = [t["best_s"] for t in g["tp"] if t.get("best_s")]
        g["speedup_best"] = min(fastest) / g["pulse"]["best_s"] if fastest and g["pulse"] else None
    return report


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def summary_line(row: dict) -> str:
    """One (P, link) group in a line, printed as the run goes."""
    p = row["pulse"]
    tps = ", ".join(f"{t['schedule']} {t['median_s']:.3f}s" if t["error"] is None else f"{t['schedule']} fails"
                    for t in row["tp"])
    head = f"P={row['pp']} {row['link']}: "
    head += f"PULSE {p['schedule']} {p['median_s']:.3f}s {p['bytes_per_step'] / 1e6:.2f}MB | " if p else ""
    return head + f"TP {tps}" + (f" | speed-up {row['speedup']:.2f}x" if row["speedup"] else "")


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
