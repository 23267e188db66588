"""Whether the kernel's out-of-memory killer ended a process of this job: its memory cgroups' kill counters.

::

    OomKills.read()   before the launch    cgroup v1: every folder under this process's memory cgroup,
    OomKills.read()   after it                        memory.oom_control  "oom_kill N"
                                           cgroup v2: this process's cgroup, memory.events "oom_kill N"
    after.since(before)  the kills in between (0: none the counters saw)

A rank killed by SIGKILL may have been stopped by anyone; the counters tell
the out-of-memory killer apart. They count where the victim lived: v1 counts in
the victim's own cgroup only (a rank moved into a child cgroup counts there, so
the whole subtree is read), v2 in the victim's cgroup and every parent, so this
process's own folder sees its children's kills. Where the controller is missing
or unreadable the counters say nothing and nothing is claimed. The folders come
from ``pulse.host_limits.memory_cgroups`` (one parser of /proc/self/cgroup).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pulse.host_limits import memory_cgroups

COUNTER_FILES = {1: "memory.oom_control", 2: "memory.events"}
MAX_FOLDERS = 4096  # a subtree walk stops here: a job's own cgroups are a handful, a host's root may be many


def oom_kill_count(folder: Path, version: int) -> int | None:
    """The ``oom_kill`` counter of one cgroup folder (v1 ``memory.oom_control``, v2 ``memory.events``);
    None where the file is missing or has no such line (a v1 kernel before 4.13)."""
    try:
        text = (folder / COUNTER_FILES[version]).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _subtree(folder: Path) -> list[Path]:
    """``folder`` and the folders below it, at most ``MAX_FOLDERS``; never through a link."""
    found = [folder]
    for here, dirs, _ in os.walk(folder):
        for name in dirs:
            if len(found) >= MAX_FOLDERS:
                return found
            found.append(Path(here) / name)
    return found


@dataclass(frozen=True)
class OomKills:
    """Every ``oom_kill`` counter this process's memory cgroups show, by folder."""

    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> "OomKills":
        counts: dict[str, int] = {}
        for cgroup in memory_cgroups(proc_cgroup, root):
            if not cgroup.folder.is_dir():
                continue
            folders = _subtree(cgroup.folder) if cgroup.version == 1 else [cgroup.folder]
            for folder in folders:
                count = oom_kill_count(folder, cgroup.version)
                if count is not None:
                    counts[str(folder)] = count
        return cls(counts)

    def since(self, before: "OomKills") -> int:
        """Kills counted after ``before`` was read (a folder made in between counts from 0)."""
        return sum(max(0, n - before.counts.get(folder, 0)) for folder, n in self.counts.items())
