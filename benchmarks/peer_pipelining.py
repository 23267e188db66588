"""The peer in the repository: torch.distributed.pipelining's own schedules beside PULSE, same model,
same emulated link, real processes, one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peer_pipelining.py [--model small|sd2] [--pp 2 4]
        [--steps 6] [--probe] [--pulse-schedules auto zero_bubble_v] [--workdir DIR] [--quick] [--rerender JSON]
        [--price-only JSON [--price-profile DIR]]

The model (``--model``, ``peer_models``): a random-weight diffusers ``UNet2DConditionModel`` built
offline from a config, fp32, 77 text tokens. ``small`` (the default): ``peer_stages.UNET_CONFIG``
(validate.py's "diffusers-unet", 3 levels, cross-attention at the two upper ones), microbatches of
2 samples, M = 2P microbatches a step. ``sd2``: the real SD v2 UNet (``sd2_unet_config.json``,
865,910,724 parameters) at 256 px, microbatch 1, M = 2, P = 2, 4 steps (2 warm-up), the slow
link at 5 MB/s; each TP rank materializes only its stages; PULSE reuses the committed profile
``results/sd2_profile`` where it prices the model; results to ``peer_pipelining_sd2.{json,md}``.

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
  runs); sd2: 5 MB/s.
* **Predicted**: each PULSE run's step as its plan predicts it (log.json), beside the measured one;
  each TP run's step as PULSE's simulator prices TP's own placement, cut and schedule on the same
  costs, cluster and link (``peer_pricing``: ``pulse train --plan``'s pricing, optimizer step
  included), with its simulated bytes beside the wire's, and for the two-stage-per-rank schedules
  also on torch's own action order (``peer_tp_order``; PULSE has no interleaved zero-bubble
  generator: its zero_bubble_v stands in). ``--price-only JSON`` prices an existing
  report's TP rows again, running nothing (costs: ``--price-profile DIR`` holding
  ``costs-ppP.yaml``/``cluster-ppP.yaml``, else the committed profile, else the PULSE run's
  ``--costs`` files if still there, else PULSE's analytic costs, said in the report).

Per-step time: median of the steps after ``--warmup`` (rank 0's wall clock, each step ending in
an all-reduce on both sides; PULSE's also holds its gradient-norm all-reduce for clipping).
PULSE runs before and after TP's schedules (steps pooled: a host whose speed drifts over minutes
weighs on both sides); ``--pulse-schedules`` adds PULSE runs with other ``--schedule`` values
beside ``auto``, the headline. Speed-up: TP's fastest schedule's median / PULSE auto's; also on
each run's best step (a run on a shared host is only ever slowed). ``--workdir`` keeps the
profiles: a rerun there reuses them. ``--quick``: a smoke run of the model's code path (P = 2,
free link, TP 1F1B, PULSE on analytic costs unless a committed profile prices it; sd2 at 64 px,
1 step: about 3 minutes), its report in the workdir unless ``--out`` says otherwise.

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
benchmarks/results/peer_pipelining.json and .md (sd2: peer_pipelining_sd2; ``--out`` elsewhere).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer_models import MODELS, PeerModel, committed_profile, peer_model  # noqa: E402
from peer_pricing import TP_SCHEDULES, price_tp, stage_devices  # noqa: E402
from peer_report import markdown, summary_line  # noqa: E402
from peer_tp_order import ORDERED, tp_schedule  # noqa: E402
from peer_stages import (CONTEXT_LEN, WORKAROUNDS, balanced_cuts, boundary_bytes, stages_for,  # noqa: E402
                         unet_units, unit_forward_seconds)
from peer_tp import SCHEDULES, ZERO_BUBBLE, TPRun, run_tp, workarounds_for  # noqa: E402

ROOT = HERE.parent
BIN = Path(sys.executable).parent
RESULTS = HERE / "results"
RATIO = 5.0  # slow link: one microbatch's boundary tensors take RATIO x a device's compute
QUICK_SD2_RESOLUTION = 64  # --quick --model sd2: 8x8 latents, the real model's every layer


def calibrate(model: PeerModel, pp: int, repeats: int = 5) -> dict:
    """One process: the units' forward times (least of ``repeats``), TP's cuts (P and 2P stages)
    balancing them, the P-stage cut's boundary bytes per microbatch, and the slow link's rate (the
    model's, or RATIO's rule): the largest boundary's bytes over RATIO x the slowest stage's compute
    per microbatch, taken as 3x its forward (backward ~2x forward; the least of several forwards is
    steadier on a shared host than one timed backward)."""
    whole = model.whole(0)
    units = unet_units(whole)
    mb = model.microbatch_size
    forward = unit_forward_seconds(whole, units, model.batch(mb, seed=100), repeats)
    cuts = {n: balanced_cuts(forward, n) for n in (pp, 2 * pp)}
    sizes = boundary_bytes(stages_for(whole, units, cuts[pp]), model.batch(mb * 2, seed=101), 2)
    stage_forward = [sum(forward[a:b]) for a, b in zip(cuts[pp], cuts[pp][1:])]
    compute = 3 * max(stage_forward)
    parameters = sum(p.numel() for p in whole.parameters())
    del whole
    _release_memory()
    return {"units": [f"{u.kind}:{u.path}" for u in units], "unit_forward_ms": [round(f * 1e3, 2) for f in forward],
            "cuts": cuts, "boundary_bytes_per_microbatch": sizes, "parameters": parameters,
            "stage_forward_ms": [round(f * 1e3, 2) for f in stage_forward], "device_compute_ms": compute * 1e3,
            "ratio_rule_bandwidth": float(f"{max(sizes) / (RATIO * compute):.2g}"),
            "slow_bandwidth": model.slow_bandwidth or float(f"{max(sizes) / (RATIO * compute):.2g}")}


def _release_memory() -> None:
    """Hand the calibration model's memory back to the host before the ranks start: at real size it
    is 3.5 GB, and glibc keeps freed small blocks in its heap unless asked to trim it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def run_logged(command: list[str], log: Path) -> None:
    """Run ``command`` from the repository root, one thread per process, its output appended to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed with exit code {code}; see {log}")


def pulse_profile(model: PeerModel, pp: int, workdir: Path, run: bool = True) -> tuple[tuple[Path, Path] | None, str]:
    """PULSE's measured costs on ``pp`` ranks: the model's committed profile where it prices the model,
    else ``pulse profile`` once per workdir (``run`` False: none, PULSE plans on analytic costs).
    Second: where they came from, in a line."""
    reused, why = committed_profile(model, pp)
    if reused is not None or not run:
        return reused, why if reused is not None else f"analytic costs ({why})"
    costs, cluster = workdir / f"costs-pp{pp}.yaml", workdir / f"cluster-pp{pp}.yaml"
    if not costs.exists():
        run_logged([str(BIN / "pulse"), "profile", *model.pulse_model_args(workdir), "--pp", str(pp),
                    "--microbatch-size", str(model.microbatch_size), *model.profile_args, "--out-costs", str(costs),
                    "--out-cluster", str(cluster)], workdir / "profile.log")
    return (costs, cluster), f"pulse profile into {workdir} ({why})"


def pulse_run(model: PeerModel, pp: int, steps: int, bandwidth: float | None, workdir: Path,
              profile: tuple[Path, Path] | None, schedule: str = "auto", tag: str = "") -> dict:
    """``pulse train --schedule SCHEDULE`` on ``pp`` gloo processes; its log.json's figures."""
    out = workdir / f"pulse-pp{pp}-{link_name(bandwidth)}-{schedule}{tag}"
    command = [str(BIN / "pulse"), "train", *model.pulse_model_args(workdir), "--pp", str(pp), "--dp", "1",
               "--microbatch-size", str(model.microbatch_size), "--num-microbatches", str(model.microbatches_for(pp)),
               "--schedule", schedule, "--steps", str(steps), "--out-dir", str(out)]
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


def tp_config(model: PeerModel, pp: int, steps: int, warmup: int, cuts: dict, schedules: tuple[str, ...],
              bandwidth: float | None, workdir: Path, workarounds: tuple[str, ...] = WORKAROUNDS) -> TPRun:
    return TPRun(pp=pp, microbatches=model.microbatches_for(pp), microbatch_size=model.microbatch_size, steps=steps,
                 warmup=warmup, cuts={int(k): v for k, v in cuts.items()}, schedules=schedules, bandwidth=bandwidth,
                 workarounds=workarounds, out=str(workdir / f"tp-pp{pp}-{link_name(bandwidth)}.json"),
                 model=model.name, resolution=model.resolution)


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


def measure_group(args: argparse.Namespace, model: PeerModel, pp: int, cuts: dict, bandwidth: float | None,
                  profile: tuple[Path, Path] | None) -> dict:
    """PULSE (each of ``--pulse-schedules``), TP's schedules, PULSE again in mirrored order."""
    schedules = [] if args.tp_only else list(args.pulse_schedules)
    before = {s: pulse_run(model, pp, args.steps, bandwidth, args.workdir, profile, s) for s in schedules}
    tp = run_tp(tp_config(model, pp, args.steps, args.warmup, cuts, tuple(args.schedules), bandwidth, args.workdir))
    after = {s: pulse_run(model, pp, args.steps, bandwidth, args.workdir, profile, s, "-after")
             for s in (reversed(schedules) if args.bracket else ())}
    return group(pp, bandwidth, [pooled([before[s], *([after[s]] if s in after else [])], args.warmup)
                                 for s in schedules], tp)


def probe(model: PeerModel, pp: int, cuts: dict, workdir: Path) -> list[dict]:
    """TP's schedules for one step with each workaround left out where they use it: what fails
    without it (one launch each: a failure ends its process group). ``fresh_outputs`` is probed
    on the measured cuts and on ``skip_cuts`` (whether detach_ breaks depends on the cut)."""
    rows = []
    for missing in WORKAROUNDS:
        kept = tuple(w for w in WORKAROUNDS if w != missing)
        for name in model.tp_schedules:
            if missing not in workarounds_for(name, WORKAROUNDS):
                continue
            tries = [("balanced", cuts)] + ([("skip", skip_cuts(model, pp))] if missing == "fresh_outputs" else [])
            for label, tried in tries:
                cfg = tp_config(model, pp, 1, 0, tried, (name,), None, workdir / "probe", kept)
                cfg = TPRun(**{**cfg.__dict__, "timeout_s": 120.0})
                (workdir / "probe").mkdir(parents=True, exist_ok=True)
                result = run_tp(cfg)[0]
                rows.append({"pp": pp, "without": missing, "schedule": name, "cuts": label,
                             "stage_cuts": tried[2 * pp if name in ZERO_BUBBLE else pp], "error": result["error"]})
                print(f"  P={pp} without {missing} {name} ({label} cuts): {result['error'] or 'runs'}"[:200],
                      flush=True)
    return rows


def skip_cuts(model: PeerModel, pp: int) -> dict[int, list[int]]:
    """2P stages whose first holds time, conv_in and the first resnet: it returns conv_in's output
    (a skip) that its own resnet also read and saved; the rest split evenly by unit count."""
    from peer_stages import build_meta_model

    n = len(unet_units(build_meta_model(model.config)))
    rest = [3 + round(i * (n - 3) / (2 * pp - 1)) for i in range(2 * pp)]
    return {2 * pp: [0, *rest]}


def tp_stage_cuts(cal: dict, schedule: str, pp: int) -> list[int]:
    """The cut TP ran ``schedule`` with: the calibration's cut of as many stages as it places."""
    stages = len(stage_devices(schedule, pp)[1])
    cuts = cal["cuts"]  # keyed by stage count: ints in a live run, strings once read back from JSON
    return cuts[stages] if stages in cuts else cuts[str(stages)]


def pricing_profile(model: PeerModel, pp: int, pulse: dict | None,
                    profile_dir: Path | None = None) -> tuple[tuple[Path, Path] | None, str]:
    """The costs and cluster to price ``pp``'s TP rows with: ``profile_dir``'s costs-ppP.yaml and
    cluster-ppP.yaml (a workdir ``pulse_profile`` filled) if given, else the model's committed profile
    where it prices the model, else the ``--costs``/``--cluster`` files PULSE's run named (``pulse``: its
    row) if they still exist, else None (PULSE's analytic costs). Second: which, in a line."""
    if profile_dir is not None:
        costs, cluster = profile_dir / f"costs-pp{pp}.yaml", profile_dir / f"cluster-pp{pp}.yaml"
        if not (costs.exists() and cluster.exists()):
            raise FileNotFoundError(f"--price-profile: no {costs.name} and {cluster.name} in {profile_dir}")
        return (costs, cluster), f"profile {costs} (--price-profile)"
    reused, why = committed_profile(model, pp)
    if reused is not None:
        return reused, f"committed profile {reused[0].parent}"
    words = (pulse or {}).get("command", "").split()
    named = [Path(words[words.index(flag) + 1]) for flag in ("--costs", "--cluster") if flag in words]
    if len(named) == 2 and all(path.exists() for path in named):
        return (named[0], named[1]), f"PULSE's run's profile {named[0]}"
    gone = f" (PULSE's run's {named[0]} is gone)" if named else ""
    return None, f"PULSE's analytic costs on its default cluster{gone}: {why}"


def price_group(g: dict, model: PeerModel, cal: dict, profile: tuple[Path, Path] | None, workdir: Path) -> None:
    """Each TP row of group ``g`` priced by PULSE's simulator (``peer_pricing.price_tp``), in place:
    ``predicted_s`` (the step), ``predicted_pipeline_s`` (the schedule's makespan alone),
    ``predicted_bytes_per_step`` (the simulated pipeline traffic), or ``predicted_error``."""
    args = model.pulse_model_args(workdir)
    for t in g["tp"]:
        for key in ("predicted_s", "predicted_pipeline_s", "predicted_bytes_per_step", "predicted_error",
                    "predicted_generator", "predicted_tp_order_s"):
            t.pop(key, None)
        if t["schedule"] not in TP_SCHEDULES:
            t["predicted_error"] = f"no PULSE pricing for TP schedule {t['schedule']}"
            continue

        def priced(order=None):
            return price_tp(args, g["pp"], model.microbatch_size, model.microbatches_for(g["pp"]),
                            tp_stage_cuts(cal, t["schedule"], g["pp"]), t["schedule"], g["bandwidth"], profile,
                            cal.get("units"), order)
        try:
            generated = priced()
        except Exception as exc:  # a measured row stays; why it is unpriced is said beside it
            t["predicted_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        t.update(predicted_s=generated.step_seconds, predicted_pipeline_s=generated.predicted["pipeline_seconds"],
                 predicted_bytes_per_step=generated.pipeline_bytes, predicted_generator=generated.generator)
        if t["schedule"] in ORDERED:  # torch's own action order on the same placement, priced alike
            try:
                order = tp_schedule(t["schedule"], g["pp"], model.microbatches_for(g["pp"]))
                t["predicted_tp_order_s"] = priced(order).step_seconds
            except Exception as exc:  # torch's private order methods changed: said, not fatal
                t["predicted_error"] = f"torch's order: {type(exc).__name__}: {exc}".splitlines()[0]


def report_model(report: dict) -> PeerModel:
    """The model a report trained (its own config and resolution: a report from before ``--model`` is
    the small UNet at its config's size)."""
    from dataclasses import replace

    model = peer_model(report.get("model_name", "small"), report.get("resolution"))
    return replace(model, config=report["model"]) if report.get("model") else model


def price_report(report: dict, workdir: Path, profile_dir: Path | None = None) -> dict:
    """Every TP row of ``report`` priced again (``price_group``), running nothing; each P's costs
    (``pricing_profile``) recorded in its calibration as ``tp_pricing``."""
    model = report_model(report)
    workdir.mkdir(parents=True, exist_ok=True)
    for pp, cal in report["calibration"].items():
        groups = [g for g in report["groups"] if g["pp"] == int(pp)]
        profile, cal["tp_pricing"] = pricing_profile(model, int(pp), next((g["pulse"] for g in groups), None),
                                                     profile_dir)
        for g in groups:
            price_group(g, model, cal, profile, workdir)
    return report


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="small",
                        help="small: the 3-level UNet (default); sd2: the real SD v2 UNet at 256 px (peer_models)")
    parser.add_argument("--resolution", type=int, default=None, metavar="PX",
                        help="image side in pixels, latents PX/8 (default: the model's: 256 for both)")
    parser.add_argument("--pp", type=int, nargs="+", default=None, help="default: 2 4 (sd2: 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, warm-up included (default 6; sd2: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (sd2: 1)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=None,
                        help="TP's schedules (default: 1f1b interleaved_1f1b interleaved_zb zbv; "
                             "sd2: 1f1b interleaved_1f1b zbv)")
    parser.add_argument("--links", nargs="+", choices=("free", "slow"), default=["free", "slow"])
    parser.add_argument("--pulse-schedules", nargs="+", default=["auto"], metavar="SCHEDULE",
                        help="PULSE's --schedule for each PULSE run; the first (auto: the user's path) is the "
                             "headline, the others are reported beside it")
    parser.add_argument("--no-bracket", dest="bracket", action="store_false",
                        help="run PULSE once, before TP (default: before and after, steps pooled)")
    parser.add_argument("--probe", action="store_true", help="also run TP without each workaround, one step")
    parser.add_argument("--tp-only", action="store_true", help="skip PULSE (smoke tests)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: P = 2, free link, no bracket, PULSE on analytic costs unless a committed "
                             "profile prices the model; TP 1F1B; small: 2 steps; sd2: 64 px, 1 step; the report "
                             "goes to the workdir unless --out is given")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="default /tmp/peer_pipelining (sd2: /tmp/peer_pipelining_sd2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/peer_pipelining.json (sd2: peer_pipelining_sd2.json)")
    parser.add_argument("--rerender", type=Path, metavar="JSON", help="rewrite --out's JSON and tables from "
                                                                       "this report, running nothing")
    parser.add_argument("--price-only", type=Path, metavar="JSON",
                        help="price this report's TP rows with PULSE's simulator (peer_pricing), running nothing; "
                             "writes the predictions into that JSON's rows and its tables (--out elsewhere)")
    parser.add_argument("--price-profile", type=Path, metavar="DIR", default=None,
                        help="with --price-only: costs-ppP.yaml and cluster-ppP.yaml to price with (default: the "
                             "committed profile, else PULSE's run's --costs files if still there, else analytic)")
    return with_defaults(parser.parse_args(argv))


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The options left unset, from the model (``peer_models``) and from ``--quick``."""
    resolution = args.resolution or (QUICK_SD2_RESOLUTION if args.quick and args.model == "sd2" else None)
    model = args.peer_model = peer_model(args.model, resolution)
    if args.quick:
        quick = {"pp": [2], "steps": 2 if model.name == "small" else 1, "warmup": 1 if model.name == "small" else 0,
                 "schedules": ["1f1b"]}
        for key, value in quick.items():
            setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
        args.links, args.bracket = ["free"], False
    defaults = {"pp": list(model.pp), "steps": model.steps, "warmup": model.warmup,
                "schedules": list(model.tp_schedules), "workdir": Path(f"/tmp/{model.results_stem}")}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out_given = args.out is not None
    if args.out is None:
        args.out = (args.workdir / f"{model.results_stem}_quick.json" if args.quick
                    else RESULTS / f"{model.results_stem}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rerender:  # the tables again from a run's JSON (derived figures recomputed), nothing run
        report = json.loads(args.rerender.read_text())
        stem = peer_model(report.get("model_name", "small")).results_stem
        write(best_steps(report), args.out if args.out_given else RESULTS / f"{stem}.json")
        return 0
    if args.price_only:  # TP's rows priced again from a run's JSON, nothing run
        report = price_report(json.loads(args.price_only.read_text()), args.workdir, args.price_profile)
        write(best_steps(report), args.out if args.out_given else args.price_only)
        return 0
    torch.set_num_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model: PeerModel = args.peer_model
    report = {"benchmark": "peer_pipelining", "command": "OMP_NUM_THREADS=1 .venv/bin/python "
              f"benchmarks/peer_pipelining.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
              "commit": _commit(), "torch": torch.__version__, "model_name": model.name, "model": model.config,
              "resolution": model.resolution, "context_len": CONTEXT_LEN, "microbatch_size": model.microbatch_size,
              "microbatches": model.microbatches, "steps": args.steps, "warmup": args.warmup, "ratio": RATIO,
              "workarounds": list(WORKAROUNDS), "tp_ranks_hold": _ranks_hold(model),
              "host": {"cores": os.cpu_count(), "load_before": load()}, "calibration": {}, "groups": []}
    for pp in args.pp:
        cal = calibrate(model, pp, 1 if args.quick else model.calibration_repeats)
        report["calibration"][str(pp)] = cal
        print(f"P={pp}: TP cuts {cal['cuts']}, boundary bytes/microbatch {cal['boundary_bytes_per_microbatch']}, "
              f"slow link {cal['slow_bandwidth']:.3g} B/s", flush=True)
        profile, cal["pulse_costs"] = ((None, "none (--tp-only)") if args.tp_only
                                       else pulse_profile(model, pp, args.workdir, run=not args.quick))
        print(f"P={pp}: PULSE's costs: {cal['pulse_costs']}", flush=True)
        for link in args.links:
            bandwidth = cal["slow_bandwidth"] if link == "slow" else None
            row = measure_group(args, model, pp, cal["cuts"], bandwidth, profile)
            cal["tp_pricing"] = (f"PULSE's run's profile {profile[0]}" if profile is not None
                                 else "PULSE's analytic costs on its default cluster, as PULSE's run")
            price_group(row, model, cal, profile, args.workdir)
            report["groups"].append(row)
            print(summary_line(row), flush=True)
    if args.probe:
        report["probe"] = [row for pp in args.pp for row in probe(model, pp, report["calibration"][str(pp)]["cuts"],
                                                                    args.workdir)]
    report["host"]["load_after"] = load()
    write(best_steps(report), args.out)
    return 0


def _ranks_hold(model: PeerModel) -> str:
    if model.meta_init:
        return "each builds the model on the meta device and materializes only its own stages"
    return "each builds the whole model (seed 0) and keeps its own stages"


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


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
