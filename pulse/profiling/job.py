"""The per-rank job of ``pulse profile``, written once for every backend.

::

    every rank ── layers: pulse.profiling.layers (the runtime's own path), at most ``cores``
                  ranks at once, so the contention of a shared host is in the figures
               ── ranks sharing a core (more ranks than cores, pinned): rank 0's forward and
                  backward alone, then with the rank pinned beside it: the share they keep
               ── cold start: in pairs, every layer's actions right after a real message
                  exchange and back to back (pulse.profiling.cold_start)
               ── links: every ordered pair in turn; all-reduce: per size over the pipeline,
                  data-parallel and world groups (pulse.profiling.links)
    rank 0     ── median over ranks per layer -> costs.yaml; links + curves -> cluster.yaml

A backend's entry (``pulse_torch.profile_job`` under torchrun,
``pulse_mindspore.profile_job`` under msrun) joins its job and lends a
``ProfileRig``: the communicator, fresh backends, its loss, its launcher's core
pinning. The simulator models oversubscription itself (``pulse.sim.program``),
with the ranks pinned as they were here (``pinned_cores``).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from pulse.args.model_args import parse_options
from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster, save_measured_cluster
from pulse.profiling.cold_start import EachRun, RunGaps, measure_in_pairs
from pulse.profiling.gather import Ranks
from pulse.profiling.layers import CountSaved, EncoderSeconds, in_flight, measure_layers_in_turns, windowed
from pulse.profiling.windows import RealLayers, Window, WindowedModel, nothing_to_make
from pulse.profiling.links import allreduce_curve, groups, probe_pair
from pulse.profiling.timing import DEVICE_TIMINGS
from pulse.runtime.errors import CommTimeout
from pulse.train.loop import freeze_setup_objects
from pulse.runtime.protocols import Backend, LossFn
from pulse.sim.memory import PRECISION_BYTES
from pulse.train.run_config import PRECISIONS
from pulse.spec import ModelSpec
from pulse.zoo.loading import load_model

SHARING_SECONDS = 0.5  # each core-sharing figure spans about this long


@dataclass
class ProfileRig:
    """What a backend lends the profile: its ranks, fresh backends, its loss, how its ranks sit on cores."""

    ranks: Ranks
    backend_of: Callable[[], Backend]  # a fresh backend per measurement (no state carried between them)
    loss: LossFn
    framework: str  # the cost table's source: "torch-cpu", "mindspore-cpu", ...
    cores: int | None  # the host's cores the ranks share (None: a device each)
    pinned: bool  # ranks pinned as pulse.cores pins them (False: they share all cores as one pool)
    encoder_seconds: EncoderSeconds | None = None  # a pipeline's frozen encoders (None: not measured)
    backward_reruns_forward: bool = False  # its backward recomputes the forward (MindSpore): figures stored without
    # Time the per-action fit's chunks in steps alternating with the one-layer chunks'
    # (pulse.profiling.timing.time_alternating). MindSpore: its figures are dispatch-bound and follow
    # what the other worker does meanwhile; one after the other, the fit (a small difference of two
    # large sums) gave F +1.3 / B +3.2 ms a join, alternated -0.5 / +0.7, and one undisturbed process
    # measures 0 / +0.6 (tiny-uvit). PyTorch: off: its figures are cache-bound, and a step of the
    # other model copy between steps evicts caches that a rank's own steps keep warm in training.
    alternate_fit: bool = False
    whole_backward_in_b: bool = False  # its split B computes both halves, W adds them up (MindSpore): CostTable's
    # what its communicator does that the simulator prices (Cluster's COMMUNICATOR_KEYS; none: PyTorch's)
    communicator: Mapping[str, bool] = field(default_factory=dict)
    # makes a window's layers real for the backends of ``backend_of`` while open (a diffusers model's
    # skeleton: those layers materialized, then released); zoo backends build a chunk's layers with it
    real_layers: RealLayers = nothing_to_make
    # counts what each layer's forward saves for its backward: act_mem (None: the spec's saved_bytes)
    count_saved: CountSaved | None = None


def job_parser(prog: str, launcher: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description=f"One rank of `pulse profile` (launch with {launcher}).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-option", action="append", default=[])
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--microbatch-size", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--link-repeats", type=int, default=None,
                        help="samples per link and all-reduce figure (default 4x --repeats: they are short, "
                             "and their tails need more samples than a layer's)")
    parser.add_argument("--hardware", default="cpu-local", help="what links that are not measured fall back to")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="layers timed under this autocast, as `pulse train --precision` runs them (PyTorch)")
    parser.add_argument("--images", default=None,
                        help="captioned images to time a pipeline's encoders on (default: synthetic PNGs)")
    parser.add_argument("--device-timing", choices=DEVICE_TIMINGS, default=None,
                        help="how an accelerator's layers are timed (`pulse profile --device-timing`; "
                             "default: the backend's own)")
    parser.add_argument("--plan-cuts", dest="spans", type=cut_list, default=None, metavar="0,A,B,...,L",
                        help="a plan's chunk boundaries (`pulse profile --plan`): each chunk is also timed as "
                             "one chunk where the plan runs it (the cost table's spans)")
    parser.add_argument("--out-costs", required=True)
    parser.add_argument("--out-cluster", required=True)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds any wait between ranks may take, a turn's included (`pulse profile --timeout`)")
    return parser


def cut_list(text: str) -> list[int]:
    """``0,A,B,...,L``: increasing layer indices from 0 (argparse's type: a bad list is its one-line error)."""
    try:
        cuts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 0,5,9,23, got {text!r}") from None
    if len(cuts) < 2 or cuts[0] != 0 or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise argparse.ArgumentTypeError(f"expected increasing layer indices from 0, got {text!r}")
    return cuts


def run_profile(args: argparse.Namespace, rig: ProfileRig) -> int:
    """Every measurement, then rank 0 writes both files; 2 after a one-line refusal (every rank calls it;
    each rank that refuses says why, and the launcher passes every rank's line on). Every wait between
    ranks, a rank's wait for its turn included, lasts up to ``--timeout`` (the backend's communicator's)."""
    args.link_repeats = args.link_repeats or 4 * args.repeats
    ranks, lead = rig.ranks, rig.ranks.rank == 0
    try:
        spec = load_model(args.model, parse_options(args.model_option))
        if args.spans and args.spans[-1] != spec.num_layers:
            raise PulseError(f"--plan-cuts {','.join(map(str, args.spans))} end at layer {args.spans[-1]}, "
                             f"but {spec.name} has {spec.num_layers} layers: profile the plan of this model")
        if lead:
            print(f"profile: {spec.name}, {spec.num_layers} layers, microbatch {args.microbatch_size}, "
                  f"{ranks.world} ranks ({'at most %d at once' % rig.cores if rig.cores else 'all at once'})",
                  flush=True)
        model = windowed(spec, rig.backend_of, rig.real_layers, args.microbatch_size)  # one window real at a time
        gathered = measure_layers_in_turns(args, spec, model, rig.loss, ranks, rig.cores, rig.encoder_seconds,
                                           rig.backward_reruns_forward, rig.alternate_fit, rig.count_saved)
        sharing = core_sharing(model, rig)
        if lead and sharing is not None:
            print(f"profile: two ranks on one core get {sharing:.3f} of it together", flush=True)
        freeze_setup_objects()  # as training does; link figures are means: a collection's stall is no message cost
        cold = measure_in_pairs(cold_start_runs(model, rig.loss, in_flight(args.pp)), ranks, rig.cores,
                                steps=max(1, args.repeats // 2), warmup=min(args.warmup, 1))
        links = {}
        for a in range(ranks.world):
            for b in range(ranks.world):
                if a != b:
                    links[(a, b)] = probe_pair(ranks, a, b, args.link_repeats)
                    if lead:
                        print(f"profile: link {a}->{b}: {links[(a, b)]}", flush=True)
        curves = tuple(allreduce_curve(ranks, g, args.link_repeats) for g in groups(args.pp, args.dp))
        if lead:
            write_outputs(args, spec, rig, gathered, links, curves, sharing, cold)
    except PulseError as exc:  # every rank says why: a refusal of rank 2 alone must reach the user too
        hint = " (pulse profile --timeout: how long a rank may wait for the others)" \
            if isinstance(exc, CommTimeout) else ""
        print(f"pulse profile: rank {ranks.rank}: error: {exc}{hint}", file=sys.stderr, flush=True)
        return 2
    ranks.barrier()
    return 0


def cold_start_runs(model: WindowedModel, loss: LossFn, microbatches: int) -> EachRun:
    """The cold-start probe's runs (``cold_start_over``'s ``each_run``): every window's layers, one chunk
    each, real one window at a time; only their actions count, not the stand-ins'."""
    def each_run(split: bool, gaps: RunGaps) -> list[dict[str, list[float]]]:
        def measured(window: Window) -> dict[str, list[float]]:
            run = model.run(window, loss, split, microbatches)
            return gaps(run.run, set(run.real_chunks))
        return model.each_window(measured)
    return each_run


def core_sharing(model: WindowedModel, rig: ProfileRig) -> float | None:
    """The share of a core two ranks pinned to it get together, against one alone (1.0: nothing lost
    to switching between them): rank 0 times the forward and backward of the model's heaviest window
    alone, then while rank ``cores`` (round-robin: pinned to the same core, ``pulse.cores``) runs the
    same. None where no ranks share a core."""
    ranks, cores = rig.ranks, rig.cores
    if not cores or ranks.world <= cores or not rig.pinned:
        return None
    if ranks.rank in (0, cores):  # only the pair builds layers
        return model.each_window(lambda w: _shared_core(ranks, cores, model.run(w, rig.loss, split=False).run),
                                 [model.heaviest()])[0]
    return _shared_core(ranks, cores, None)


def _shared_core(ranks: Ranks, cores: int, run: Any) -> float | None:
    """``core_sharing``'s timing (every rank calls it; ``run``: the pair's, None elsewhere)."""
    pair, rank = (0, cores), ranks.rank

    def seconds_per_step(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run.step()
        return (time.perf_counter() - start) / steps

    mine = max(3, math.ceil(SHARING_SECONDS / seconds_per_step(2))) if rank == 0 else 0
    if rank == cores:
        seconds_per_step(2)
    steps = ranks.gather(mine)[0]  # rank 0's count, for both
    ranks.barrier()
    alone = seconds_per_step(steps) if rank == 0 else 0.0
    ranks.barrier()
    together = seconds_per_step(steps) if rank in pair else 0.0
    ranks.barrier()
    return min(1.0, 2 * alone / together) if rank == 0 else None


def spec_activation_bytes(spec: ModelSpec, microbatch_size: int, precision: str = "fp32") -> tuple[int, ...]:
    """The spec's per-layer activation bytes at ``microbatch_size`` and ``precision``'s activation bytes:
    a cost table's ``act_mem`` where nothing counts what autograd keeps (MindSpore, whose cells
    recompute in the backward)."""
    sized = spec.with_act_bytes(PRECISION_BYTES[precision])
    return tuple(layer.saved_bytes * microbatch_size for layer in sized.layers)


def activation_bytes(args: argparse.Namespace, spec: ModelSpec, gathered: list[Any]) -> tuple[tuple[int, ...], bool]:
    """Each layer's ``act_mem`` and whether it was measured: the median over the ranks of what their
    forwards saved for the backward, where the backend counted it; else the spec's figures."""
    measured = [r["act_mem"] for r in gathered if r and r.get("act_mem") is not None]
    if not measured:
        return spec_activation_bytes(spec, args.microbatch_size, args.precision), False
    return tuple(round(statistics.median(m[i] for m in measured)) for i in range(spec.num_layers)), True


def median_spans(gathered: list[Any]) -> tuple[tuple[int, int, str, float], ...]:
    """Each measured chunk's figure by kind: the median over the ranks that timed it."""
    by_rank = ({(a, b, k): t for a, b, k, t in r["spans"]} if r and r.get("spans") else None for r in gathered)
    return tuple((*chunk_kind, t) for chunk_kind, t in median_by_kind(by_rank))


def report_spans(costs: CostTable) -> None:
    """A line per measured chunk: its figures beside what its layers' figures (less the per-action fit) say."""
    by_layers = replace(costs, spans=())
    for a, b in dict.fromkeys((a, b) for a, b, _, _ in costs.spans):
        measured = {k: t * 1e3 for x, y, k, t in costs.spans if (x, y) == (a, b)}
        f, b_ = (t * 1e3 for t in by_layers.span(a, b))
        print(f"profile: the plan's chunk of layers {a}..{b - 1} as one: F {measured['F']:.2f} ms (its layers "
              f"{f:.2f}), B {measured['B']:.2f} ms (its layers {b_:.2f}), Bi {measured['Bi']:.2f}, "
              f"W {measured['W']:.2f}, O {measured['O']:.2f} ms", flush=True)


def median_by_kind(figures: Any) -> tuple[tuple[str, float], ...]:
    """Per kind (or name), the median over the ranks that measured it (None: a rank that did not)."""
    measured = [f for f in figures if f]
    kinds = dict.fromkeys(k for f in measured for k in f)
    return tuple((k, statistics.median(f[k] for f in measured if k in f)) for k in kinds)


def write_outputs(args: argparse.Namespace, spec: ModelSpec, rig: ProfileRig, gathered: list[Any],
                  links: dict, curves: tuple, sharing: float | None = None, cold: Any = ()) -> None:
    world = rig.ranks.world
    columns = {k: [statistics.median(r[k][i] for r in gathered if r) for i in range(spec.num_layers)]
               for k in ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer")}
    per_action = median_by_kind(r["per_action"] for r in gathered if r)
    act_mem, counted = activation_bytes(args, spec, gathered)
    costs = CostTable(spec.name, args.microbatch_size, tuple(l.name for l in spec.layers), columns["fwd"],
                      columns["bwd"], act_mem,
                      f"measured:{rig.framework}, {world} ranks", tuple(columns["bwd_input"]),
                      tuple(columns["bwd_weight"]), tuple(columns["optimizer"]),
                      per_action=per_action, cold_start=median_by_kind(cold),
                      whole_backward_in_b=rig.whole_backward_in_b, act_mem_measured=counted,
                      spans=median_spans(gathered))
    report_spans(costs)
    if costs.cold_start:
        figures = ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in costs.cold_start)
        print(f"profile: cold start (after a message) {figures}", flush=True)
    encoders = median_by_kind(dict(r["encoders"]) for r in gathered if r)
    if encoders:  # a pipeline's UNet: its frozen encoders too, for plans that run them in the pipeline
        costs = replace(costs, encoder_fwd=encoders)
        print("profile: encoders " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in encoders), flush=True)
    costs.save(args.out_costs)
    base = load_cluster(args.hardware)
    hardware = replace(base.hardware, shared_cores=rig.cores, pinned_cores=rig.pinned,
                       core_sharing=base.hardware.core_sharing if sharing is None else sharing)
    measured = replace(base, name=f"measured-{base.name}", hardware=hardware, nodes=1, links=links,
                       allreduce=curves, source=f"measured: pulse profile, {world} ranks",
                       **rig.communicator)
    save_measured_cluster(measured, args.hardware, args.out_cluster)
    print(f"profile: wrote {args.out_costs} and {args.out_cluster}", flush=True)
