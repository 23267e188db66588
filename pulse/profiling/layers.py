"""Per-layer figures of ``pulse profile``: every layer's actions run by the runtime's own executor.

::

    the model as one chunk per layer on this rank (StageExecutor, in process), each action timed:
        F, B (whole), B and W (split), then each layer's optimizer step (clip share + AdamW)
    per_action: chunks of the size plans cut, round-robin on two in-process devices: what an
        action (or a chunk's optimizer step) costs once however many layers it runs
    a pipeline's frozen encoders: their E actions between the backbone's forwards and backwards

Everything goes through the ``Backend`` protocol (``from_numpy`` for the data),
so every backend measures with the same code (``pulse_torch.profile_job``,
``pulse_mindspore.profile_job``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from pulse.encoders import EncoderSet
from pulse.data.feed import DiffusionFeed
from pulse.data.noise import noise_schedule
from pulse.data.sources import load_source
from pulse.placement import from_cuts
from pulse.profiling.gather import Ranks
from pulse.profiling.timing import time_actions, time_alternating
from pulse.testing.local import local_run
from pulse.train.loop import StepBatches, global_grad_norm
from pulse.runtime.protocols import Backend, LossFn
from pulse.train.sampler import Sampler
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec

# a pipeline's encoders: (model, spec, images, time_encodes(source, encoders)) -> ((name, seconds), ...)
EncoderSeconds = Callable[[str, ModelSpec, Any, Callable[[Any, EncoderSet], dict[int, float]]],
                          tuple[tuple[str, float], ...]]


def one_chunk_per_layer(spec: ModelSpec, backend: Backend, loss: LossFn, microbatch_size: int, split: bool,
                        seed: int, microbatches: int = 1, cuts: list[int] | None = None, source: Any = None,
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
        actions += [Action(0, None, m, "E", encoder=e) for e in range(len(encoders.encoders) if encoders else 0)]
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

    # made when a layer reads it, as the training job's feed: its cost is the reader's
    batches = StepBatches(lambda step, replica, mb: feed.batch(step, replica, mb).map(backend.from_numpy), 0,
                          encoded=lambda step, replica, mb, feeds: backend.from_numpy(
                              feed.encoded(step, replica, mb, feeds)),
                          provide=lambda step, replica, mb, feeds, value: feed.provide(
                              step, replica, mb, feeds, backend.to_numpy(value)))
    return local_run(spec, placement, lower(schedule, spec, placement, encoders), backend, batches, loss,
                     encoders=encoders)


def time_encodes(spec: ModelSpec, backend: Backend, loss: LossFn, args: argparse.Namespace, source: Any,
                 encoders: EncoderSet) -> dict[int, float]:
    """Median seconds of each encoder's E action, between the backbone's forwards and backwards."""
    run = one_chunk_per_layer(spec, backend, loss, args.microbatch_size, split=False, seed=0, source=source,
                              encoders=encoders)
    timed = time_actions(run, args.repeats, args.warmup)
    return {e: timed[("E", e)] for e in range(len(encoders.encoders))}


def time_optimizer(run: Any, backend: Backend, repeats: int) -> list[float]:
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


def layer_costs(args: argparse.Namespace, spec: ModelSpec, backend_of: Callable[[], Backend], loss: LossFn,
                encoder_seconds: EncoderSeconds | None = None, backward_reruns_forward: bool = False,
                alternate_fit: bool = False) -> dict[str, Any]:
    """This rank's figures: per layer fwd, bwd, bwd_input, bwd_weight, optimizer; ``per_action``;
    a pipeline's ``encoders`` (with ``encoder_seconds``, the backend's way to build them).

    ``backward_reruns_forward``: the backend's backward always recomputes the forward first
    (MindSpore): its figures are stored without it (``without_forward``), as the cost table means them.
    ``alternate_fit``: the one-layer chunks and the chunks the per-action cost is fitted on are timed
    in alternating steps (``time_alternating``), not one after the other (see ``ProfileRig``)."""
    depth, n = in_flight(args.pp), spec.num_layers
    cuts = fit_cuts(n) if n >= 3 else None

    def runs(split: bool) -> tuple[Any, Any]:
        one = one_chunk_per_layer(spec, backend_of(), loss, args.microbatch_size, split=split, seed=0,
                                  microbatches=depth)
        # round-robin on two in-process devices, as a pipeline runs them: each chunk's input arrives as a message
        chunked = one_chunk_per_layer(spec, backend_of(), loss, args.microbatch_size, split=split, seed=0,
                                      cuts=cuts, microbatches=depth, devices=2) if cuts else None
        return one, chunked

    ones: dict[bool, dict] = {}
    fitted: dict[bool, dict] = {}
    chunk_runs: dict[bool, Any] = {}
    for split in (False, True):
        one, chunk_runs[split] = runs(split)
        if alternate_fit and chunk_runs[split] is not None:
            ones[split], fitted[split] = time_alternating([one, chunk_runs[split]], args.repeats, args.warmup)
        else:
            ones[split] = time_actions(one, args.repeats, args.warmup)
        if not split:
            one_optimizer = time_optimizer(one, one.executors[0].backend, args.repeats)
    chunk_optimizer: list[float] = []
    for split, chunked in chunk_runs.items():  # the fit's chunks, after both one-layer runs unless alternated
        if chunked is None:
            continue
        if split not in fitted:
            fitted[split] = time_actions(chunked, args.repeats, args.warmup)
        if not split:  # the optimizer too has a cost per call: one per chunk in training
            chunk_optimizer = time_optimizer(chunked, chunked.executors[0].backend, args.repeats)
    bwd = [ones[False][("B", c)] for c in range(n)]
    # the halves as measured (W of a one-layer chunk may walk the layer's inside twice); the input
    # half never above the whole backward
    bwd_input = [min(ones[True][("B", c)], bwd[c]) for c in range(n)]
    columns = {"fwd": [ones[False][("F", c)] for c in range(n)], "bwd": bwd, "bwd_input": bwd_input,
               "bwd_weight": [ones[True][("W", c)] for c in range(n)], "optimizer": one_optimizer}
    encoders = () if encoder_seconds is None else encoder_seconds(
        args.model, spec, args.images, lambda source, encs: time_encodes(spec, backend_of(), loss, args, source, encs))
    per_action = per_action_seconds(cuts, columns, fitted, chunk_optimizer) if cuts else {}
    if backward_reruns_forward:
        columns, per_action = without_forward(columns, per_action)
    return {**columns, "per_action": per_action, "encoders": encoders}


def without_forward(columns: dict[str, list[float]], per_action: dict[str, float]
                    ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Figures of a backend whose backward re-runs the forward (MindSpore's vjp rebuilds the tape):
    the backward halves less the forward, as a cost table means them; the simulator adds the
    forward back to every chunk the plan recomputes, and such a backend's plans recompute every
    chunk (``BackendTraits.always_recomputes``). The per-action fit was taken on whole
    figures, so a backward's share loses the forward's share (a chunk's B + F: the layers' sums less
    (layers - 1) x (B's + F's per-action cost)). Never below a nanosecond: no layer is free."""
    floor = 1e-9
    out = dict(columns)
    for name in ("bwd", "bwd_input"):
        out[name] = [max(b - f, floor) for b, f in zip(columns[name], columns["fwd"])]
    fitted = dict(per_action)
    for kind in ("B", "Bi"):
        if kind in fitted and "F" in fitted:
            fitted[kind] -= fitted["F"]
    return out, fitted


def measure_layers_in_turns(args: argparse.Namespace, spec: ModelSpec, backend_of: Callable[[], Backend],
                            loss: LossFn, ranks: Ranks, cores: int | None,
                            encoder_seconds: EncoderSeconds | None = None,
                            backward_reruns_forward: bool = False, alternate_fit: bool = False) -> list[Any]:
    """Every rank measures, at most ``cores`` at a time; each rank's figures, gathered."""
    turns = -(-ranks.world // cores) if cores else 1
    mine = None
    for turn in range(turns):
        if not cores or ranks.rank // cores == turn:
            mine = layer_costs(args, spec, backend_of, loss, encoder_seconds, backward_reruns_forward, alternate_fit)
        ranks.barrier()
    return ranks.gather(mine)


PER_ACTION_SPAN = 3  # layers per chunk the per-action cost is fitted on: plans' usual chunk size


def fit_cuts(n: int) -> list[int]:
    """Layer 0 alone (its backward has no input gradient to split off), then chunks of
    PER_ACTION_SPAN layers, the remainder in the last; one chunk of 1 .. n-1 for small models."""
    if n < 2 + PER_ACTION_SPAN:
        return [0, 1, n]
    return [0, *range(1, n - PER_ACTION_SPAN + 1, PER_ACTION_SPAN), n]


def per_action_seconds(cuts: list[int], columns: dict[str, list[float]], chunked: dict[bool, dict],
                       chunk_optimizer: list[float]) -> dict[str, float]:
    """What an action (or a chunk's optimizer step, ``O``) costs once however many layers it runs
    (``CostTable.per_action``), and what a device pays to make its own batch (``D``).

    ``chunked``: the figures of the chunks of ``cuts`` (``fit_cuts``), run round-robin on two
    in-process devices as a pipeline runs them (each chunk's input arrives as a message), whole
    (False) and split (True); ``chunk_optimizer``: each chunk's optimizer step. Per kind, every
    multi-layer chunk against the sum of its layers' one-layer figures, per join, averaged; fitted on
    chunks the size plans use (one chunk of 14 layers saved 3x more per join than chunks of 3 did,
    tiny-uvit, and a table fitted on it priced a 2-fold wave's chunks 15% under what they took).
    ``D``: the forward of the second device's first chunk (layers 1-3, which makes that device's
    batch) over what the fit gives it: 0.25 ms of a 0.45 ms chunk in tiny-uvit's V. No ``D`` below
    five layers."""
    spans = [(c, cuts[c], cuts[c + 1]) for c in range(len(cuts) - 1) if cuts[c + 1] - cuts[c] > 1]
    names = {False: {"F": "F", "B": "B"}, True: {"B": "Bi", "W": "W"}}  # a split B is the input half
    measured = {(names[split][k], c): t for split in (False, True) for (k, c), t in chunked[split].items()
                if k in names[split]}
    measured.update({("O", c): t for c, t in enumerate(chunk_optimizer)})
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
