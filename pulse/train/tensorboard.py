"""``--report-to tensorboard``: each step's figures as TensorBoard scalars, beside log.json.

::

    OUT_DIR/tensorboard/events.out.tfevents.*   train/loss, train/lr, train/grad_norm, train/loss_scale,
                                                perf/step_seconds, perf/samples_per_s, comm/pipeline_bytes,
                                                comm/allreduce_bytes, train/skipped   (step: log.json's)

Written with the ``tensorboard`` package's own event writer (no framework
import: both backends report the same way). Rank 0 writes; events are flushed
after every step, so a crash keeps what it trained.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from pulse.errors import PulseError
from pulse.train.runlog import StepRecord

SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/loss_scale": "loss_scale",
           "perf/step_seconds": "seconds", "perf/samples_per_s": "samples_per_s",
           "comm/pipeline_bytes": "pipeline_bytes", "comm/allreduce_bytes": "allreduce_bytes",
           "train/skipped": "skipped"}


class TensorBoardLog:
    """Each step's figures as scalars (None figures left out), fed by ``StepLog``."""

    def __init__(self, out_dir: Path) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise PulseError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.folder = Path(out_dir) / "tensorboard"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.folder))
        self._last: int | None = None

    def __call__(self, records: Sequence[StepRecord]) -> None:
        """Every record not written yet (the loop passes all records so far)."""
        for record in records:
            if self._last is not None and record.step <= self._last:
                continue
            values = [self._summary.Value(tag=tag, simple_value=float(getattr(record, field)))
                      for tag, field in SCALARS.items() if getattr(record, field) is not None]
            self._writer.add_event(self._event(wall_time=time.time(), step=record.step,
                                               summary=self._summary(value=values)))
            self._last = record.step
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
