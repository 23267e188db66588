"""A dependency-free progress bar on stderr for tuner searches, ILP solves and training."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, "tuning") as bar: bar.update(1, note="pp=4 dp=2")``.

    Redraws in place on a terminal; elsewhere (CI, logs) prints a line at most
    every ``log_every`` seconds so logs stay readable.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, log_every: float = 5.0,
                 enabled: bool = True) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.enabled = enabled
        self.note = ""
        self._start = time.monotonic()
        self._last_log = -1e9
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._log_every = log_every

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        self.note = note or self.note
        now = time.monotonic()
        if not self.enabled:
            return
        if self._tty or now - self._last_log >= self._log_every or self.done == self.total:
            self._last_log = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self._start
        frac = self.done / self.total
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {self.note}"
        if self._tty:
            self.stream.write("\r" + line[:160].ljust(160))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units for people: 512 B, 1.1 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
