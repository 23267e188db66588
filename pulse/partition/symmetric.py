"""The PULSE partitioner: skip-aware DP with symmetric collocation (V and wave).

::

    V, P = 3           enc 0   enc 1   enc 2 | dec 2   dec 1   dec 0
                       dev 0   dev 1   dev 2 | dev 2   dev 1   dev 0
    wave, P = 2, k = 2 dev 0 1 1 0 | 0 1 1 0     (zigzag of placement.wave_devices)

Encoder chunk j and its mirror chunk 2kP-1-j share a device, and are cut so
that every skip starts and ends inside one pair (see ``cuts``): skips never
leave their device, only the main path crosses, plus each produced shared
input once into every device that has not held it yet (``traffic``).

Objectives, lexicographic with a slack:

1. balance: the least bottleneck, i.e. max over devices of fwd+bwd of all the
   device's chunks. For V (k = 1) a device holds one pair and the chain DP is
   exact (``chain``). With two folds a device sums two pairs; ``fold2`` walks
   the chain from both ends at once and is exact too (used up to
   ``fold2.MAX_CUTS`` valid cuts: SD v2 has 108). Beyond that, and for
   k >= 3, per-pair DPs give starting chains and a local search moves cuts to
   lower the max device load (``wave``): a local, not a proven, optimum. For
   two folds one start is the exact chain over the narrower spanning cuts
   (``cuts.spanning_cuts``: 62 of U-ViT's 146, 93 of Hunyuan-DiT's 210), so
   the result is never worse than the exact optimum over that subset.
2. communication: the least forward bytes per sample crossing devices, among
   chains whose bottleneck is within ``slack`` (default 2%) of the best one
   (ties: the least bottleneck). Lexicographic rather than a weighted sum
   because bytes and seconds have no exchange rate that holds across clusters
   and microbatch sizes, while "at most 2% slower" is a promise a user can
   read; ``slack=0`` still breaks exact ties by bytes. It matters on SD v2,
   where many cut points balance about equally while the tensors crossing
   them differ 2-16x between resolution levels: at P=4 the V moves 16.4 MB
   per sample (forward + backward) instead of 17.7 MB (78.2% instead of 76.5%
   less than sequential), and the two-fold wave at P=2 4.6 MB instead of
   18.4 MB, each within 2% of the best bottleneck.

Valid cuts keep every skip inside one encoder/decoder pair, including skips
wholly inside one chunk (``cuts``). Crossing skips can only stay local when
they share a pair; if no chain with enough pairs does that, ``strict=True``
(the default) refuses the model and ``strict=False`` plans around the
heaviest non-crossing subset of skips and sends the others directly
(reported in ``dropped_skips``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.chain import (INF, ChainProblem, build_problem, even_chain, k_best_chains, max_pairs,
                                   min_bytes_chain, min_max_chain)
from pulse.partition.crossing import affordable_count, all_cuts, crossing_problem, reindex
from pulse.partition.linkaware import link_aware_problem
from pulse.partition.common import boundary_loads, check_chunks, check_request, prefix_times
from pulse.partition.cuts import CutSet, Span, heaviest_nested_subset, spanning_cuts, valid_cuts
from pulse.partition.priced import PricedCuts, choose_priced, refine_v, scan_two_device_v
from pulse.partition.fold2 import MAX_CUTS, coarse_two_fold_chain, subset_two_fold_chain, two_fold_chain
from pulse.partition.wave import balance, chain_bytes, device_loads, trim_bytes
from pulse.placement import Placement, from_cuts, wave_devices
from pulse.spec import ModelSpec
from pulse.traffic import skips_leaving_device

DEFAULT_SLACK = 0.02  # bottleneck the communication pass may give up, relative
_ROUNDING = 1e-9  # relative: keeps the optimum itself under a zero-slack cap


@dataclass(frozen=True)
class SymmetricPlan:
    placement: Placement
    chain: tuple[Span, ...]  # the cuts (a_j, b_j), outermost first, last one terminal
    bottleneck: float  # seconds: max device load of the returned placement
    balanced_bottleneck: float  # seconds: best max device load found (exact for V)
    forward_bytes: int  # per sample crossing devices, with the communication pass
    balanced_bytes: int  # per sample of the balance-only chain (no communication pass)
    num_valid_cuts: int  # cut points usable in a chain (excluding the whole model)
    max_pairs: int  # the longest chain: at most max_pairs // folds devices
    dropped_skips: tuple[str, ...] = ()  # crossing skips sent directly (strict=False)
    priced: tuple[PricedCuts, ...] = ()  # with candidates: every cut set the simulator priced, chosen first


OBJECTIVES = ("time", "balance")


def plan_symmetric(spec: ModelSpec, costs: CostTable, num_devices: int, *, folds: int = 1,
                   slack: float = DEFAULT_SLACK, strict: bool = True, cluster: Cluster | None = None,
                   objective: str = "time", num_microbatches: int | None = None, candidates: int = 0,
                   memory_budget: int | None = None, crossing: int = 0) -> SymmetricPlan:
    """Plan a V (folds=1) or wave (folds=k) placement; see the module docstring.

    With a ``cluster`` and ``objective="time"`` the chain also minimises what the cuts
    cost on its links (``linkaware``); the balance chain and the link-aware one are then
    timed by the simulator (``num_microbatches``, default 2P) and the faster is kept.
    With ``candidates`` > 0 (and a cluster, either objective) the simulator prices more
    cut sets and picks among them (``priced``): the proxy's ``candidates`` best chains, the
    bytes pass's, the link-aware one and the analytic costs' chain. Without ``candidates`` (the
    tuner's path), a V that is not strict also has the ``crossing`` best chains over every cut
    (``crossing``: skips may leave their device) timed beside the two skip-local ones.
    """
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown partition objective '{objective}' (known: {', '.join(OBJECTIVES)})")
    label = "V placement" if folds == 1 else f"wave placement ({folds} folds)"
    check_request(spec, costs, num_devices, folds)
    if slack < 0:
        raise PlanError(f"slack must be >= 0, got {slack}")
    cutset, problem, dropped, narrow = _plannable_problem(spec, costs, num_devices, folds, strict)
    check_chunks(spec, num_devices, 2 * folds, label, most=max_pairs(problem) // folds)
    devices = wave_devices(num_devices, folds)[: folds * num_devices]  # device of pair j
    _, first = min_max_chain(problem, len(devices))
    if not first:
        raise _capacity_error(spec, cutset, problem, num_devices, folds, label)
    balanced, chain = _solve(problem, devices, num_devices, folds, first, slack, narrow)
    priced: tuple[PricedCuts, ...] = ()
    chosen = None  # (cut set, problem, chain, priced) of the simulator's pick
    num_mb = num_microbatches or 2 * num_devices
    if cluster is not None and objective == "time":
        timed = link_aware_problem(problem, cluster, costs.microbatch_size, num_devices)
        _, start = min_max_chain(timed, len(devices))
        candidate = _solve(timed, devices, num_devices, folds, start, slack, narrow)[1] if start else chain
        if candidates > 0:
            proposals = [("bytes pass", chain), ("link-aware", candidate)]
            chosen = _priced_choice(spec, costs, cluster, cutset, problem, timed, proposals, num_devices, folds,
                                    candidates, num_mb, memory_budget, strict, slack)
        elif folds == 1 and not strict and crossing > 0:
            chosen = _crossing_choice(spec, costs, cluster, cutset, [chain, candidate], crossing, num_devices,
                                      num_mb, slack)
        else:
            chain = faster_chain(spec, costs, cluster, cutset, [chain, candidate], num_devices, folds, num_mb)
    elif cluster is not None and candidates > 0:
        chosen = _priced_choice(spec, costs, cluster, cutset, problem, problem, [("bytes pass", chain)],
                                num_devices, folds, candidates, num_mb, memory_budget, strict, slack)
    best = float(device_loads(problem, balanced, devices, num_devices).max())
    balanced_bytes = int(chain_bytes(problem, balanced, devices))
    valid_count, most_pairs = len(cutset.cuts) - 1, max_pairs(problem)
    if chosen is not None:
        cutset, problem, chain, priced = chosen
    placement = chain_placement(cutset, chain, num_devices, folds)
    leaving = set(skips_leaving_device(spec, placement)) | set(dropped)  # given up, or off device by the cuts
    off_device = tuple(edge.key for edge in spec.skips if edge.key in leaving)
    return SymmetricPlan(
        placement=placement,
        chain=tuple(cutset.cuts[c] for c in chain),
        bottleneck=float(device_loads(problem, chain, devices, num_devices).max()),
        balanced_bottleneck=best,
        forward_bytes=int(chain_bytes(problem, chain, devices)) + _skip_bytes(spec, leaving - set(dropped)),
        balanced_bytes=balanced_bytes,
        num_valid_cuts=valid_count,
        max_pairs=most_pairs,
        dropped_skips=off_device,
        priced=priced,
    )


def _skip_bytes(spec: ModelSpec, keys: set[str]) -> int:
    """Forward bytes per sample of the skips ``keys``, each sent once (direct)."""
    return sum(edge.bytes for edge in spec.skips if edge.key in keys)


def _priced_choice(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet, problem: ChainProblem,
                   proxy: ChainProblem, proposals: list[tuple[str, list[int]]], num_devices: int, folds: int,
                   candidates: int, num_microbatches: int, memory_budget: int | None, strict: bool,
                   slack: float) -> tuple[CutSet, ChainProblem, list[int], tuple[PricedCuts, ...]]:
    """The fastest of ``proposals``, the proxy's best chains (V) and the analytic costs' chain, by
    simulation; not strict, a V also prices the best chains over every cut (``crossing``), so a
    skip may leave its device where that is faster. On measured costs a V on two devices also prices
    every pair of cuts (``scan_two_device_v``), and the fastest V is refined a boundary at a time
    (``refine_v``). Returns the cut set the chain indexes (the wider one when a chain from it won), its
    balance problem, the chain and every priced cut set."""
    proposals, prefix = list(proposals), prefix_times(costs)
    if folds == 1:
        best = diverse_best_chains(proxy, num_devices, candidates, prefix)
        proposals += [(f"proxy #{i + 1}", c) for i, c in enumerate(best)]
        proposals += _step_proxy_chains(spec, costs, cutset, num_devices, candidates, num_microbatches, prefix)
    if not costs.source.startswith("analytic"):  # what the cuts would be without the profile
        analytic = AnalyticProfiler(cluster.hardware).profile(spec, costs.microbatch_size)
        default = plan_symmetric(spec, analytic, num_devices, folds=folds, slack=slack, strict=strict,
                                 cluster=cluster, num_microbatches=num_microbatches)
        positions = {cut: i for i, cut in enumerate(cutset.cuts)}
        if all(cut in positions for cut in default.chain):  # a crossing chain is not in this cut set
            proposals.append(("analytic costs", [positions[cut] for cut in default.chain]))
    if folds == 1 and not strict:
        wide = all_cuts(spec)
        wide_problem = crossing_problem(spec, costs, wide)
        proposals = [(source, reindex(chain, cutset, wide)) for source, chain in proposals]
        count = affordable_count(wide_problem.size, max(1, candidates // 2))
        proposals += [(f"skips may cross #{i + 1}", c)
                      for i, c in enumerate(diverse_best_chains(wide_problem, num_devices, count, prefix))]
        proposals += [(f"{source}, skips may cross", c) for source, c in
                      _step_proxy_chains(spec, costs, wide, num_devices, count, num_microbatches, prefix)]
        cutset, problem = wide, wide_problem
    placement_of = lambda c: chain_placement(cutset, c, num_devices, folds)  # noqa: E731
    priced = choose_priced(spec, costs, cluster, cutset, proposals,  # the cut set the proposals index now
                           placement_of, num_microbatches, memory_budget)
    # the wider search where the costs were measured: on analytic (roofline) costs a few percent
    # between cuts is inside their error, and the proposals above are what they can tell apart
    searched = folds == 1 and not costs.source.startswith("analytic")
    scanned = scan_two_device_v(spec, costs, cluster, cutset, placement_of, num_microbatches,
                                memory_budget) if searched and num_devices == 2 else None
    if scanned is not None and scanned.step_seconds < priced[0].step_seconds:
        priced = [scanned, *priced]
    if searched and priced[0].step_seconds < INF:
        refined = refine_v(spec, costs, cluster, cutset, priced[0], placement_of, num_microbatches, memory_budget)
        priced = refined[-1:] + priced
    return cutset, problem, list(priced[0].chain), tuple(priced)


def _step_proxy_chains(spec: ModelSpec, costs: CostTable, cutset: CutSet, num_devices: int, count: int,
                       num_microbatches: int, prefix: list[float]) -> list[tuple[str, list[int]]]:
    """V chains balancing each device's whole step, not its pipeline work alone: every layer's time
    with its optimizer step's share per microbatch (``M (F + B) + O`` per device). The optimizer runs
    after the pipeline on every rank, so the slowest rank's adds to the step; cuts that balance F + B
    alike can differ 3x in it (SD v2 pp 2: 0.35 / 1.08 s against 0.52 / 0.92 s, a step 6% apart)."""
    if not costs.optimizer:
        return []
    share = [o / num_microbatches for o in costs.optimizer]
    stepped = replace(costs, fwd=tuple(f + s for f, s in zip(costs.fwd, share)))
    chains = diverse_best_chains(crossing_problem(spec, stepped, cutset), num_devices, max(1, count // 2), prefix)
    return [(f"step proxy #{i + 1}", c) for i, c in enumerate(chains)]


def _crossing_choice(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet, local: list[list[int]],
                     count: int, num_devices: int, num_microbatches: int,
                     slack: float) -> tuple[CutSet, ChainProblem, list[int], tuple[PricedCuts, ...]]:
    """The faster of the skip-local V chains ``local`` and chains over every cut, timed as ``faster_chain``
    times (greedy V 1F1B, the whole step): the tuner's cheap share of ``_priced_choice``, a few simulations a
    shape. The chains over every cut: the exact min-max one and, with ``count`` > 1, the least main-path bytes
    within ``slack`` of it (the bytes pass's rule), not the k-best DP's (about 50 times the work over SD v2's
    1,082 cuts). A crossing chain wins only where the simulator prices it faster, so on a slow link the
    skip-local chain stays."""
    wide = all_cuts(spec)
    problem = crossing_problem(spec, costs, wide)
    proposals = [reindex(c, cutset, wide) for c in local]
    devices = wave_devices(num_devices, 1)[:num_devices]
    local_best = min(float(device_loads(problem, c, devices, num_devices).max()) for c in proposals)
    best, balanced = min_max_chain(problem, num_devices)
    # a crossing chain only adds messages: it can win only where it balances better, so it is timed only then
    if balanced and best < local_best * (1 - _ROUNDING):
        proposals.append(balanced)
        if count > 1:
            cap = best * (1 + slack) * (1 + _ROUNDING)
            proposals.append(min_bytes_chain(problem, devices, cap)[1])
    # with crossing chains, all timed on at most 2P microbatches: the chains differ in balance and bytes,
    # which a pipeline's steady state shows within that (`pulse plan`'s default), at a fraction of a long
    # step's simulation; without, the skip-local chains as before (``faster_chain`` on the whole step)
    timed = min(num_microbatches, 2 * num_devices) if len(proposals) > len(local) else num_microbatches
    chain = faster_chain(spec, costs, cluster, wide, [c for c in proposals if c], num_devices, 1, timed)
    return wide, problem, chain, ()


def diverse_best_chains(problem: ChainProblem, pairs: int, count: int, prefix: list[float]) -> list[list[int]]:
    """The ``count`` best chains by the proxy whose chunks' times differ (``prefix``: layer-time
    prefix sums): chains that only move a zero-time layer across a cut tie exactly and would be
    priced alike. Chunk times, not pair times: two chains with equal pair loads can still fill the
    pipeline differently (a heavy layer first or last on its device); the fold's pair by its total."""
    seen, out = set(), []
    for _, chain in k_best_chains(problem, pairs, 4 * count):
        a, b = problem.a[chain], problem.b[chain]
        outer = [(prefix[a[j + 1]] - prefix[a[j]], prefix[b[j]] - prefix[b[j + 1]]) for j in range(len(chain) - 2)]
        tip = prefix[b[-2]] - prefix[a[-2]]  # the V's fold: its two chunks run back to back on one device
        times = tuple(round(t, 12) for t in (*(t for pair in outer for t in pair), tip))
        if times not in seen:
            seen.add(times)
            out.append(chain)
        if len(out) == count:
            break
    return out


def chain_placement(cutset: CutSet, chain: list[int], num_devices: int, folds: int) -> Placement:
    return cuts_placement([cutset.cuts[c] for c in chain], num_devices, folds)


def cuts_placement(cuts: Sequence[Span], num_devices: int, folds: int) -> Placement:
    """The V (folds 1) or wave placement of a chain of cuts, outermost first (``PricedCuts.cuts``)."""
    order = [a for a, _ in cuts] + [b for _, b in reversed(cuts[:-1])]
    return from_cuts("v" if folds == 1 else "wave", order, wave_devices(num_devices, folds),
                     num_devices, "direct", "pulse")


def faster_chain(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet, chains: list[list[int]],
                 num_devices: int, folds: int, num_microbatches: int) -> list[int]:
    """The chain whose placement the simulator times fastest: the whole step (greedy V 1F1B, the
    runtime's program, then the optimizer and the step's all-reduces), not the pipeline's makespan
    alone, since the chains put different optimizer work on the slowest rank."""
    from pulse.schedule.generators import OnLinks, greedy_v_1f1b
    from pulse.sim.engine import simulate
    from pulse.sim.step import step_time

    def step(chain: list[int]) -> float:
        placement = chain_placement(cutset, chain, num_devices, folds)
        try:
            schedule = greedy_v_1f1b(placement, num_microbatches, costs, links=OnLinks(spec, cluster))
            result = simulate(spec, placement, schedule, costs, cluster)
            return step_time(spec, placement, costs, cluster, result).total
        except PlanError:  # e.g. a cluster smaller than the plan: fall back to the first chain
            return INF
    distinct = [list(c) for c in dict.fromkeys(map(tuple, chains))]  # often both DPs cut alike: price once
    return distinct[0] if len(distinct) == 1 else min(distinct, key=step)


def _solve(problem: ChainProblem, devices: list[int], num_devices: int, folds: int,
           first: list[int], slack: float, narrow: list[int]) -> tuple[list[int], list[int]]:
    """(balance-only chain, final chain): exact DPs for V and two folds, local search beyond.

    Two folds with too many cuts for the exact DP also start from the exact chain over
    ``narrow`` (``cuts.spanning_cuts``) when that subset is small enough."""
    exact_narrow = folds == 2 and problem.size > MAX_CUTS and len(narrow) <= MAX_CUTS
    exact_two = folds == 2 and problem.size <= MAX_CUTS
    if folds == 1:
        balanced = first  # the V DP is exact already
    elif exact_two:  # the V chain's loads on the wave's devices bound the least max: the DP drops what exceeds it
        balanced = two_fold_chain(problem, num_devices,
                                  upper=float(device_loads(problem, first, devices, num_devices).max()))
    else:  # local search from two starting chains; keep the better (max load, sum of squares)
        starts = [first, even_chain(problem, len(devices))]
        if folds == 2:  # too many cuts for the exact DP: also start from a thinned exact one
            starts.append(coarse_two_fold_chain(problem, num_devices))
        if exact_narrow:
            starts.append(subset_two_fold_chain(problem, narrow, num_devices))
        starts = [c for c in starts if c]
        balanced = min((balance(problem, c, devices, num_devices) for c in starts),
                       key=lambda c: _load_key(problem, c, devices, num_devices))
    best = float(device_loads(problem, balanced, devices, num_devices).max())
    cap = best * (1 + slack) * (1 + _ROUNDING)
    if folds == 1:
        return balanced, min_bytes_chain(problem, devices, cap)[1]
    if exact_two:
        return balanced, two_fold_chain(problem, num_devices, cap)
    trimmed = trim_bytes(problem, balanced, devices, num_devices, cap)
    if exact_narrow:  # the narrow exact bytes pass may beat the local one under the same cap
        other = subset_two_fold_chain(problem, narrow, num_devices, cap)
        if other and chain_bytes(problem, other, devices) < chain_bytes(problem, trimmed, devices):
            return balanced, other
    return balanced, trimmed


def _load_key(problem: ChainProblem, chain: list[int], devices: list[int], num_devices: int):
    loads = device_loads(problem, chain, devices, num_devices)
    return float(loads.max()), float((loads ** 2).sum())


def pulse_placement(spec: ModelSpec, costs: CostTable, num_devices: int, *, folds: int = 1,
                    cluster: Cluster | None = None) -> Placement:
    """Registry entry: the strict plan with the default slack, link-aware when a cluster is given."""
    return plan_symmetric(spec, costs, num_devices, folds=folds, cluster=cluster).placement


def _plannable_problem(spec: ModelSpec, costs: CostTable, num_devices: int, folds: int,
                       strict: bool) -> tuple[CutSet, ChainProblem, tuple[str, ...], list[int]]:
    """Cuts keeping every skip local, the keys of skips given up to make room, and the
    indices of the narrower spanning cuts (``cuts.spanning_cuts``).

    Crossing skips can still share a pair (e.g. both inside one chunk), so all
    skips are tried first; only if that leaves too few pairs for the devices
    are crossing skips a problem: refused when strict, else the heaviest
    non-crossing subset is kept and the others are sent directly.
    """
    spans = spec.skip_spans()
    everything = [(s, t) for s, t, _ in spans]
    cutset, problem = _problem(spec, costs, everything)
    crossing = spec.crossing_pairs()
    if not crossing or max_pairs(problem) >= folds * num_devices:
        return cutset, problem, (), spanning_cuts(cutset, everything)
    if strict:
        e1, e2 = crossing[0]
        raise PlanError(
            f"{spec.name}: skip {e1.key} crosses {e2.key} ({len(crossing)} crossing pair(s)), and no "
            f"{'V' if folds == 1 else 'wave'} over {num_devices} devices keeps both on one device; plan "
            "with strict=False to send crossing skips directly, or use the sequential partitioner")
    keep = set(heaviest_nested_subset(everything, [e.bytes for _, _, e in spans]))
    kept = [span for i, span in enumerate(everything) if i in keep]
    cutset, problem = _problem(spec, costs, kept)
    return (cutset, problem, tuple(e.key for i, (_, _, e) in enumerate(spans) if i not in keep),
            spanning_cuts(cutset, kept))


def _problem(spec: ModelSpec, costs: CostTable, spans: list[Span]) -> tuple[CutSet, ChainProblem]:
    cutset = valid_cuts(spec.num_layers, spans)
    loads = boundary_loads(spec, relay=False)
    return cutset, build_problem(cutset, prefix_times(costs), [load.main + load.skip for load in loads],
                                 [load.shared for load in loads])


def _capacity_error(spec: ModelSpec, cutset: CutSet, problem: ChainProblem, num_devices: int,
                    folds: int, label: str) -> PlanError:
    most = max_pairs(problem)
    devices = most // folds
    advice = f"use --pp <= {devices}" if devices else "use fewer folds"
    return PlanError(
        f"{spec.name} has only {len(cutset.cuts) - 1} valid cut points ({most} nested encoder/decoder "
        f"pairs): at most {devices} devices with {label}, asked for {num_devices}; "
        f"{advice} or the sequential partitioner")
