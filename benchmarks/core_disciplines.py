"""How ranks sharing a core should be simulated: three disciplines against the same real runs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/core_disciplines.py --workdir DIR

``DIR`` is a ``benchmarks/validate.py --workdir DIR --keep`` directory (each group's profile and
the plans its runs trained); the measured step times are ``benchmarks/results/validate.json``'s.
Every row is predicted again, the measurements unchanged, with the ranks that share a core (P = 4
on two cores) advancing as

    shared   every busy rank at cores / busy ranks (``pulse.sim.program._CorePool``: the simulator's)
    fifo     an action keeps its core until it ends; the next waits its turn (first come, first served)
    slices   round robin in slices of the kernel's quantum, a rank that becomes ready first in line

``slices`` takes its quantum from this host: a rank waking beside a busy one on its core is
delayed by the busy one's slice when it has used up its credit (``measure_quantum``: the upper
decile of that delay). Prints, per discipline, the P = 4 errors and how many (model, P, link)
groups rank as measured; writes benchmarks/results/core_disciplines.json.
"""
from __future__ import annotations

import argparse
import collections
import heapq
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import validate as v  # noqa: E402
import pulse.sim.program as program  # noqa: E402

SHARED = program._CorePool


class FifoPool:
    """Non-preemptive: up to ``cores`` actions run at full speed, the rest queue in arrival order."""

    def __init__(self, cores: int | None, sharing: float = 1.0) -> None:
        self.cores, self.running, self.queue, self.seq = cores, [], collections.deque(), 0

    @property
    def jobs(self) -> bool:
        return bool(self.running or self.queue)

    def next_done(self) -> float:
        return self.running[0][0] if self.running else float("inf")

    def _run(self, t: float, seconds: float, device: int, position: int) -> None:
        self.seq += 1
        heapq.heappush(self.running, (t + seconds, self.seq, device, t, position))

    def add(self, t: float, seconds: float, device: int, position: int) -> None:
        if self.cores is None or len(self.running) < self.cores:
            self._run(t, seconds, device, position)
        else:
            self.queue.append((seconds, device, position))

    def pop(self, t: float) -> tuple[int, float, int]:
        _, _, device, start, position = heapq.heappop(self.running)
        if self.queue:
            self._run(t, *self.queue.popleft())
        return device, start, position


class SlicePool:
    """Round robin in slices of ``QUANTUM`` seconds; a newly ready action takes a core at once,
    the action it displaces goes first in line. Advancing at ``sharing`` while ranks outnumber cores."""

    QUANTUM = 0.0

    def __init__(self, cores: int | None, sharing: float = 1.0) -> None:
        self.cores, self.sharing, self.at, self.seq = cores, sharing, 0.0, 0
        self.running: list[list] = []  # [remaining, slice end, seq, device, start, position]
        self.queue: collections.deque = collections.deque()

    @property
    def jobs(self) -> bool:
        return bool(self.running or self.queue)

    def _rate(self) -> float:
        n = len(self.running) + len(self.queue)
        return 1.0 if self.cores is None or n <= self.cores else self.sharing

    def _next(self) -> tuple[float, bool, list] | None:
        """(when, whether it is a slice's end rather than a finish, the job)."""
        best = None
        for job in self.running:
            finish = self.at + max(job[0], 0.0) / self._rate()
            event = (job[1], True, job) if self.queue and job[1] < finish else (finish, False, job)
            if best is None or (event[0], event[2][2]) < (best[0], best[2][2]):
                best = event
        return best

    def _go(self, t: float) -> None:
        rate = self._rate()
        for job in self.running:
            job[0] -= (t - self.at) * rate
        self.at = t

    def _rotate(self, job: list, t: float) -> None:
        self.running.remove(job)
        self.queue.append(job)
        self._start_next(t)

    def _start_next(self, t: float) -> None:
        if self.queue:
            nxt = self.queue.popleft()
            nxt[1] = t + self.QUANTUM
            self.running.append(nxt)

    def advance(self, t: float) -> None:
        while (event := self._next()) is not None and event[1] and event[0] < t:
            self._go(event[0])
            self._rotate(event[2], event[0])
        self._go(max(t, self.at))

    def next_done(self) -> float:
        saved = ([list(j) for j in self.running], collections.deque(list(j) for j in self.queue), self.at)
        try:
            while (event := self._next()) is not None:
                if not event[1]:
                    return event[0]
                self._go(event[0])
                self._rotate(event[2], event[0])
            return float("inf")
        finally:
            self.running, self.queue, self.at = saved

    def add(self, t: float, seconds: float, device: int, position: int) -> None:
        self.advance(t)
        self.seq += 1
        job = [seconds, t + self.QUANTUM, self.seq, device, t, position]
        if self.cores is not None and len(self.running) >= self.cores:
            displaced = min(self.running, key=lambda j: j[1])
            self.running.remove(displaced)
            self.queue.appendleft(displaced)
        self.running.append(job)

    def pop(self, t: float) -> tuple[int, float, int]:
        self.advance(t)
        job = self._next()[2]
        self.running.remove(job)
        self._start_next(t)
        return job[3], job[4], job[5]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _busy(seconds: float) -> None:
    os.sched_setaffinity(0, {0})
    _spin(seconds)


def _wake(out, seconds: float) -> None:
    os.sched_setaffinity(0, {0})
    delays, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = time.perf_counter()
        time.sleep(0.001)
        delays.append(time.perf_counter() - before - 0.001)
        _spin(0.001)
    out.put(delays)


def measure_quantum(seconds: float = 2.0) -> float:
    """The slice a busy rank keeps its core for: the upper decile of the delay a rank waking
    beside it on core 0 sees (1 ms asleep, 1 ms of work, in a loop)."""
    out = mp.Queue()
    busy = mp.Process(target=_busy, args=(seconds + 0.5,))
    busy.start()
    time.sleep(0.1)
    waker = mp.Process(target=_wake, args=(out, seconds))
    waker.start()
    delays = out.get()
    waker.join()
    busy.join()
    return statistics.quantiles(delays, n=10)[-1]


def evaluate(rows: list, workdir: Path, pool) -> dict:
    program._CorePool = pool
    try:
        again = v.repredict(rows, workdir)
    finally:
        program._CorePool = SHARED
    four = [r.error for r in again if r.pp == 4]
    ranks = v.rankings(again)
    return {"p4_median_abs_error": statistics.median(abs(e) for e in four), "p4_worst_error": max(four, key=abs),
            "p4_within_25": sum(abs(e) <= 0.25 for e in four), "p4_rows": len(four),
            "groups_ranked_as_measured": sum(g["same"] for g in ranks), "groups": len(ranks),
            "differ": [f"{g['model']} P{g['pp']} {g['link']}" for g in ranks if not g["same"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--workdir", required=True, help="a validate.py --workdir DIR --keep directory")
    args = parser.parse_args(argv)
    if not (os.cpu_count() or 1) >= 2 or not hasattr(os, "sched_setaffinity"):
        print("core_disciplines: needs two cores and sched_setaffinity", file=sys.stderr)
        return 2
    SlicePool.QUANTUM = measure_quantum()
    print(f"quantum (a waking rank's upper-decile delay behind a busy one): {SlicePool.QUANTUM * 1e3:.2f} ms")
    rows = v.rows_of(json.loads((v.RESULTS / "validate.json").read_text()))
    out = {"quantum_s": SlicePool.QUANTUM, "disciplines": {}}
    for name, pool in (("shared", SHARED), ("fifo", FifoPool), ("slices", SlicePool)):
        figures = evaluate(rows, Path(args.workdir), pool)
        out["disciplines"][name] = figures
        print(f"{name:7s} P=4 median |error| {figures['p4_median_abs_error']:.1%}, worst "
              f"{figures['p4_worst_error']:+.1%}; groups ranked as measured {figures['groups_ranked_as_measured']}"
              f"/{figures['groups']} (differ: {', '.join(figures['differ']) or 'none'})", flush=True)
    (v.RESULTS / "core_disciplines.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
