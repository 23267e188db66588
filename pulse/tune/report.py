"""Tables for the tuner's answer."""
from __future__ import annotations

from pulse.sim.breakdown import PARTS
from pulse.tune.evaluate import Evaluation
from pulse.tune.space import chunk_ranges
from pulse.tune.tuner import TuneResult

BASELINE_STRATEGIES = ("data-parallel", "sequential", "diffusionpipe")
HEADER = (f"{'#':>3} {'strategy':<19}{'PP':>3}{'DP':>4}{'mbs':>4}{'M':>5} {'shape':<6}{'schedule':<19}"
          f"{'recompute':<10}{'iter ms':>9}{'samples/s':>10}{'peak GiB':>9}{'GB/iter':>9}{'bubble':>8}")


def row(rank: int | str, e: Evaluation) -> str:
    c = e.candidate
    folds = c.shape
    schedule = c.schedule if c.inflight_cap is None else f"{c.schedule}/{c.inflight_cap}"
    return (f"{rank:>3} {c.strategy:<19}{c.pp:>3}{c.dp:>4}{c.microbatch_size:>4}{c.num_microbatches:>5} "
            f"{folds:<6}{schedule:<19}{_recompute_cell(e):<10}"
            f"{e.iteration_time * 1e3:>9.1f}{e.samples_per_s:>10.1f}"
            f"{e.peak_memory / 2**30:>9.2f}{e.bytes_per_iteration / 1e9:>9.2f}{e.bubble_ratio:>8.1%}")


def _recompute_cell(e: Evaluation) -> str:
    """Which chunks recompute: -, all, or their indices."""
    chunks = e.candidate.recompute
    if not chunks:
        return "-"
    return "all" if e.placement is not None and len(chunks) == len(e.placement.chunks) else chunk_ranges(chunks)


def format_result(result: TuneResult, top: int = 10) -> str:
    skipped = f", {result.skipped} not simulated: their lower bound cannot change this answer" if result.skipped else ""
    lines = [f"top {min(top, len(result.ranked))} of {len(result.ranked)} configurations that fit "
             f"({len(result.rejected)} over the memory budget, {len(result.unbuildable)} not buildable{skipped}), "
             f"searched in {result.seconds:.1f} s", HEADER]
    lines += [row(i + 1, e) for i, e in enumerate(result.ranked[:top])]
    if result.rejected:
        best = result.rejected[0]
        lines.append(f"fastest rejected: {best.candidate.label} at {best.samples_per_s:.1f} samples/s: {best.reason}")
    lines.append("")
    lines.append("best of each strategy under the same devices, batch and memory budget:")
    lines.append(HEADER.replace("  #", "   ") + f"{'pulse speedup':>15}")
    pulse = result.best_by_strategy.get("pulse")
    for strategy in ("pulse",) + BASELINE_STRATEGIES:
        e = result.best_by_strategy.get(strategy)
        if e is None:
            lines.append(f"    {strategy:<19}(no configuration fits)")
            continue
        speedup = "" if strategy == "pulse" or pulse is None else f"{pulse.samples_per_s / e.samples_per_s:>14.2f}x"
        lines.append(row("", e) + f"{speedup:>15}")
    fitted = [f"{s} {e.fitted.spec.num_layers}" for s in ("pulse",) + BASELINE_STRATEGIES
              if (e := result.best_by_strategy.get(s)) is not None and e.fitted is not None]
    if fitted:
        lines.append(f"priced on finer layers only where their cuts fall (layers): {', '.join(fitted)}")
    strongest = result.strongest_baseline
    if pulse is not None and strongest is not None:
        lines.append(f"pulse vs the strongest baseline ({strongest.candidate.label}): "
                     f"{result.speedup_over_strongest():.2f}x")
    lines += breakdown_lines(result)
    if len(result.best_by_encoders) > 1:
        lines.append("")
        lines.append("best with the frozen encoders cached offline, before the pipeline, in its bubbles:")
        for mode, e in sorted(result.best_by_encoders.items(), key=lambda kv: -kv[1].samples_per_s):
            lines.append(f"    {mode:<8} {e.candidate.label}: {e.iteration_time * 1e3:.1f} ms, "
                         f"{e.samples_per_s:.1f} samples/s")
    winner = result.winner
    lines.append("")
    lines.append(f"winner: {winner.candidate.label}: {winner.samples_per_s:.1f} samples/s "
                 f"({winner.iteration_time * 1e3:.1f} ms per iteration)")
    return "\n".join(lines)


def breakdown_lines(result: TuneResult) -> list[str]:
    """Where each strategy's best step goes (``pulse.sim.breakdown``): the parts sum to the step."""
    rows = [(s, e) for s in ("pulse",) + BASELINE_STRATEGIES
            if (e := result.best_by_strategy.get(s)) is not None and e.breakdown is not None]
    if not rows:
        return []
    head = f"    {'strategy':<19}{'step ms':>9}" + "".join(f"{name.replace('_', ' '):>19}" for name in PARTS)
    lines = ["", "where each best step goes (ms; the parts sum to the step, pulse.sim.breakdown):", head]
    for strategy, e in rows:
        cells = "".join(f"{seconds * 1e3:>19.1f}" for seconds in e.breakdown.parts().values())
        lines.append(f"    {strategy:<19}{e.iteration_time * 1e3:>9.1f}{cells}")
    return lines
