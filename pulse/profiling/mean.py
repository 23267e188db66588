"""The mean of several profiles of one job: their cost tables, and their measured clusters.

Why: on a shared host the speed drifts between a profile and the runs it predicts (the same
layers timed 10-18% apart 20 s later on this 2-core VM). Profiles taken before and after a
set of runs, averaged, see the host as the runs saw it on average when the drift is linear
in time, and halve the variance of a single profile's noise where it is not.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster
from pulse.links import AllReduceCurve, LinkCost


def _columns(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    return tuple(statistics.fmean(col) for col in zip(*rows))


def _keyed(tables: Sequence[tuple[tuple[str, float], ...]], what: str) -> tuple[tuple[str, float], ...]:
    """Per key, the mean of its values; every table must name the same keys in the same order."""
    keys = [tuple(k for k, _ in t) for t in tables]
    if any(k != keys[0] for k in keys):
        raise PulseError(f"cannot average profiles: their '{what}' name different kinds ({keys[0]} vs others)")
    return tuple((k, statistics.fmean(dict(t)[k] for t in tables)) for k in keys[0])


def mean_costs(tables: Sequence[CostTable]) -> CostTable:
    """Every timed figure averaged; what is not a time (layers, bytes kept, flags) must agree."""
    first = tables[0]
    for t in tables[1:]:
        same = (t.model, t.microbatch_size, t.layer_names, t.act_mem, t.whole_backward_in_b)
        if same != (first.model, first.microbatch_size, first.layer_names, first.act_mem, first.whole_backward_in_b):
            raise PulseError(f"cannot average profiles of different jobs: '{first.model}' at microbatch "
                             f"{first.microbatch_size} vs '{t.model}' at {t.microbatch_size}")
    timed = {name: _columns([getattr(t, name) for t in tables])
             for name in ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer")}
    return replace(first, **timed, source=f"mean of {len(tables)} profiles: {first.source}",
                   encoder_fwd=_keyed([t.encoder_fwd for t in tables], "encoder_fwd"),
                   per_action=_keyed([t.per_action for t in tables], "per_action"),
                   cold_start=_keyed([t.cold_start for t in tables], "cold_start"),
                   spans=tuple((a, b, k, t) for (a, b, k), t in
                               _keyed([tuple(((a, b, k), t) for a, b, k, t in x.spans) for x in tables], "spans")))


def _mean_link(links: Sequence[LinkCost]) -> LinkCost:
    return LinkCost(*_columns([(x.bandwidth, x.latency, x.message_overhead, x.send_overhead) for x in links]))


def _mean_curve(curves: Sequence[AllReduceCurve]) -> AllReduceCurve:
    if any((c.ranks, c.nbytes) != (curves[0].ranks, curves[0].nbytes) for c in curves):
        raise PulseError(f"cannot average profiles: their all-reduce curves over {curves[0].ranks} ranks "
                         "were measured at different sizes")
    return AllReduceCurve(curves[0].ranks, curves[0].nbytes, _columns([c.seconds for c in curves]))


def mean_cluster(clusters: Sequence[Cluster]) -> Cluster:
    """Each measured link's figures, each all-reduce curve and the host's per-message and
    core-sharing figures averaged; the clusters must have measured the same links and groups."""
    first = clusters[0]
    if any(set(c.links) != set(first.links) or len(c.allreduce) != len(first.allreduce) for c in clusters):
        raise PulseError("cannot average profiles that measured different links or all-reduce groups")
    hardware = replace(first.hardware,
                       message_overhead=statistics.fmean(c.hardware.message_overhead for c in clusters),
                       core_sharing=statistics.fmean(c.hardware.core_sharing for c in clusters))
    return replace(first, hardware=hardware,
                   links={p: _mean_link([c.links[p] for c in clusters]) for p in first.links},
                   allreduce=tuple(_mean_curve(group) for group in zip(*(c.allreduce for c in clusters))),
                   source=f"mean of {len(clusters)} profiles: {first.source}")


def at_speed(table: CostTable, factor: float) -> CostTable:
    """The table's compute figures times ``factor``: the same job on a host ``factor`` times slower
    (a shared host whose speed an independent probe read that much lower than at the profile).
    Link figures are not here: emulated links sleep, and do not slow with the host."""
    def scaled(pairs: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
        return tuple((k, t * factor) for k, t in pairs)
    return replace(table, **{name: tuple(t * factor for t in getattr(table, name))
                             for name in ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer")},
                   encoder_fwd=scaled(table.encoder_fwd), per_action=scaled(table.per_action),
                   cold_start=scaled(table.cold_start), spans=tuple((a, b, k, t * factor) for a, b, k, t in table.spans))
