"""What this process may really use of the host's memory: its memory cgroup's limit, where it has one.

::

    /proc/self/cgroup   "0::/PATH"                 cgroup v2: /sys/fs/cgroup/PATH/memory.max ("max": none)
                        "N:...memory...:/PATH"     cgroup v1: /sys/fs/cgroup/memory/PATH/memory.limit_in_bytes
                                                   (a page-rounded 2**63 - 1: none)

Slurm, Kubernetes and Docker confine a job this way; the hardware file's figure
(``Hardware.memory_bytes``) is the machine's, which such a job never gets whole.
Each level up to the root is read too (a parent's limit binds its children), and the
smallest limit wins. A namespaced /proc may name a path this filesystem does not
show; then the levels that exist are read.
"""
from __future__ import annotations

from pathlib import Path

NO_LIMIT = 2**62  # v1 writes 2**63 - 1 rounded down to a page for "no limit"


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if value < NO_LIMIT else None


def _levels(root: Path, path: str) -> list[Path]:
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest memory limit over this process's cgroup and its parents, in bytes; None: no limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2's unified hierarchy
            candidates = [(level / "memory.max") for level in _levels(root, path)]
            candidates += [(level / "memory.max") for level in _levels(root / "unified", path)]
        elif "memory" in controllers.split(","):
            candidates = [(level / "memory.limit_in_bytes") for level in _levels(root / "memory", path)]
        else:
            continue
        limits += [v for v in map(_read_limit, candidates) if v is not None]
    return min(limits) if limits else None


def usable_host_memory(hardware_bytes: int) -> int:
    """What a job on this host may hold: the hardware's memory, or its cgroup's limit when smaller."""
    limit = cgroup_memory_limit()
    return hardware_bytes if limit is None else min(hardware_bytes, limit)
