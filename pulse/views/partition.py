"""A partition as a picture: layers as bars coloured by device, skips as arcs.

::

    ╭──────────── skip (green: stays on its device, red: crosses) ───────────╮
    █ █ ▆ █ ▇ ▅ █ ...                                        bar height = fwd+bwd time
    dev 0 │ dev 1 │ dev 2 │ dev 3 │ dev 3 │ dev 2 │ ...      chunk boundaries
"""
from __future__ import annotations

from pathlib import Path

from pulse.costs import CostTable
from pulse.atomic_io import write_atomic_figure
from pulse.placement import Placement
from pulse.spec import ModelSpec

_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D",
            "#FF9DA6", "#BAB0AC", "#2F4B7C", "#A05195", "#D45087", "#665191", "#003F5C", "#F95D6A")


def draw_partition(spec: ModelSpec, placement: Placement, costs: CostTable, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Arc, Patch

    path = Path(path)
    device_of = [0] * spec.num_layers
    for chunk in placement.chunks:
        for layer in range(chunk.start, chunk.end):
            device_of[layer] = chunk.device
    times = [(costs.fwd[i] + costs.bwd[i]) * 1e3 for i in range(spec.num_layers)]
    fig = Figure(figsize=(max(8.0, spec.num_layers / 5), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = [_PALETTE[d % len(_PALETTE)] for d in device_of]
    ax.bar(range(spec.num_layers), times, color=colours, width=0.85)
    top = max(times) if times else 1.0
    for s, t, _edge in spec.skip_spans():
        local = device_of[s] == device_of[t]
        ax.add_patch(Arc(((s + t) / 2, top * 1.05), t - s, top * 0.9 * (t - s) / spec.num_layers + top * 0.1,
                         theta1=0, theta2=180, color="#2CA02C" if local else "#D62728", linewidth=1.0))
    for chunk in placement.chunks[1:]:
        ax.axvline(chunk.start - 0.5, color="#888888", linewidth=0.6, linestyle=":")
    ax.set_ylim(0, top * 2.1)
    ax.set_xlim(-1, spec.num_layers)
    ax.set_xlabel("layer (execution order)")
    ax.set_ylabel("fwd + bwd ms per microbatch")
    ax.set_title(f"{spec.name}: {placement.partitioner} {placement.kind} over {placement.num_devices} devices "
                 f"(green arc: skip stays local, red: crosses devices)", fontsize=9)
    used = sorted(set(device_of))
    ax.legend(handles=[Patch(color=_PALETTE[d % len(_PALETTE)], label=f"dev {d}") for d in used],
              fontsize=7, ncol=min(8, len(used)), loc="upper right", frameon=False)
    fig.tight_layout()
    write_atomic_figure(path, fig, dpi=110)  # a regular file in a folder that exists (atomic_io)
    return path
