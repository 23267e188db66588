"""What a training run leaves in its folder, the same for every backend.

::

    OUT_DIR/log.json     rank 0 appends each step, rewrites it every 10 s, at checkpoints and at the end (StepLog;
                         a resumed run keeps the earlier steps)
    OUT_DIR/loss.png     at the end
    --trace FILE         every rank writes FILE.rank-<r>.json; rank 0 merges them into FILE

and the rank entries' one rule for failures: bad input is one line and exit
code 2 (said once by rank 0 when every rank would say it), a peer that died or
timed out is one line per surviving rank and exit code 1, a failed allocation one line from
its rank with the plan's prediction and exit code 2 (``out_of_memory``). A ``--sample-every``
sample that fails ends nothing: a warning line and a record in log.json
(``guard_samples``), so samples never stop in silence.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from pulse.errors import PulseError
from pulse.plan import Plan
from pulse.runtime.errors import CommTimeout
from pulse.train.loop import NonFiniteLoss
from pulse.train.run_config import RunConfig
from pulse.train.tensorboard import TensorBoardLog
from pulse.train.runlog import StepRecord, append_steps, read_history, write_log, write_loss_plot
from pulse.views.trace import write_measured_trace
from pulse.atomic_io import write_atomic


def out_dir_of(config: RunConfig, plan_path: str | Path) -> Path:
    return Path(config.out_dir) if config.out_dir else Path(plan_path).parent


def bad_samples_info(config: RunConfig) -> dict:
    """--images: how bad samples are handled and which ones `pulse train` left out (the summary counts them)."""
    if config.images is None:
        return {}
    return {"bad_samples": config.bad_samples, "skipped_samples": list(config.skipped_samples or [])}


def run_info(plan: Plan, plan_path: str | Path, config: RunConfig, data_name: str,
             extra: Mapping[str, Any]) -> dict:
    """log.json's "run" block: the plan's shape, the settings, and what the backend adds (device, group,
    the noise schedule it resolved: ``pulse.data.scheduler_config.noise_info``)."""
    return {"plan": str(plan_path), "model": plan.model, "pp": plan.pp, "dp": plan.dp,
            "world_size": plan.world_size, "partitioner": plan.partitioner, "placement": plan.placement.kind,
            "schedule": plan.schedule.name if plan.schedule else None,
            "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
            "global_batch": plan.global_batch, "steps": config.steps, "seed": config.seed, "lr": config.lr,
            "clip": config.clip, "precision": config.precision, "beta_schedule": config.beta_schedule,
            "data": data_name, "emulate_bandwidth": config.emulate_bandwidth, **bad_samples_info(config), **extra,
            "predicted": dict(plan.predicted)}


class StepLog:
    """Rank 0's log.json: every step's row appended in place (``runlog.append_steps``: one small
    write), the whole file rewritten after the first step, then at most every ``every`` seconds, and
    whenever the loop says the records must reach disk (a checkpoint's step, the last step, a failure).

    Why not rewrite after every step: a rewrite is the whole history, serialized and fsynced twice,
    on the pipeline's first rank, between two steps, while the other ranks wait for its first
    forward; and it grows with the run. An append costs one row. So a SIGTERM or kill -9 leaves
    every finished step in the log (the summary as of the last rewrite), and once rewrites grow
    slow the interval grows too, so that they never take more than ``1 / SLOWER`` of the time.
    """

    EVERY = 10.0  # seconds between rewrites, at least
    SLOWER = 100  # a rewrite waits at least 100x its own last duration

    def __init__(self, path: Path, info: dict, history: Sequence[dict] = (), report_to: str | None = None,
                 every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.info, self.history = path, info, list(history)
        self.every, self.clock = every, clock
        self.written_at: float | None = None
        self.write_seconds = 0.0
        self.records: Sequence[StepRecord] = ()
        self.size: int | None = None  # log.json's bytes after the last write, and the records it holds
        self.logged = 0
        self.sample_failures: list[dict] = []  # {step, error}: summary["sample_failures"]
        # --report-to tensorboard: the same records as event files too
        self.board = TensorBoardLog(path.parent) if report_to == "tensorboard" else None

    def __call__(self, records: Sequence[StepRecord], now: bool = False) -> None:
        """The records so far; rewritten when ``now`` or when the interval has passed, else appended."""
        self.records = records
        if self.board is not None:
            self.board(records)
        if now or self.written_at is None or self.size is None or \
                self.clock() - self.written_at >= max(self.every, self.SLOWER * self.write_seconds):
            self.flush()
        elif len(records) > self.logged:
            size = append_steps(self.path, [asdict(r) for r in records[self.logged:]], self.size)
            if size is None:  # not the file this wrote (removed, replaced): write it whole again
                self.flush()
            else:
                self.size, self.logged = size, len(records)

    def flush(self) -> dict:
        """Write every record now; the summary."""
        began = self.clock()
        summary = write_log(self.path, self.info, [*self.history, *(asdict(r) for r in self.records)],
                            self.sample_failures)
        self.size, self.logged = self.path.stat().st_size, len(self.records)
        self.written_at = self.clock()
        self.write_seconds = self.written_at - began
        return summary

    def sample_failed(self, step: int, error: str) -> None:
        """A sample of ``step`` failed: in log.json now (a run killed before the next rewrite still says it)."""
        self.sample_failures.append({"step": step, "error": error})
        if self.records:  # the log is written once a step is: before that there is nothing to add it to
            self.flush()


class SampleFailed(Exception):
    """A backend's sample hook failed; the message is the cause, one line (``guard_samples`` says it)."""


def guard_samples(sample: Callable[[int], Sequence[Path] | None], log: StepLog | None) -> Callable[[int], None]:
    """``sample`` whose failure is a warning line on stderr and a record in ``log``'s log.json, never the
    run's end: a failed preview must not cost the training, and must not go unnoticed either. The images
    it returns go to TensorBoard too (``--report-to tensorboard``)."""
    def guarded_sample(step: int) -> None:
        try:
            paths = sample(step)
            if paths and log is not None and log.board is not None:
                log.board.add_images(step, paths)
        except Exception as exc:  # noqa: BLE001 - any failure of a preview: said and logged, training goes on
            error = str(exc) if isinstance(exc, SampleFailed) else \
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"warning: samples: step {step}: sampling failed ({error}); training goes on", file=sys.stderr,
                  flush=True)
            if log is not None:
                log.sample_failed(step, error)
    return guarded_sample


def finish_log(log: StepLog, records: Sequence[StepRecord], title: str) -> None:
    """The last log.json, loss.png and the closing line (loss over the first and last few steps)."""
    log.records = records
    summary = log.flush()
    if log.board is not None:
        log.board.close()
    plot = log.path.with_name("loss.png")
    write_loss_plot(plot, records, f"{title}, {log.info['placement']} + {summary['schedule']}")
    window = summary["loss_window"]
    print(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} (means of the first and last "
          f"{window} step{'s' if window > 1 else ''}), {summary['median_step_seconds'] * 1e3:.1f} ms/step, "
          f"{summary['samples_per_s']:.2f} samples/s{peak_rate(records)}; "
          f"wrote {log.path} and {plot}", flush=True)
    said = step_line(summary, log.info.get("predicted") or {}, log.info.get("plan"))
    if said:
        print(said, flush=True)
    if summary.get("memory"):
        print(memory_line(summary["memory"]), flush=True)


def step_line(summary: dict, predicted: dict, plan: str | None = None) -> str | None:
    """The measured step beside the plan's prediction: ``step: 733.1 ms measured, 179.3 ms predicted
    (4.09x) from analytic:cpu-local costs; ...``. Analytic costs are a device's datasheet figures, not
    this host's, so the line then says how to measure them; None where nothing was predicted."""
    seconds = predicted.get("step_seconds")
    if not seconds:
        return None
    ratio = summary["median_step_seconds"] / seconds
    source = str(predicted.get("cost_source", ""))
    line = (f"step: {summary['median_step_seconds'] * 1e3:.1f} ms measured, {seconds * 1e3:.1f} ms predicted "
            f"({ratio:.2f}x) from {source or 'unnamed'} costs")
    if source.startswith("analytic"):
        profile = f"pulse profile --plan {plan}" if plan else "pulse profile"
        line += (f"; analytic costs are datasheet figures, not this host's: `{profile}` measures them, and "
                 "`pulse train --costs costs.yaml --cluster cluster.yaml` plans and predicts with them")
    return line


def peak_rate(records: Sequence[StepRecord]) -> str:
    """``, peak learning rate 0.0001`` (the closing line says which rate trained), or nothing unrecorded."""
    rates = [r.lr for r in records if getattr(r, "lr", None) is not None]
    return f", peak learning rate {max(rates):g}" if rates else ""


def memory_line(memory: Sequence[dict]) -> str:
    """Each pipeline device's peak device memory (the most over its data-parallel ranks) beside the
    simulator's prediction for it: ``peak memory: device 0 3.10 GiB (predicted 2.95 GiB), ...``; on a CPU
    what its allocations held, with its resident peak after (``54 MiB (predicted 51 MiB; 72 MiB resident)``);
    where only the resident set is known (MindSpore on a CPU), it is said so, and why it stands above the
    prediction of the tensors' bytes."""
    devices: dict[int, dict] = {}
    for row in memory:
        seen = devices.setdefault(row["device"], dict(row))
        for key in ("peak_bytes", "resident_peak_bytes"):
            if key in row:
                seen[key] = max(seen[key], row[key])
    parts = []
    for device, row in sorted(devices.items()):
        predicted = row.get("predicted_peak_bytes")
        said = "not predicted" if predicted is None else f"predicted {memory_size(predicted)}"
        if "resident_peak_bytes" in row:
            said += f"; {memory_size(row['resident_peak_bytes'])} resident"
        what = " resident" if row.get("peak_is_resident") else ""
        parts.append(f"device {device} {memory_size(row['peak_bytes'])}{what} ({said})")
    line = "peak memory: " + ", ".join(parts)
    if any(row.get("peak_is_resident") for row in devices.values()):
        line += ("; resident: this runtime counts no tensor bytes on a CPU, and its resident set holds the pages "
                 "its memory pool keeps free (benchmarks/mindspore_pool_pages.py)")
    return line


def memory_size(nbytes: float) -> str:
    """``3.10 GiB``; below a GiB in MiB (``54 MiB``), where two decimals of a GiB would hide a 40% miss."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def history_before(out_dir: Path, step: int) -> list[dict]:
    """The steps a resumed run's log already holds (before ``step``)."""
    return read_history(out_dir / "log.json", step)


def write_trace_part(trace: str | Path, rank: int, spans: list[dict]) -> None:
    part = Path(f"{trace}.rank-{rank}.json")  # beside --trace, whose folder the command line checked exists
    write_atomic(part, json.dumps(spans))


def merge_trace(trace: str | Path, world: int) -> Path:
    """Rank 0: every rank's part into one Chrome trace; the parts go."""
    parts = {r: Path(f"{trace}.rank-{r}.json") for r in range(world)}
    spans = on_one_clock({r: json.loads(p.read_text()) for r, p in parts.items()})
    path = write_measured_trace(spans, trace)
    for p in parts.values():
        p.unlink()
    return path


def on_one_clock(ranks: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """Each rank's spans without its origin; shifted onto one time axis when every rank ran on one
    host (time.perf_counter is the host's monotonic clock), so a message's send and its receive line
    up; else each rank from its own step start."""
    origins = {r: next((s for s in spans if s.get("kind") == "origin"), None) for r, spans in ranks.items()}
    plain = {r: [s for s in spans if s.get("kind") != "origin"] for r, spans in ranks.items()}
    if any(o is None for o in origins.values()) or len({o["host"] for o in origins.values()}) != 1:
        return plain
    first = min(o["clock"] for o in origins.values())
    return {r: [{**s, "start": s["start"] + origins[r]["clock"] - first, "end": s["end"] + origins[r]["clock"] - first}
                for s in spans] for r, spans in plain.items()}


def guarded(prog: str, rank: str, lead: bool, body: Callable[[], int],
            out_of_memory: Callable[[BaseException], str | None] | None = None) -> int:
    """Run a rank entry's ``body`` under the failure rule above; its exit code.

    A communication failure leaves at once (``os._exit``): tearing down a
    process group with a dead peer can block, and the ranks waiting on this
    one learn of the failure only when its sockets close. So does a failed
    allocation that ``out_of_memory`` words (``pulse.train.out_of_memory``), with exit code 2.
    """
    try:
        return body()
    except CommTimeout as exc:
        print(f"{prog}: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except NonFiniteLoss as exc:  # every rank saw the same summed loss: say it once, all leave with 2
        if lead:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # at once, as above: log.json is already on disk (written atomically after every step)
    except PulseError as exc:
        print(f"{prog}: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        line = out_of_memory(exc) if out_of_memory is not None else None
        if line is None:
            raise
        print(f"{prog}: rank {rank}: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # its peers wait on it; log.json holds every finished step already
