"""Files that are never half-written: a temporary file beside the target, fsync, rename.

A crash leaves either the old file or the new one (the temporary ``.name.*``
file may stay behind; no loader reads it). Plans, run configurations, logs,
manifests, pictures and checkpoint rank files all go through ``write_atomic_bytes``.

Only regular files are written: a target that is a device node, a pipe, a socket, a folder or a
symbolic link is refused in one line (a rename over ``/dev/null`` would replace the node itself;
a link would be followed out of the run folder), and so is a target whose folder does not exist
(PULSE makes no folder it was not asked for: callers that own a folder, the run's, create it).
A write that fails (a full disk, no permission) is one line too; the previous file stays whole.
"""
from __future__ import annotations

import hashlib
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from pulse.errors import PulseError

_KINDS = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "named pipe"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


class _HashingWriter:
    """A file object that hashes and counts what passes through (no second read of the file)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.sha, self.size = handle, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry durable (POSIX only: Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def not_regular(path: str | Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("named pipe", ...), without following
    a link; None for a regular file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PulseError(f"{path}: cannot check it ({exc.strerror or exc})") from None
    return next((name for test, name in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "special file")


def check_target(path: str | Path) -> None:
    """Refuse (one line) a write to ``path`` unless it is a regular file or absent, in a folder that exists."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:
        raise PulseError(f"{path} is a {kind}, not a regular file: PULSE writes only regular files; "
                         "name another path")
    if not path.parent.is_dir():
        raise PulseError(f"{path}: no folder '{path.parent}'; create it first (PULSE makes no folder it "
                         "was not asked for)")


def write_atomic_bytes(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """``write(file)`` into a temporary file next to ``path``, fsync, rename: (size, sha256 hex).

    A crash leaves either the old file or the new one, never half of one (the
    temporary ``.name.*`` file may stay behind; loaders never read it).
    ``check_target``'s refusals first; an ``OSError`` while writing is a one-line ``PulseError``.
    """
    path = Path(path)
    check_target(path)
    try:
        return _write_and_rename(path, write)
    except OSError as exc:  # ENOSPC, EDQUOT, EACCES, EROFS, ...
        raise PulseError(f"{path}: cannot write ({exc.strerror or exc}); any previous file there is "
                         "unchanged") from None


def _write_and_rename(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; other jobs (evaluation) read checkpoints
        with os.fdopen(fd, "wb") as handle:
            writer = _HashingWriter(handle)
            write(writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.sha.hexdigest()


def write_atomic(path: str | Path, text: str) -> None:
    """UTF-8 ``text`` to ``path`` atomically (its folder must exist)."""
    write_atomic_bytes(Path(path), lambda f: f.write(text.encode("utf-8")))


def write_atomic_figure(path: str | Path, figure: Any, **savefig: Any) -> None:
    """A matplotlib figure to ``path`` atomically, in the format its suffix names (never through a link)."""
    path = Path(path)
    check_target(path)  # before drawing: a refused target costs nothing
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lstrip(".").lower() or "png", **savefig)
    write_atomic_bytes(path, lambda f: f.write(buffer.getvalue()))


def file_sha256(path: str | Path) -> str:
    """The sha256 hex of a file's bytes, read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
