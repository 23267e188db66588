"""What this process may really use of the host's memory: its memory cgroup's limit, where it has one.

::

    /proc/self/cgroup   "0::/PATH"                 cgroup v2: /sys/fs/cgroup/PATH/memory.max ("max": none)
                        "N:...memory...:/PATH"     cgroup v1: /sys/fs/cgroup/memory/PATH/memory.limit_in_bytes
                                                   (a page-rounded 2**63 - 1: none)

Slurm, Kubernetes and Docker confine a job this way; the hardware file's figure
(``Hardware.memory_bytes``) is the machine's, which such a job never gets whole.
Each level up to the root is read too (a parent's limit binds its children), and the
smallest limit wins. A namespaced /proc may name a path this filesystem does not
show; then the levels that exist are read. ``memory_cgroups`` is the one parser of
/proc/self/cgroup: ``pulse.oom_kills`` reads the out-of-memory kill counters where it says.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup in one mounted hierarchy: its folder first, then each parent up to the
    hierarchy's root (the folders may not all exist: see the module doc)."""

    version: int  # 1: the v1 memory controller's own hierarchy; 2: the unified one
    levels: tuple[Path, ...]

    @property
    def folder(self) -> Path:
        return self.levels[0]


def memory_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup"),
                   root: Path = Path("/sys/fs/cgroup")) -> list[MemoryCgroup]:
    """Where this process's memory cgroup may be mounted: v2 at ``root`` or ``root/unified`` (a hybrid
    layout), v1 at ``root/memory``. [] where /proc says nothing (not Linux)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[MemoryCgroup] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2's unified hierarchy
            found += [MemoryCgroup(2, tuple(_levels(base, path))) for base in (root, root / "unified")]
        elif "memory" in controllers.split(","):
            found.append(MemoryCgroup(1, tuple(_levels(root / "memory", path))))
    return found


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest memory limit over this process's cgroup and its parents, in bytes; None: no limit."""
    limits: list[int] = []
    for cgroup in memory_cgroups(proc_cgroup, root):
        name = "memory.max" if cgroup.version == 2 else "memory.limit_in_bytes"
        limits += [v for v in (_read_limit(level / name) for level in cgroup.levels) if v is not None]
    return min(limits) if limits else None


def usable_host_memory(hardware_bytes: int) -> int:
    """What a job on this host may hold: the hardware's memory, or its cgroup's limit when smaller."""
    limit = cgroup_memory_limit()
    return hardware_bytes if limit is None else min(hardware_bytes, limit)
