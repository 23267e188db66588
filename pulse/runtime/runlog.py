"""What a training run leaves behind: ``log.json`` (per-step numbers) and ``loss.png``.

::

    log.json = {"run": {plan, degrees, schedule, seed, ...},      rewritten every 10 s, at checkpoints and at
                                                                 the end (atomically: run_outputs.StepLog);
                                                                 a resumed run keeps the earlier steps
                "summary": {first/last loss, median step seconds, samples/s, bytes per step},
                "steps": [{step, loss, seconds, samples_per_s, pipeline_bytes, allreduce_bytes, grad_norm,
                           lr, skipped, loss_scale}]}
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

from pulse.atomic_io import write_atomic


@dataclass(frozen=True)
class StepRecord:
    """One training step as every launcher logs it (log.json rows)."""

    step: int
    loss: float  # mean over every microbatch of every replica
    seconds: float  # wall clock, all ranks synchronised at the end
    samples_per_s: float
    pipeline_bytes: int  # point-to-point payload bytes, all ranks
    allreduce_bytes: int  # gradient all-reduce input bytes, all ranks
    grad_norm: float | None
    lr: float | None = None  # the learning rate this step trained with
    skipped: bool = False  # fp16: gradients overflowed, the optimizer step was skipped
    loss_scale: float | None = None  # fp16: the scale this step's gradients were computed under


def summarize(run: dict, steps: Sequence[dict]) -> dict:
    """Medians skip step 0 when there are more (it pays for lazy set-up: optimizer state, caches)."""
    timed = steps[1:] if len(steps) > 1 else steps
    median = statistics.median(s["seconds"] for s in timed)
    window = max(1, min(5, len(steps) // 4))  # average a few steps: single losses are noisy
    return {
        "schedule": run.get("schedule"),
        "first_loss": statistics.fmean(s["loss"] for s in steps[:window]),
        "last_loss": statistics.fmean(s["loss"] for s in steps[-window:]),
        "loss_window": window,
        "median_step_seconds": median,
        "samples_per_s": run["global_batch"] / median,
        "pipeline_bytes_per_step": statistics.median(s["pipeline_bytes"] for s in timed),
        "allreduce_bytes_per_step": statistics.median(s["allreduce_bytes"] for s in timed),
        "total_seconds": sum(s["seconds"] for s in steps),
        "skipped_steps": sum(1 for s in steps if s.get("skipped")),
    }


def write_log(path: Path, run: dict, steps: Sequence[dict]) -> dict:
    """Write the log; return its summary."""
    summary = summarize(run, steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"run": run, "summary": summary, "steps": list(steps)}, indent=1) + "\n")
    return summary


def read_history(path: Path, before: int) -> list[dict]:
    """The steps (< ``before``) an earlier run wrote to ``path``: a resumed run's log keeps them.

    A missing or unreadable log gives none (the new log then starts at the resumed step).
    """
    try:
        steps = json.loads(Path(path).read_text())["steps"]
        return [s for s in steps if isinstance(s, dict) and isinstance(s.get("step"), int) and s["step"] < before]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_loss_plot(path: Path, records: Sequence[Any], title: str) -> None:
    """The loss curve (per step, and a running mean) as a PNG; matplotlib without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    losses = [r.loss for r in records]
    running = [statistics.fmean(losses[max(0, i - 4):i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, marker=".", lw=1, alpha=0.6, label="loss (mean over microbatches)")
    ax.plot(steps, running, lw=2, label="running mean (5 steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("epsilon-prediction MSE")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
