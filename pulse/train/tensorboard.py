"""``--report-to tensorboard``: each step's figures as TensorBoard scalars, beside log.json.

::

    OUT_DIR/tensorboard/events.out.tfevents.*   train/loss, train/lr, train/grad_norm, train/loss_scale,
                                                perf/step_seconds, perf/samples_per_s, comm/pipeline_bytes,
                                                comm/allreduce_bytes, train/skipped, val/loss   (step: log.json's)
                                                validation/<i>: --sample-every's images, as PNG

Written with the ``tensorboard`` package's own event writer (no framework
import: both backends report the same way). Rank 0 writes; events are flushed
after every step, so a crash keeps what it trained.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any, Sequence

from pulse.errors import PulseError
from pulse.train.runlog import StepRecord

SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/loss_scale": "loss_scale",
           "perf/step_seconds": "seconds", "perf/samples_per_s": "samples_per_s",
           "comm/pipeline_bytes": "pipeline_bytes", "comm/allreduce_bytes": "allreduce_bytes",
           "train/skipped": "skipped", "val/loss": "val_loss"}


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

    def add_images(self, step: int, paths: Sequence[Path]) -> None:
        """PNG files (``--sample-every``'s) as images of ``step``: ``validation/<i>``, the i-th file's."""
        values = [self._summary.Value(tag=f"validation/{i}", image=png_image(self._summary, Path(path).read_bytes()))
                  for i, path in enumerate(paths)]
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_COLOURS = {0: 1, 2: 3, 4: 2, 6: 4}  # IHDR colour type -> channels (grey, RGB, grey + alpha, RGBA)


def png_image(summary: Any, data: bytes) -> Any:
    """An image summary of encoded PNG ``data``: its size and channels read from the IHDR chunk (bytes
    16-25), no image library needed."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise PulseError("a sample image is not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return summary.Image(height=height, width=width, colorspace=PNG_COLOURS.get(data[25], 3),
                         encoded_image_string=data)
