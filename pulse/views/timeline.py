"""Gantt chart of a simulated iteration (PNG), one row per device::

    dev 0  [0][1][2]      [0][0][1]...▼    F blue, B red, W green, E (a frozen encoder) amber, mb in the bar;
           ▁▁▂▂▃▃▃▃▃▃▂▂▁▁                  ▼ a chunk's gradient bucket launched (AR)
                                           thin strip: skip-cache bytes over time
FREE actions are not drawn: the strip shows the memory they release.

matplotlib is imported here only, through its Agg canvas (no display, no
global pyplot state), so the core stays importable without it.
"""
from __future__ import annotations

from pathlib import Path

from pulse.atomic_io import write_atomic_figure
from pulse.placement import Placement
from pulse.sim.result import SimResult

COLOURS = {"F": "#4C78A8", "B": "#E45756", "W": "#54A24B", "E": "#F2A93B"}
LABELS = {"E": "E (frozen encoder)"}
AR_COLOUR = "#333333"
_ROW = 1.0  # height of a device's compute row
_STRIP = 0.35  # height of its skip-cache strip
_PITCH = _ROW + _STRIP + 0.35


def _draw_compute(ax, result: SimResult, scale: float) -> None:
    for d in range(result.num_devices):
        y = -d * _PITCH
        for kind, colour in COLOURS.items():
            spans = [s for s in result.compute if s.device == d and s.kind == kind]
            if spans:
                ax.broken_barh([(s.start * scale, (s.end - s.start) * scale) for s in spans],
                               (y, _ROW), facecolors=colour, edgecolor="white", linewidth=0.4)
    for s in result.compute:
        if s.end > s.start:
            ax.text((s.start + s.end) / 2 * scale, -s.device * _PITCH + _ROW / 2, str(s.microbatch),
                    ha="center", va="center", fontsize=6, color="white", clip_on=True)


def _draw_all_reduces(ax, result: SimResult, scale: float) -> None:
    marks = [m for m in result.marks if m.kind == "AR"]
    if marks:
        ax.scatter([m.time * scale for m in marks], [-m.device * _PITCH + _ROW + 0.12 for m in marks],
                   marker="v", s=14, color=AR_COLOUR, zorder=3, clip_on=False)


def _draw_skip_cache(ax, result: SimResult, scale: float) -> None:
    top = max(result.peak_skip_cache, default=0) or 1
    for d, curve in enumerate(result.skip_cache_curve):
        base = -d * _PITCH - _STRIP - 0.05
        times = [0.0] + [t * scale for t, _ in curve] + [result.makespan * scale]
        levels = [0] + [b for _, b in curve] + [curve[-1][1] if curve else 0]
        heights = [base + _STRIP * b / top for b in levels]
        ax.fill_between(times, base, heights, step="post", color="#B279A2", alpha=0.7, linewidth=0)
        ax.axhline(base, color="#cccccc", linewidth=0.4)


def draw_timeline(result: SimResult, placement: Placement, path: str | Path, title: str = "") -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    scale = 1e3  # seconds -> ms on the axis
    fig = Figure(figsize=(max(8.0, min(24.0, len(result.compute) / 12)), 1.0 + 0.7 * result.num_devices))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_compute(ax, result, scale)
    _draw_all_reduces(ax, result, scale)
    _draw_skip_cache(ax, result, scale)
    ax.set_yticks([-d * _PITCH + _ROW / 2 for d in range(result.num_devices)])
    ax.set_yticklabels([f"dev {d} ({len(placement.chunks_of(d))} ch)" for d in range(result.num_devices)])
    ax.set_xlim(0, result.makespan * scale or 1)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or result.summary(), fontsize=9)
    handles = [Patch(color=c, label=LABELS.get(k, k)) for k, c in COLOURS.items()
               if any(s.kind == k for s in result.compute)]
    if any(m.kind == "AR" for m in result.marks):
        handles.append(Patch(color=AR_COLOUR, label="AR (bucket launch)"))
    handles.append(Patch(color="#B279A2", label="skip cache"))
    fig.legend(handles=handles, loc="lower center", fontsize=7, ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    write_atomic_figure(path, fig, dpi=120, bbox_inches="tight")  # a regular file in a folder that exists
    return path
