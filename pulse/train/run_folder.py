"""The run folder: one `pulse train` at a time, and nothing in it that leads outside it.

::

    RUN/.pulse-train.lock   flock'ed by the `pulse train` process for the run's whole life (the
                            ranks are its children); holds that process's pid for the refusal
    RUN/checkpoints/ samples/ tensorboard/ msrun_logs/    folders PULSE writes into: never links

Why flock: the kernel drops the lock when its holder dies in any way (kill -9 included), so a
dead run's lock is never stale, and a second `pulse train` on the same folder learns of a live
one at once, before it writes anything (two runs in one folder swapped settings and both wrote
the same checkpoints and log.json). Files are checked where they are written
(``pulse.atomic_io`` refuses a link); folders are checked here, before the ranks start.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pulse.atomic_io import not_regular
from pulse.launch_env import MSRUN_LOGS
from pulse.errors import PulseError

LOCK_NAME = ".pulse-train.lock"
FOLDERS = ("checkpoints", "samples", "tensorboard", MSRUN_LOGS)  # what the ranks write into
_STEP = re.compile(r"^step-\d+$")


@dataclass
class RunLock:
    """An open, flock'ed lock file; ``release`` (or this process's end) lets the next run in."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_folder(out_dir: Path, node_rank: int = 0) -> RunLock:
    """Hold ``out_dir``'s lock (one per node of a job: its nodes may share a file system) or refuse."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (PULSE's launchers run on Linux)
        return RunLock(out_dir / LOCK_NAME, None)
    path = out_dir / (LOCK_NAME if node_rank == 0 else f"{LOCK_NAME}.node{node_rank}")
    kind = not_regular(path)
    if kind is not None:
        raise PulseError(f"{path} is a {kind}, not PULSE's lock file: remove it")
    try:  # O_NOFOLLOW: a link planted in its place is refused, not followed; not inherited by the ranks
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise PulseError(f"{path}: cannot open the run folder's lock ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: another live `pulse train` runs in this folder
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise PulseError(f"{out_dir} is in use by another `pulse train` (pid {holder}): one run per folder; "
                         "wait for it, stop it, or give another --out-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunLock(path, fd)


def check_no_links(out_dir: Path, checkpoint_dir: Path) -> None:
    """Refuse a run folder whose sub-folders (or checkpoint step folders) are symbolic links:
    writing through one would reach outside the run."""
    inside = [out_dir / name for name in FOLDERS]
    if checkpoint_dir.is_dir():
        inside += [p for p in checkpoint_dir.iterdir() if _STEP.match(p.name)]
    for path in inside:
        if path.is_symlink():
            raise PulseError(f"{path} is a symbolic link: PULSE writes only inside the run folder, never "
                             "through a link; remove it (or give another --out-dir)")
