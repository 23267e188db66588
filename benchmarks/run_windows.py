"""A group of runs as a timeline: profile, runs, profile, runs, profile; each run is predicted on
the two profiles taken right around it.

Why: this 2-core VM's speed swings by 15% within three minutes (tiny-dit's first nine layers,
timed in one process, summed 4.86 ms and three minutes later 4.14 ms; two processes timing them
at once read the same as one alone, so it is the host, not contention). A profile at each end of
a group sees the host as its runs did only if the drift is linear across the whole group: the
run at b8bcde5 had every row of a group err the same way, by up to +16%. A profile between the
mirrored halves (A B C D, profile, D C B A) halves the span that each run's prediction
interpolates across, and each recheck round (A B B A) gets a profile after it too.

A run's prediction is made on the mean (``pulse.profiling.mean``) of the profile right before it
and the one right after it; a row's prediction is the mean of its runs' predictions, as its
measured figure is the mean of its runs' means. The window of each run is saved beside the
group's profiles (``save``), so ``validate.py --repredict`` predicts each run on the same pair.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from host_speed import slowdown


@dataclass(frozen=True)
class Profile:
    """One ``pulse profile`` of a group: its cost table, its measured cluster (at the group's
    link) and the host-speed probes taken right before and after it."""
    costs: Any
    cluster: Any
    probes: tuple[float, ...]


@dataclass(frozen=True)
class Window:
    """Where one run sat: the profiles right before and right after it (their ``when``), and the
    host's speed probed around the run itself."""
    before: str
    after: str
    probe: float | None = None


@dataclass
class Timeline:
    """Profiles and runs in the order they were taken; ``take_profile(when)`` profiles now."""
    take_profile: Callable[[str], Profile]
    profiles: dict[str, Profile] = field(default_factory=dict)
    windows: dict[int, list[Window]] = field(default_factory=dict)  # per configuration, its closed runs
    _means: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)
    _open: list[tuple[int, float | None]] = field(default_factory=list)  # runs since the last profile

    def profile(self, when: str) -> Profile:
        """Profile now; every run since the last profile gets its window closed by this one."""
        if when in self.profiles:
            raise ValueError(f"a group's profile '{when}' was taken already")
        if self._open and not self._order:
            raise ValueError("a run before a group's first profile has nothing to be predicted on")
        self.profiles[when] = self.take_profile(when)
        for config, probe in self._open:
            self.windows.setdefault(config, []).append(Window(self._order[-1], when, probe))
        self._open.clear()
        self._order.append(when)
        return self.profiles[when]

    @classmethod
    def of_windows(cls, take_profile: Callable[[str], Profile], windows: list[Window]) -> "Timeline":
        """A timeline of profiles taken earlier: the ones ``windows`` name (``--repredict``)."""
        return cls(take_profile, {when: take_profile(when) for w in windows for when in (w.before, w.after)})

    def ran(self, config: int, probe: float | None = None) -> None:
        """A run of ``config`` ended; its window closes at the next profile."""
        self._open.append((config, probe))

    def between(self, window: Window, mean: Callable[[list[Profile]], tuple[Any, Any]]) -> tuple[Any, Any]:
        """(costs, cluster) of a window: ``mean`` of its two profiles (once per pair of profiles)."""
        key = (window.before, window.after)
        if key not in self._means:
            self._means[key] = mean([self.profiles[window.before], self.profiles[window.after]])
        return self._means[key]

    def slowdown(self, window: Window) -> float | None:
        """How many times slower the host probed around the run than around its two profiles."""
        probes = [p for when in (window.before, window.after) for p in self.profiles[when].probes]
        return None if window.probe is None or not probes else slowdown([window.probe], probes)


def windows_file(group: Path, pp: int) -> Path:
    return group / f"windows-pp{pp}.json"


def save(group: Path, pp: int, names: list[str], windows: dict[int, list[Window]]) -> None:
    """Each configuration's runs' windows, by the configuration's name, beside the group's profiles."""
    doc = {names[i]: [[w.before, w.after, w.probe] for w in ws] for i, ws in sorted(windows.items())}
    windows_file(group, pp).write_text(json.dumps(doc, indent=1))


def load(group: Path, pp: int) -> dict[str, list[Window]] | None:
    """What ``save`` wrote; None for a group measured before runs had windows."""
    path = windows_file(group, pp)
    if not path.exists():
        return None
    return {name: [Window(*w) for w in ws] for name, ws in json.loads(path.read_text()).items()}
