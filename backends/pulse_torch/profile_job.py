"""The per-rank job of ``pulse profile`` (torchrun launches it on every rank at once).

::

    every rank ── layers: the model as one chunk per layer on this rank, run by the
                  StageExecutor (the runtime's own path: TorchBackend or the diffusers
                  adapter), each action timed: F, B (whole), B and W (split), then the
                  optimizer step (clip share + AdamW) of each layer; medians
               ── links: for each ordered pair in turn, through TorchCommunicator:
                  ping-pong (latency), back-to-back messages (per-message costs),
                  large messages (bandwidth)
               ── all-reduce: seconds per size over the pipeline, data-parallel and
                  world groups
               ── cold start: in pairs, every layer's actions right after a real message
                  exchange and back to back (pulse_torch.cold_start)
               ── ranks sharing a core (more ranks than cores): rank 0's forward and backward
                  alone, then with the rank pinned beside it: the share of the core they keep
               ── a pipeline's frozen encoders (pulse_torch.pipeline.encoder_costs): their E
                  actions timed between the backbone's forwards and backwards
    rank 0     ── median over ranks per layer -> costs.yaml; links + curves -> cluster.yaml

Ranks measure their layers at the same time, so the contention of a shared host
is in the figures, but never more ranks than cores at once (``shared_cores``):
the simulator models oversubscription itself (``pulse.sim.program``), with the
ranks pinned as they were here (``pinned_cores``).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from pulse.cli.common import parse_options
from pulse.zoo.loading import load_model
from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster, save_measured_cluster
from pulse.links import AllReduceCurve, LinkCost
from pulse.placement import from_cuts
from pulse.layout import Layout
from pulse.runtime.local import local_run
from pulse.encoders import EncoderSet
from pulse.runtime.loop import StepBatches, freeze_setup_objects, global_grad_norm
from pulse.runtime.sampler import Sampler
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse_torch.action_timing import time_actions
from pulse_torch.cold_start import measure_in_pairs
from pulse_torch.comm import TorchCommunicator
from pulse_torch.dist import direction_groups, pin_to_cores, pins_cores
from pulse.data.feed import DiffusionFeed
from pulse.data.noise import noise_schedule
from pulse.data.sources import load_source
from pulse_torch.diffusion import eps_loss
from pulse_torch.pipeline.encoder_costs import encoder_seconds
from pulse_torch.profiler import TorchProfiler

SHARING_SECONDS = 0.5  # each core-sharing figure spans about this long
SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23)  # all-reduce curve points, bytes


def expected(samples: list[float]) -> float:
    """A link or all-reduce figure: the mean of its samples, not the median. Why: a message's
    delay on a shared host is heavy-tailed (measured here: a small all-reduce right after compute
    takes ~0.35 ms three times in four and 1.5-8.5 ms otherwise), every step pays its share of
    that tail, and the simulator adds delays along the critical path, where the expectation of
    a sum is the sum of the expectations. Link figures have 4x the samples of a layer's."""
    return statistics.fmean(samples)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pulse_torch.profile_job", allow_abbrev=False,
                                     description="One rank of `pulse profile` (launch with torchrun).")
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
    parser.add_argument("--images", default=None,
                        help="captioned images to time a pipeline's encoders on (default: synthetic PNGs)")
    parser.add_argument("--out-costs", required=True)
    parser.add_argument("--out-cluster", required=True)
    return parser


def one_chunk_per_layer(spec: ModelSpec, backend: Any, microbatch_size: int, split: bool, seed: int,
                        microbatches: int = 1, cuts: list[int] | None = None, source: Any = None,
                        encoders: EncoderSet | None = None, devices: int = 1):
    """The whole model on this rank, one chunk per layer (or per ``cuts``), run by the executor in process;
    with ``encoders``, each microbatch's encodes (E actions on ``source``) run before its forwards.
    ``devices`` > 1: the chunks go round-robin over that many in-process devices (each chunk's input
    then arrives as a message, and each device makes its own batch, as in a pipeline)."""
    cuts = cuts or list(range(spec.num_layers + 1))
    n = len(cuts) - 1
    on = [c % devices for c in range(n)]
    placement = from_cuts("sequential", cuts, on, devices, "direct", "profile")
    actions = []
    for m in range(microbatches):
        actions += [Action(0, e, m, "E") for e in range(len(encoders.encoders) if encoders else 0)]
        actions += [Action(on[c], c, m, "F") for c in range(n)]
    for m in range(microbatches):
        for c in reversed(range(n)):
            actions.append(Action(on[c], c, m, "B"))
            if split:
                actions.append(Action(on[c], c, m, "W"))
    schedule = Schedule("profile", microbatches,
                        {d: tuple(a for a in actions if a.device == d) for d in range(devices)})
    source = source or load_source(None, spec, seed)
    sampler = Sampler(source.num_samples, microbatch_size, microbatches, 1, seed)
    feed = DiffusionFeed(source, sampler, noise_schedule("linear"), seed)
    to_torch = lambda v: torch.from_numpy(v).to(backend.device)  # noqa: E731

    # made when a layer reads it, as pulse_torch.job's feed: its cost is the reader's
    batches = StepBatches(lambda step, replica, mb: feed.batch(step, replica, mb).map(to_torch), 0,
                          encoded=lambda step, replica, mb, feeds: to_torch(feed.encoded(step, replica, mb, feeds)),
                          provide=lambda step, replica, mb, feeds, value: feed.provide(
                              step, replica, mb, feeds, value.detach().cpu().numpy()))
    return local_run(spec, placement, lower(schedule, spec, placement, encoders), backend, batches, eps_loss,
                     encoders=encoders)


def time_encodes(spec: ModelSpec, backend: Any, args: argparse.Namespace, source: Any,
                 encoders: EncoderSet) -> dict[int, float]:
    """Median seconds of each encoder's E action, between the backbone's forwards and backwards."""
    run = one_chunk_per_layer(spec, backend, args.microbatch_size, split=False, seed=0, source=source,
                              encoders=encoders)
    timed = time_actions(run, args.repeats, args.warmup)
    return {e: timed[("E", e)] for e in range(len(encoders.encoders))}


def time_optimizer(run: Any, backend: Any, repeats: int) -> list[float]:
    """Seconds of each chunk's share of the optimizer update (gradients from the last step): its
    squared-gradient sum for the clipping norm, then its AdamW step. Not the scaling: the loop
    scales only when the norm is over the limit, and traces of training show it does not
    (2 us "clip" spans) while scaling every step priced tiny-uvit's updates at twice their time."""
    out = []
    chunks = {c: h for ex in run.executors for c, h in ex.chunks.items()}
    for c in sorted(chunks):
        chunk = chunks[c]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            global_grad_norm(backend, [chunk], None, ())
            backend.optimizer_step(chunk)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times[1:]))  # the first step builds the optimizer state
    return out


def in_flight(pp: int) -> int:
    """Microbatches the layers are timed with, all forwards before their backwards: a V over ``pp``
    devices holds up to 2 pp microbatches' activations on its first device, so a backward reads
    activations that other microbatches' work has pushed out of the caches. Timed with one, a layer's
    whole working set stays cached from its forward to its backward, and a pipeline's actions took
    1.1-1.4x the figures (tiny-uvit, 4 microbatches). At most 4: by then a small model's working
    set has left the caches too, and a large one's never fitted (each one costs a profile step)."""
    return min(2 * pp, 4)


def layer_costs(args: argparse.Namespace, spec: ModelSpec, backend_of: Any) -> dict[str, list[float]]:
    depth = in_flight(args.pp)
    whole = one_chunk_per_layer(spec, backend_of(), args.microbatch_size, split=False, seed=0, microbatches=depth)
    plain = time_actions(whole, args.repeats, args.warmup)
    halves = time_actions(one_chunk_per_layer(spec, backend_of(), args.microbatch_size, split=True, seed=0,
                                              microbatches=depth), args.repeats, args.warmup)
    n = spec.num_layers
    bwd = [plain[("B", c)] for c in range(n)]
    # the halves as measured (W of a one-layer chunk may walk the layer's inside twice); the input
    # half never above the whole backward
    bwd_input = [min(halves[("B", c)], bwd[c]) for c in range(n)]
    columns = {"fwd": [plain[("F", c)] for c in range(n)], "bwd": bwd, "bwd_input": bwd_input,
               "bwd_weight": [halves[("W", c)] for c in range(n)],
               "optimizer": time_optimizer(whole, whole.executors[0].backend, args.repeats)}
    encoders = encoder_seconds(args.model, spec, args.images,
                               lambda source, encs: time_encodes(spec, backend_of(), args, source, encs))
    return {**columns, "per_action": per_action_seconds(args, spec, backend_of, columns), "encoders": encoders}


PER_ACTION_SPAN = 3  # layers per chunk the per-action cost is fitted on: plans' usual chunk size


def fit_cuts(n: int) -> list[int]:
    """Layer 0 alone (its backward has no input gradient to split off), then chunks of
    PER_ACTION_SPAN layers, the remainder in the last; one chunk of 1 .. n-1 for small models."""
    if n < 2 + PER_ACTION_SPAN:
        return [0, 1, n]
    return [0, *range(1, n - PER_ACTION_SPAN + 1, PER_ACTION_SPAN), n]


def per_action_seconds(args: argparse.Namespace, spec: ModelSpec, backend_of: Any,
                       columns: dict[str, list[float]]) -> dict[str, float]:
    """What an action (or a chunk's optimizer step, ``O``) costs once however many layers it runs
    (``CostTable.per_action``), and what a device pays to make its own batch (``D``).

    The chunks of ``fit_cuts`` run round-robin on two in-process devices, as a pipeline runs them:
    each chunk's input arrives as a message. Per kind, every multi-layer chunk against the sum of
    its layers' one-layer figures, per join, averaged; fitted on chunks the size plans use (one chunk
    of 14 layers saved 3x more per join than chunks of 3 did, tiny-uvit, and a table fitted on it
    priced a 2-fold wave's chunks 15% under what they took). ``D``: the forward of the second
    device's first chunk (layers 1-3, which makes that device's batch) over what the fit gives it:
    0.25 ms of a 0.45 ms chunk in tiny-uvit's V. Empty below three layers; no ``D`` below five."""
    n = spec.num_layers
    if n < 3:
        return {}
    cuts = fit_cuts(n)
    spans = [(c, cuts[c], cuts[c + 1]) for c in range(len(cuts) - 1) if cuts[c + 1] - cuts[c] > 1]
    measured: dict[tuple[str, int], float] = {}
    for split in (False, True):
        backend = backend_of()
        run = one_chunk_per_layer(spec, backend, args.microbatch_size, split=split, seed=0, cuts=cuts,
                                  microbatches=in_flight(args.pp), devices=2)
        names = {"B": "Bi", "W": "W"} if split else {"F": "F", "B": "B"}
        measured.update({(names[k], c): t for (k, c), t in time_actions(run, args.repeats, args.warmup).items()
                         if k in names})
        if not split:  # the optimizer too has a cost per call: one per chunk in training
            measured.update({("O", c): t for c, t in enumerate(time_optimizer(run, backend, args.repeats))})
    column = {"F": "fwd", "B": "bwd", "Bi": "bwd_input", "W": "bwd_weight", "O": "optimizer"}
    makes_batch = ("F", 1) if len(spans) > 1 else None  # chunk 1: the second device's first
    out = {}
    for kind, name in column.items():
        fit = [(c, a, b) for c, a, b in spans if (kind, c) != makes_batch]
        out[kind] = sum(sum(columns[name][a:b]) - measured[(kind, c)] for c, a, b in fit) / \
            sum(b - a - 1 for _, a, b in fit)
    if makes_batch is not None:
        _, a, b = spans[0]
        out["D"] = max(measured[makes_batch] - (sum(columns["fwd"][a:b]) - (b - a - 1) * out["F"]), 0.0)
    return out


def probe_pair(comm: TorchCommunicator, a: int, b: int, repeats: int) -> LinkCost:
    """Rank ``a`` to rank ``b`` through the real communicator (every rank calls it)."""
    me = comm.rank
    small, large = torch.zeros(16), torch.zeros(1 << 20)  # 64 B, 4 MiB
    one_way, send_calls, streams, bulk = [], [], [], []
    for rep in range(repeats + 1):
        dist.barrier()
        if me == b:  # b's first receive is posted before a starts the clock: no barrier skew in it
            comm.recv(a, 0)
        elif me == a:
            comm.send(small, b, 0)
            comm.wait_sends()
        start = time.perf_counter()
        for i in range(4):  # round trips back to back
            if me == a:
                comm.send(small, b, 1)
                comm.recv(b, 2)
            elif me == b:
                comm.recv(a, 1)
                comm.send(small, a, 2)
        comm.wait_sends()
        if rep and me == a:
            one_way.append((time.perf_counter() - start) / 8)
        for tensor, sink in ((small, streams), (large, bulk)):
            dist.barrier()
            start, calls = time.perf_counter(), 0.0
            for i in range(8):
                if me == a:
                    t0 = time.perf_counter()
                    comm.send(tensor, b, 10 + i)
                    calls += time.perf_counter() - t0
                elif me == b:
                    comm.recv(a, 10 + i)
            comm.wait_sends()
            if rep:
                sink.append((time.perf_counter() - start) / 8)
                if tensor is small and me == a:
                    send_calls.append(calls / 8)
    figures = torch.tensor([expected(x) if x else 0.0 for x in (one_way, send_calls, streams, bulk)],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the pair's figures, from whichever side saw them
    latency_total, send_call, per_message, per_large = figures.tolist()
    receive = max(per_message - send_call, 0.0)
    bandwidth = large.numel() * large.element_size() / max(per_large - per_message, 1e-9)
    return LinkCost(bandwidth=bandwidth, latency=max(latency_total - send_call - receive, 0.0),
                    message_overhead=receive, send_overhead=send_call)


def allreduce_curve(comm: TorchCommunicator, ranks: list[int], repeats: int) -> AllReduceCurve:
    seconds = []
    for nbytes in SIZES:
        buf = torch.zeros(nbytes // 4)
        times = []
        for rep in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if comm.rank in ranks:
                comm.all_reduce(buf, ranks)
            if rep:
                times.append(time.perf_counter() - start)
        t = torch.tensor([expected(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds.append(float(t))
    return AllReduceCurve(len(ranks), SIZES, tuple(seconds))


def core_sharing(args: argparse.Namespace, spec: ModelSpec, backend_of: Any, cores: int | None) -> float | None:
    """The share of a core two ranks pinned to it get together, against one alone (1.0: nothing lost
    to switching between them): rank 0 times the model's forward and backward alone, then while rank
    ``cores`` (round-robin: pinned to the same core, ``pulse.cores``) runs the same. None where no
    ranks share a core."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not cores or world <= cores or not pins_cores():
        return None
    pair = (0, cores)
    run = one_chunk_per_layer(spec, backend_of(), args.microbatch_size, split=False, seed=0) if rank in pair else None

    def seconds_per_step(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            run.step()
        return (time.perf_counter() - start) / steps

    steps = [max(3, math.ceil(SHARING_SECONDS / seconds_per_step(2))) if rank == 0 else 0]
    if rank == cores:
        seconds_per_step(2)
    dist.broadcast_object_list(steps, src=0)
    dist.barrier()
    alone = seconds_per_step(steps[0]) if rank == 0 else 0.0
    dist.barrier()
    together = seconds_per_step(steps[0]) if rank in pair else 0.0
    dist.barrier()
    return min(1.0, 2 * alone / together) if rank == 0 else None


def measure_layers_in_turns(args: argparse.Namespace, spec: ModelSpec, backend_of: Any, cores: int | None):
    """Every rank measures, at most ``cores`` at a time; each rank's figures, gathered."""
    world, rank = dist.get_world_size(), dist.get_rank()
    turns = -(-world // cores) if cores else 1
    mine = None
    for turn in range(turns):
        if not cores or rank // cores == turn:
            mine = layer_costs(args, spec, backend_of)
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.link_repeats = args.link_repeats or 4 * args.repeats
    pin_to_cores()  # as training: pulse_torch.dist.init_distributed
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    try:
        spec = load_model(args.model, parse_options(args.model_option))
        cores = os.cpu_count() if torch.cuda.device_count() == 0 else None
        backend_of = backend_factory(args, spec)
        if lead:
            print(f"profile: {spec.name}, {spec.num_layers} layers, microbatch {args.microbatch_size}, "
                  f"{world} ranks ({'at most %d at once' % cores if cores else 'all at once'})", flush=True)
        gathered = measure_layers_in_turns(args, spec, backend_of, cores)
        sharing = core_sharing(args, spec, backend_of, cores)
        if lead and sharing is not None:
            print(f"profile: two ranks on one core get {sharing:.3f} of it together", flush=True)
        freeze_setup_objects()  # as training does; link figures are means: a collection's stall is no message cost
        comm = build_comm(args, world)
        cold = measure_in_pairs(lambda split: one_chunk_per_layer(spec, backend_of(), args.microbatch_size, split=split,
                                                                  seed=0, microbatches=in_flight(args.pp)),
                                comm, cores, steps=max(3, args.repeats // 2))
        links = {}
        for a in range(world):
            for b in range(world):
                if a != b:
                    links[(a, b)] = probe_pair(comm, a, b, args.link_repeats)
                    if lead:
                        print(f"profile: link {a}->{b}: {links[(a, b)]}", flush=True)
        curves = tuple(allreduce_curve(comm, g, args.link_repeats) for g in groups(args.pp, args.dp))
        if lead:
            write_outputs(args, spec, gathered, links, curves, cores, world, sharing, cold)
    except PulseError as exc:
        if lead:
            print(f"pulse profile: error: {exc}", file=sys.stderr)
        return 2
    dist.barrier()
    # Leave without tearing the process group down: with ranks pinned to cores, gloo's teardown
    # after a wait at the barrier sometimes aborted a rank
    # ("terminate called without an active exception", signal 6) after the outputs were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def backend_factory(args: argparse.Namespace, spec: ModelSpec):
    """A fresh backend per measurement: TorchBackend, or the diffusers adapter's over the user's modules."""
    if args.model.startswith("diffusers:"):
        from pulse_torch.diffusers_adapter import load_diffusers

        return lambda: load_diffusers(args.model, device="cpu", **parse_options(args.model_option)).backend(
            lr=1e-12, seed=0)
    from pulse_torch.backend import TorchBackend

    return lambda: TorchBackend(seed=0, lr=1e-12)


def build_comm(args: argparse.Namespace, world: int) -> TorchCommunicator:
    comm = TorchCommunicator(timeout=120.0, p2p_groups=direction_groups("gloo"))
    for g in groups(args.pp, args.dp):
        if len(g) < world:
            comm.register_group(g)
    return comm


def groups(pp: int, dp: int) -> list[list[int]]:
    """One group per size the step uses: a pipeline, a data-parallel group, the world."""
    layout = Layout(pp, dp)
    out = {tuple(layout.replica_ranks(0)), tuple(range(pp * dp)), tuple(layout.stage_ranks(0))}
    return [list(g) for g in sorted(out, key=len) if len(g) > 1]


def median_by_kind(figures: Any) -> tuple[tuple[str, float], ...]:
    """Per kind (or name), the median over the ranks that measured it (None: a rank that did not)."""
    measured = [f for f in figures if f]
    kinds = dict.fromkeys(k for f in measured for k in f)
    return tuple((k, statistics.median(f[k] for f in measured if k in f)) for k in kinds)


def write_outputs(args, spec, gathered, links, curves, cores, world, sharing=None, cold=()) -> None:
    columns = {k: [statistics.median(r[k][i] for r in gathered if r) for i in range(spec.num_layers)]
               for k in ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer")}
    per_action = median_by_kind(r["per_action"] for r in gathered if r)
    if args.model.startswith("diffusers:"):  # the spec's figures for the user's modules
        act = tuple(layer.saved_bytes * args.microbatch_size for layer in spec.layers)
    else:  # what autograd really keeps, parameters excluded
        act = TorchProfiler(warmup=0, repeats=1).profile(spec, args.microbatch_size).act_mem
    costs = CostTable(spec.name, args.microbatch_size, tuple(l.name for l in spec.layers), columns["fwd"],
                      columns["bwd"], act, f"measured:torch-cpu, {world} ranks", tuple(columns["bwd_input"]),
                      tuple(columns["bwd_weight"]), tuple(columns["optimizer"]),
                      per_action=per_action, cold_start=median_by_kind(cold))
    if costs.cold_start:
        print("profile: cold start (after a message) " + ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in costs.cold_start),
              flush=True)
    encoders = median_by_kind(dict(r["encoders"]) for r in gathered if r)
    if encoders:  # a pipeline's UNet: its frozen encoders too, for plans that run them in the pipeline
        costs = replace(costs, encoder_fwd=encoders)
        print("profile: encoders " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in encoders), flush=True)
    costs.save(args.out_costs)
    base = load_cluster(args.hardware)
    hardware = replace(base.hardware, shared_cores=cores, pinned_cores=pins_cores(),
                       core_sharing=base.hardware.core_sharing if sharing is None else sharing)
    measured = replace(base, name=f"measured-{base.name}", hardware=hardware, nodes=1, links=links,
                       allreduce=curves, source=f"measured: pulse profile, {world} ranks")
    save_measured_cluster(measured, args.hardware, args.out_cluster)
    print(f"profile: wrote {args.out_costs} and {args.out_cluster}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
