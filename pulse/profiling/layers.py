"""Per-layer figures of ``pulse profile``: every layer's actions run by the runtime's own executor.

::

    window by window (pulse.profiling.windows: only that window's layers real, the rest stand-ins):
        its layers as one chunk each on this rank (StageExecutor, in process), each action timed:
            F, B (whole), B and W (split), then each layer's optimizer step (clip share + AdamW);
            one more step counting the bytes each layer's forward saved for its backward (act_mem)
        the window as one chunk on a second in-process device (its input a message): per_action,
            what an action (or a chunk's optimizer step) costs once however many layers it runs
    a pipeline's frozen encoders: their E actions between the backbone's forwards and backwards

Everything goes through the ``Backend`` protocol (``from_numpy`` for the data),
so every backend measures with the same code (``pulse_torch.profile_job``,
``pulse_mindspore.profile_job``).
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

from pulse.encoders import EncoderSet
from pulse.profiling.gather import Ranks
from pulse.profiling.runs import one_chunk_per_layer  # noqa: F401 (its home before runs.py: tests, benchmarks)
from pulse.profiling.timing import time_actions, time_alternating, timed_call
from pulse.profiling.windows import RealLayers, Window, WindowedModel, WindowRun
from pulse.train.loop import global_grad_norm
from pulse.runtime.protocols import Backend, LossFn
from pulse.spec import ModelSpec

# a pipeline's encoders: (model, spec, images, time_encodes(source, encoders)) -> ((name, seconds), ...)
EncoderSeconds = Callable[[str, ModelSpec, Any, Callable[[Any, EncoderSet], dict[int, float]]],
                          tuple[tuple[str, float], ...]]
# (a backend) -> a context counting, while open, the bytes each chunk's forward saved for its backward
# (parameters and copies of them excluded), by the chunk's layers (start, end): the largest forward's
CountSaved = Callable[[Backend], ContextManager[dict[tuple[int, int], int]]]


def windowed(spec: ModelSpec, backend_of: Callable[[], Backend], real_layers: RealLayers, microbatch_size: int
             ) -> WindowedModel:
    """``spec`` as the profile holds it: its per-action fit's chunks (``fit_cuts``) as windows, one real at a time."""
    n = spec.num_layers
    return WindowedModel(spec, fit_cuts(n) if n >= 3 else [0, n], backend_of, real_layers, microbatch_size)


def time_encodes(model: WindowedModel, loss: LossFn, args: argparse.Namespace, source: Any,
                 encoders: EncoderSet) -> dict[int, float]:
    """Median seconds of each encoder's E action, between the backbone's forwards and backwards (the
    heaviest window's layers real, the rest stand-ins)."""
    def timed(window: Window) -> dict[int, float]:
        run = model.run(window, loss, split=False, source=source, encoders=encoders).run
        seconds = time_actions(run, args.repeats, args.warmup)
        return {e: seconds[("E", e)] for e in range(len(encoders.encoders))}
    return model.each_window(timed, [model.heaviest()])[0]


def time_optimizer(run: Any, backend: Backend, repeats: int, chunks: Sequence[int] | None = None) -> list[float]:
    """Seconds of each chunk's share of the optimizer update (gradients from the last step): its
    squared-gradient sum for the clipping norm, then its AdamW step. Not the scaling: the loop
    scales only when the norm is over the limit, and traces of training show it does not
    (2 us "clip" spans) while scaling every step priced tiny-uvit's updates at twice their time.
    ``chunks``: which of the run's chunks (default every one)."""
    out = []
    handles = {c: h for ex in run.executors for c, h in ex.chunks.items()}
    for c in sorted(handles) if chunks is None else chunks:
        chunk = handles[c]
        times = []
        for _ in range(repeats + 1):
            times.append(timed_call(backend, lambda: (global_grad_norm(backend, [chunk], None, ()),
                                                       backend.optimizer_step(chunk))))
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


@dataclass
class WindowFigures:
    """One window's figures: its layers' (by layer index) and, fitted, the window's as one chunk."""

    ones: dict[bool, dict[tuple[str, int], float]] = field(default_factory=dict)  # split -> (kind, layer)
    optimizer: list[float] = field(default_factory=list)  # each layer's
    act_mem: list[int] | None = None  # each layer's saved bytes (None: not counted)
    fitted: dict[bool, dict[str, float]] = field(default_factory=dict)  # split -> kind -> the window's chunk
    fit_optimizer: float | None = None


def _by_layer(seconds: dict[tuple[str, int], float], run: WindowRun) -> dict[tuple[str, int], float]:
    return {(kind, run.real_chunks[c]): t for (kind, c), t in seconds.items() if c in run.real_chunks}


def saved_per_layer(one: WindowRun, count_saved: CountSaved) -> list[int]:
    """Bytes each layer's forward kept for its backward, counted over one more (untimed) step:
    the counting hooks cost time, so the timed steps run without them."""
    with count_saved(one.run.executors[0].backend.real) as counts:
        one.run.step()
    return [counts[(layer, layer + 1)] for layer in sorted(one.real_chunks.values())]


def window_figures(args: argparse.Namespace, model: WindowedModel, window: Window, loss: LossFn, fit: bool,
                   alternate_fit: bool, count_saved: CountSaved | None) -> WindowFigures:
    """The figures of one window, its layers real (inside ``WindowedModel.each_window``). Its one-layer
    run and its fit run are built one after the other (alternated: side by side), so no more than
    those layers are real, or twice where alternated."""
    depth, out = in_flight(args.pp), WindowFigures()
    for split in (False, True):
        one = model.run(window, loss, split, depth)
        chunked = model.run(window, loss, split, depth, fit=True) if fit and alternate_fit else None
        if chunked is not None:
            timed, timed_fit = time_alternating([one.run, chunked.run], args.repeats, args.warmup)
        else:
            timed = time_actions(one.run, args.repeats, args.warmup)
        out.ones[split] = _by_layer(timed, one)
        if not split:
            out.optimizer = time_optimizer(one.run, one.run.executors[0].backend, args.repeats, sorted(one.real_chunks))
            if count_saved is not None:
                out.act_mem = saved_per_layer(one, count_saved)
        one.close()  # its chunks gone before the fit's are built
        if not fit:
            continue
        if chunked is None:
            chunked = model.run(window, loss, split, depth, fit=True)
            timed_fit = time_actions(chunked.run, args.repeats, args.warmup)
        (c,) = chunked.real_chunks
        out.fitted[split] = {kind: t for (kind, k), t in timed_fit.items() if k == c}
        if not split:  # the optimizer too has a cost per call: one per chunk in training
            out.fit_optimizer = time_optimizer(chunked.run, chunked.run.executors[0].backend, args.repeats, [c])[0]
        chunked.close()
    return out


def layer_costs(args: argparse.Namespace, model: WindowedModel, loss: LossFn,
                encoder_seconds: EncoderSeconds | None = None, backward_reruns_forward: bool = False,
                alternate_fit: bool = False, count_saved: CountSaved | None = None) -> dict[str, Any]:
    """This rank's figures: per layer fwd, bwd, bwd_input, bwd_weight, optimizer, act_mem (None where
    ``count_saved`` is None); ``per_action``; a pipeline's ``encoders`` (with ``encoder_seconds``, the
    backend's way to build them). Measured window by window (``model``), one window's layers real at a time.

    ``backward_reruns_forward``: the backend's backward always recomputes the forward first
    (MindSpore): its figures are stored without it (``without_forward``), as the cost table means them.
    ``alternate_fit``: the one-layer chunks and the chunks the per-action cost is fitted on are timed
    in alternating steps (``time_alternating``), not one after the other (see ``ProfileRig``)."""
    n, fits = model.spec.num_layers, model.spec.num_layers >= 3
    windows = model.each_window(lambda w: window_figures(args, model, w, loss, fits and w.size > 1, alternate_fit,
                                                         count_saved))
    ones = {split: {k: t for f in windows for k, t in f.ones[split].items()} for split in (False, True)}
    bwd = [ones[False][("B", c)] for c in range(n)]
    # the halves as measured (W of a one-layer chunk may walk the layer's inside twice); the input
    # half never above the whole backward
    bwd_input = [min(ones[True][("B", c)], bwd[c]) for c in range(n)]
    columns = {"fwd": [ones[False][("F", c)] for c in range(n)], "bwd": bwd, "bwd_input": bwd_input,
               "bwd_weight": [ones[True][("W", c)] for c in range(n)],
               "optimizer": [t for f in windows for t in f.optimizer]}
    act_mem = None if count_saved is None else [b for f in windows for b in f.act_mem]
    encoders = () if encoder_seconds is None else encoder_seconds(
        args.model, model.spec, args.images, lambda source, encs: time_encodes(model, loss, args, source, encs))
    per_action = {}
    if fits:
        fitted = {split: {(kind, c): t for c, f in enumerate(windows) for kind, t in f.fitted.get(split, {}).items()}
                  for split in (False, True)}
        chunk_optimizer = [f.optimizer[0] if f.fit_optimizer is None else f.fit_optimizer for f in windows]
        per_action = per_action_seconds(model.cuts, columns, fitted, chunk_optimizer)
    if backward_reruns_forward:
        columns, per_action = without_forward(columns, per_action)
    return {**columns, "act_mem": act_mem, "per_action": per_action, "encoders": encoders}


def span_costs(args: argparse.Namespace, model: WindowedModel, loss: LossFn, cuts: Sequence[int],
               batch_seconds: float = 0.0, backward_reruns_forward: bool = False) -> list[tuple[int, int, str, float]]:
    """A plan's chunks (layers ``cuts[i] .. cuts[i+1] - 1``) each timed as one chunk where a pipeline runs
    it (``WindowedModel.run``'s fit layout), its layers alone real: F and B whole, then B (as Bi) and
    W split, and the chunk's optimizer step (O): ``CostTable.spans``.

    The chunk of layers 1.. makes its device's batch in its forward (no stand-in fits before it on
    that device), which the simulator adds on its own (``batch_seconds``, the fit's ``D``): taken
    out of its F. A backend whose backward re-runs the forward has it taken out of B and Bi too, as
    ``without_forward`` does for the layers."""
    spans = WindowedModel(model.spec, list(cuts), model.backend_of, model.real_layers, model.microbatch_size,
                          model.seed)
    depth = in_flight(args.pp)

    def timed(window: Window) -> list[tuple[int, int, str, float]]:
        figures: dict[str, float] = {}
        for split in (False, True):
            chunk = spans.run(window, loss, split, depth, fit=True)
            (c,) = chunk.real_chunks
            mine = {kind: t for (kind, k), t in time_actions(chunk.run, args.repeats, args.warmup).items() if k == c}
            if split:
                figures["Bi"], figures["W"] = mine["B"], mine["W"]
            else:
                figures["F"], figures["B"] = mine["F"], mine["B"]
                figures["O"] = time_optimizer(chunk.run, chunk.run.executors[0].backend, args.repeats, [c])[0]
            chunk.close()
        if window.start == 1:
            figures["F"] = max(figures["F"] - batch_seconds, 0.0)
        if backward_reruns_forward:
            figures["B"], figures["Bi"] = (max(figures[k] - figures["F"], 1e-9) for k in ("B", "Bi"))
        return [(window.start, window.end, kind, t) for kind, t in figures.items()]
    return [entry for window in spans.each_window(timed) for entry in window]


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


def measure_layers_in_turns(args: argparse.Namespace, spec: ModelSpec, model: WindowedModel, loss: LossFn,
                            ranks: Ranks, cores: int | None, encoder_seconds: EncoderSeconds | None = None,
                            backward_reruns_forward: bool = False, alternate_fit: bool = False,
                            count_saved: CountSaved | None = None) -> list[Any]:
    """Every rank measures ``model`` (of ``spec``), at most ``cores`` at a time; each rank's figures, gathered."""
    turns = -(-ranks.world // cores) if cores else 1
    mine = None
    for turn in range(turns):
        if not cores or ranks.rank // cores == turn:
            mine = layer_costs(args, model, loss, encoder_seconds, backward_reruns_forward, alternate_fit, count_saved)
            if getattr(args, "spans", None):  # `pulse profile --plan`: the plan's chunks as they run
                mine["spans"] = span_costs(args, model, loss, args.spans, mine["per_action"].get("D", 0.0),
                                           backward_reruns_forward)
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
