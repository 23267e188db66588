"""What a training run leaves behind: ``log.json`` (per-step numbers) and ``loss.png``.

::

    log.json = {"run": {plan, degrees, schedule, seed, ...},      rewritten every 10 s, at checkpoints and at
                                                                 the end (atomically: run_outputs.StepLog);
                                                                 a resumed run keeps the earlier steps
                "summary": {first/last loss, median step seconds, samples/s, bytes per step},
                "steps": [{step, loss, seconds, samples_per_s, pipeline_bytes, allreduce_bytes, grad_norm,
                           lr, skipped, loss_scale, peak_memory_bytes (per rank), val_loss,
                           resident_memory_bytes (per rank, a CPU's)}]}
    summary["memory"]: per rank {rank, device, peak_bytes, predicted_peak_bytes, and on a CPU
                       resident_peak_bytes, or peak_is_resident where the peak is the resident set}
                       (None where nothing measured)
    summary["skipped_samples"]: how many bad --images samples were left out (run["skipped_samples"] names them)
    summary["sample_failures"]: [{step, error}] per --sample-every sample that failed (empty: none did);
                                written the moment one fails, not only at the next rewrite

"steps" comes last, one row a line: between rewrites each step's row is appended in place
(``append_steps``), so the log holds every finished step whenever the run stops; the summary is
as of the last rewrite.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

from pulse.atomic_io import write_atomic, write_atomic_figure
from pulse.errors import PulseError
from pulse.layout import Layout


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
    # per global rank, the most bytes its tensors held on its device so far (a CPU: its allocations, sampled
    # after every action; None where nothing counts them)
    peak_memory_bytes: tuple[int, ...] | None = None
    # --validation-split: the held-out samples' loss after this step, at fixed timesteps and noise (None: not
    # measured at this step; pulse.train.validation)
    val_loss: float | None = None
    # a CPU: per global rank, its resident peak so far above its baseline (with the free memory its heap kept)
    resident_memory_bytes: tuple[int, ...] | None = None


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
        "skipped_samples": len(run.get("skipped_samples") or []),  # --bad-samples skip: left out before launch
        "memory": device_memory(run, steps),
    }


def device_memory(run: dict, steps: Sequence[dict]) -> list[dict] | None:
    """Per global rank: its pipeline device (rank = replica * pp + device: ``pulse.layout``), the most
    bytes it held on its device over the run (measured; a CPU's allocations), the simulator's peak for
    that device (the plan's ``peak_memory_bytes_per_device``; a plan written before that field: its worst
    device's), and on a CPU its resident peak beside them. None when no step measured."""
    measured = [s["peak_memory_bytes"] for s in steps if s.get("peak_memory_bytes")]
    if not measured:
        return None
    resident = [s["resident_memory_bytes"] for s in steps if s.get("resident_memory_bytes")]
    # on a CPU without a second list the peak is the resident set itself: the runtime's allocations cannot be
    # counted (MindSpore's pool, or no glibc), and the set holds the pages its pool keeps free
    resident_alone = not resident and str(run.get("device", "")).lower() == "cpu"
    predicted = run.get("predicted") or {}
    per_device = predicted.get("peak_memory_bytes_per_device")
    out = []
    for rank in range(len(measured[-1])):
        device = Layout(run["pp"], run["dp"], rank).stage
        guess = per_device[device] if per_device and device < len(per_device) else predicted.get("peak_memory_bytes")
        row = {"rank": rank, "device": device, "peak_bytes": max(m[rank] for m in measured),
               "predicted_peak_bytes": guess}
        if resident:
            row["resident_peak_bytes"] = max(r[rank] for r in resident)
        if resident_alone:
            row["peak_is_resident"] = True
        out.append(row)
    return out


_TAIL = b"\n]}\n"  # what ends log.json: an appended row goes just before it


def write_log(path: Path, run: dict, steps: Sequence[dict], sample_failures: Sequence[dict] = ()) -> dict:
    """Write the log (atomically, the whole of it); return its summary."""
    summary = {**summarize(run, steps), "sample_failures": list(sample_failures)}
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f'{{"run": {json.dumps(run, indent=1)},\n"summary": {json.dumps(summary, indent=1)},\n"steps": [\n'
    write_atomic(path, head + ",\n".join(json.dumps(s) for s in steps) + _TAIL.decode())
    return summary


def append_steps(path: Path, steps: Sequence[dict], size: int) -> int | None:
    """Add ``steps`` to the log ``write_log`` (and this) left at ``size`` bytes, in place; its new size.

    One ``pwrite`` over the closing bracket: a process killed at any moment leaves the log before
    or after it, whole (the kernel finishes a write call). None when the file is not the one
    expected (replaced, another size, a link): the caller rewrites it whole. A failed write (a full
    disk) puts the old ending back and is one line.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size or os.pread(fd, len(_TAIL), size - len(_TAIL)) != _TAIL:
            return None
        data = "".join(f",\n{json.dumps(s)}" for s in steps).encode() + _TAIL
        at = size - len(_TAIL)
        try:
            if os.pwrite(fd, data, at) != len(data):
                raise OSError(28, "short write (disk full?)")
        except OSError as exc:
            os.pwrite(fd, _TAIL, at)
            os.ftruncate(fd, size)
            raise PulseError(f"{path}: cannot add the step to the log ({exc.strerror or exc}); the steps "
                             "before it are kept") from None
        return at + len(data)
    finally:
        os.close(fd)


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
    try:
        write_atomic_figure(path, fig)  # into the run folder; never through a link
    finally:
        plt.close(fig)
