"""Files that are never half-written: a temporary file beside the target, fsync, rename.

A crash leaves either the old file or the new one (the temporary ``.name.*``
file may stay behind; no loader reads it). Plans, run configurations, logs,
manifests and checkpoint rank files all go through ``write_atomic_bytes``.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable


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


def write_atomic_bytes(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """``write(file)`` into a temporary file next to ``path``, fsync, rename: (size, sha256 hex).

    A crash leaves either the old file or the new one, never half of one (the
    temporary ``.name.*`` file may stay behind; loaders never read it).
    """
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
    """UTF-8 ``text`` to ``path`` atomically (its folder is created if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic_bytes(path, lambda f: f.write(text.encode("utf-8")))
