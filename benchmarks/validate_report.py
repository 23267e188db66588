"""``benchmarks/validate.py``'s rows and what it writes: the console line of a row, the summary
and the tables of validate.md, validate.json.

Each row carries two predictions: on the group's profiles (each run on the mean of the two
profiles taken right around it, ``run_windows``), and the same at the host's speed while its runs ran
(``host_speed``: a probe beside every profile and every run, independent of what they measure).
The first is the simulator's error plus this shared host's drift; the second takes out what
the probe reads of the drift (about half of it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from measured_order import inversion_text

RESULTS = Path(__file__).resolve().parent / "results"
BALANCED = "Vbalanced+greedy"  # on the slowest link only: the compute-balanced V next to the link-aware one


@dataclass(frozen=True)
class Row:
    model: str
    pp: int
    link: str  # "free" or the emulated bytes/s
    config: str
    predicted_s: float
    measured_s: float
    error: float  # (predicted - measured) / measured
    spread: float | None  # (slowest - fastest run) / their mean: the measurement's own noise (None in old files)
    oversubscribed: bool  # more ranks than cores
    pipeline_bytes: int
    placement: str
    run: str = ""  # the commit whose code predicted and measured the row (``--keep`` mixes runs)
    repeats: int = 2  # real runs averaged: 2, and 2 more per round of a pair it was in that measured against its prediction
    samples: tuple[float, ...] = ()  # every measured step's seconds, run after run (empty in older files)
    # the host's speed around the runs against around the profiles (probe seconds, runs / profiles:
    # above 1 the host was slower while the runs ran), and the row predicted again at that speed
    host_slowdown: float | None = None
    predicted_at_host_speed_s: float | None = None
    error_at_host_speed: float | None = None


def rows_of(doc: dict) -> list[Row]:
    """The rows of a validate.json (older files lack the spread, the commit and the samples)."""
    return [Row(**{"spread": None, "run": doc.get("code", "earlier"), **r, "samples": tuple(r.get("samples", ()))})
            for r in doc["rows"]]


def format_row(r: Row) -> str:
    mark = " (ranks > cores)" if r.oversubscribed else ""
    spread = f"  run-to-run {r.spread:5.1%}" if r.spread is not None else ""
    spread += f" over {r.repeats} runs" if r.repeats != 2 else ""
    return (f"{r.model:<15} pp{r.pp} {r.link:>12} {r.config:<13} predicted {r.predicted_s * 1e3:8.1f} ms  "
            f"measured {r.measured_s * 1e3:8.1f} ms  error {r.error:+6.1%}{at_speed_text(r)}{spread}{mark}")


def at_speed_text(r: Row) -> str:
    if r.error_at_host_speed is None:
        return ""
    return f"  at host speed (x{r.host_slowdown:.2f}) {r.error_at_host_speed:+6.1%}"


def at_speed_cells(r: Row) -> str:
    if r.error_at_host_speed is None:
        return " | | "
    return f"x{r.host_slowdown:.3f} | {r.predicted_at_host_speed_s * 1e3:.1f} | {r.error_at_host_speed:+.1%}"


def percent(x: float | None) -> str:
    return "" if x is None else f"{x:.1%}"


def worst_error(rows: list[Row], at_host_speed: bool = False) -> float | None:
    errors = [abs(r.error_at_host_speed if at_host_speed else r.error) for r in rows
              if not at_host_speed or r.error_at_host_speed is not None]
    return max(errors, default=None)


def objectives(rows: list[Row]) -> list[dict]:
    """On the slowest link: the link-aware V against the compute-balanced V, measured."""
    out = []
    for b in (r for r in rows if r.config == BALANCED):
        v = next((r for r in rows if (r.model, r.pp, r.link, r.config) == (b.model, b.pp, b.link, "V+greedy")), None)
        if v is not None:
            out.append({"model": b.model, "pp": b.pp, "link": b.link, "link_aware_ms": v.measured_s * 1e3,
                        "balanced_ms": b.measured_s * 1e3, "link_aware_bytes": v.pipeline_bytes,
                        "balanced_bytes": b.pipeline_bytes, "same_placement": v.placement == b.placement})
    return out


def summary(rows: list[Row], ranks: list[dict]) -> list[str]:
    """Per model and P: how far predictions are from measurements, and whether rankings agree."""
    lines = ["| model | P | rows | median abs error | worst (free link) | worst (emulated links) | "
             "worst at host speed | rankings equal | pairs the runs order | tied pairs | order of means equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model in dict.fromkeys(r.model for r in rows):
        for pp in sorted({r.pp for r in rows if r.model == model}):
            mine = [r for r in rows if r.model == model and r.pp == pp]
            free = [abs(r.error) for r in mine if r.link == "free"]
            slow = [abs(r.error) for r in mine if r.link != "free"]
            groups = [g for g in ranks if g["model"] == model and g["pp"] == pp]
            mark = " (ranks > cores)" if mine[0].oversubscribed else ""
            lines.append(f"| {model} | {pp}{mark} | {len(mine)} | {statistics.median(abs(r.error) for r in mine):.1%} | "
                         f"{max(free, default=0):.1%} | {max(slow, default=0):.1%} | {percent(worst_error(mine, True))} | "
                         f"{sum(g['same'] for g in groups)}/{len(groups)} | "
                         f"{sum(g['pairs_ordered'] for g in groups)}/{sum(g['pairs'] for g in groups)} | "
                         f"{sum(i['verdict'] == 'tie' for g in groups for i in g['inversions'])} | "
                         f"{sum(g['same_order_of_means'] for g in groups)}/{len(groups)} |")
    return lines


def write_results(rows: list[Row], ranks: list[dict], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    codes = sorted({r.run for r in rows})
    doc = {"command": " ".join(sys.argv), "code": codes[0] if len(codes) == 1 else codes, "cores": os.cpu_count(),
           "steps": args.steps,
           "rows": [asdict(r) for r in rows], "rankings": ranks, "objectives": objectives(rows),
           "max_abs_error": worst_error(rows), "max_abs_error_at_host_speed": worst_error(rows, True)}
    (RESULTS / "validate.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = summary(rows, ranks) + ["", "| model | P | link | configuration | predicted ms | measured ms | error | "
                                        "host slower by | predicted at host speed ms | error at host speed | "
                                        "run-to-run | code |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- "
                                        "| --- | --- | --- |"]
    for r in rows:
        mark = " †" if r.oversubscribed else ""
        spread = f"{r.spread:.1%}" if r.spread is not None else ""
        spread += f" ({r.repeats} runs)" if r.repeats != 2 else ""
        lines.append(f"| {r.model} | {r.pp}{mark} | {r.link} | {r.config} | {r.predicted_s * 1e3:.1f} | "
                     f"{r.measured_s * 1e3:.1f} | {r.error:+.1%} | {at_speed_cells(r)} | {spread} | {r.run} |")
    lines += ["", "| model | P | link | predicted order | measured order | same | pairs measured against the "
                  "prediction (predicted gap; measured gap ± 95%: verdict) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for g in ranks:
        pairs = ", ".join(inversion_text(i) for i in g["inversions"])
        lines.append(f"| {g['model']} | {g['pp']} | {g['link']} | {' < '.join(g['predicted_order'])} | "
                     f"{' < '.join(g['measured_order'])} | {'yes' if g['same'] else 'no'} | {pairs} |")
    lines += ["", "| model | P | slowest link | link-aware V ms | balanced V ms | bytes/step link-aware | balanced |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for o in objectives(rows):
        lines.append(f"| {o['model']} | {o['pp']} | {o['link']} | {o['link_aware_ms']:.1f} | {o['balanced_ms']:.1f} | "
                     f"{o['link_aware_bytes']} | {o['balanced_bytes']}{' (same cuts)' if o['same_placement'] else ''} |")
    (RESULTS / "validate.md").write_text("\n".join(lines) + "\n")
