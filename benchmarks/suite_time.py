"""Where the test suite's time goes: each test file's wall time and CPU, the processes it starts included.

    python benchmarks/suite_time.py [--workdir DIR] [--out JSON] [-- PYTEST ARGS]
    python benchmarks/suite_time.py --from-rows DIR        (the table again from a run's rows)

Runs the README's test command (``python -m pytest``, its own three workers) with this module as a
pytest plugin (``-p suite_time``). Around every test each worker records its wall time and three CPU
figures (user + system):

    self      the worker's own threads
    children  processes it started and waited for (``subprocess.run``, msrun and torchrun jobs with
              their ranks: a process's reaped children roll up into it)
    warm      launches forked by the worker's warm-launch server (``tests/warm_launch.py``): the
              server's reaped children, read from ``/proc``; it reaps once a second, so a launch that
              ends near a test's end may count to the next test of that worker

Prints the suite's wall and CPU (from this process's reaped children: every worker and everything
they started), the files by CPU, and the ``SLOW_FILES`` order for ``tests/conftest.py`` (files whose
tests took 12 s of worker wall time or more, in seconds). Writes the per-file
sums to ``benchmarks/results/suite_time.json`` (the 60 costliest tests' rows).

On two cores the suite is CPU-bound (wall about CPU / 2): the CPU column is what a change must cut.
Both columns follow the host's speed, which differs from session to session: compare runs of one
session.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_time.json"
ROWS_ENV = "PULSE_SUITE_TIME_ROWS"  # the folder each worker writes its rows to
SLOW_FILE_SECONDS = 12  # a file enters SLOW_FILES at this much worker wall time
KEPT_TESTS = 60  # the JSON keeps this many tests' rows, the costliest in CPU
TICK = os.sysconf("SC_CLK_TCK")


# -- the plugin (pytest imports this module as ``-p suite_time``) ------------------------------------
_rows_file = None


def _warm_server_cpu(config) -> float:
    """CPU seconds of the warm-launch server's reaped children (its launches), 0 without one."""
    server = getattr(config, "warm_launches", (None, None))[0]
    if server is None:
        return 0.0
    try:
        with open(f"/proc/{server.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime


def _clocks(config) -> tuple[float, float, float, float]:
    """(own CPU, reaped children's CPU, the warm server's launches' CPU, wall)."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system, _warm_server_cpu(config), time.perf_counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (the hook's signature)
    global _rows_file
    if not os.environ.get(ROWS_ENV):
        yield
        return
    before = _clocks(item.config)
    yield  # setup, call and teardown
    after = _clocks(item.config)
    if _rows_file is None:
        _rows_file = open(Path(os.environ[ROWS_ENV]) / f"worker-{os.getpid()}.jsonl", "a")
    row = dict(zip(("self", "children", "warm", "wall"), (b - a for a, b in zip(before, after))))
    _rows_file.write(json.dumps({"test": item.nodeid, **row}) + "\n")
    _rows_file.flush()


# -- the report ------------------------------------------------------------------------------------
def read_rows(folder: Path) -> list[dict]:
    """Every test's row, with the worker that ran it (its rows file's name)."""
    return [{**json.loads(line), "worker": path.stem} for path in sorted(folder.glob("worker-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def per_worker(rows: list[dict]) -> list[float]:
    """Each worker's test wall time, most first: close together when SLOW_FILES balances the workers."""
    walls: dict[str, float] = defaultdict(float)
    for row in rows:
        walls[row.get("worker", "?")] += row["wall"]
    return sorted(walls.values(), reverse=True)


def per_file(rows: list[dict]) -> dict[str, dict]:
    """Each test file's sums (tests, wall, self, children, warm, cpu), the costliest in CPU first."""
    sums: dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall": 0.0, "self": 0.0, "children": 0.0, "warm": 0.0})
    for row in rows:
        s = sums[row["test"].split("::")[0]]
        s["tests"] += 1
        for key in ("wall", "self", "children", "warm"):
            s[key] += row[key]
    for s in sums.values():
        s["cpu"] = s["self"] + s["children"] + s["warm"]
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]["cpu"]))


def slow_files(files: dict[str, dict]) -> dict[str, int]:
    """``tests/conftest.py``'s SLOW_FILES: worker wall seconds per file at or over SLOW_FILE_SECONDS."""
    walls = {Path(name).name: round(s["wall"]) for name, s in files.items() if s["wall"] >= SLOW_FILE_SECONDS}
    return dict(sorted(walls.items(), key=lambda kv: -kv[1]))


def report(rows: list[dict], suite: dict | None = None, top: int = 30) -> dict:
    files = per_file(rows)
    attributed = sum(s["cpu"] for s in files.values())
    if suite:
        print(f"suite: {suite['wall']:.1f} s wall, {suite['cpu']:.1f} s CPU ({suite['outcome']}); "
              f"{attributed:.1f} s of it inside tests (collection and start-up are the rest)")
    workers = per_worker(rows)
    print(f"{len(rows)} tests in {len(files)} files on {len(workers)} workers, whose tests ran "
          f"{', '.join(f'{w:.0f}' for w in workers)} s; the {min(top, len(files))} costliest files in CPU:")
    print("| file | tests | CPU s | own | children | warm launches | worker wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in list(files.items())[:top]:
        print(f"| {name} | {s['tests']} | {s['cpu']:.1f} | {s['self']:.1f} | {s['children']:.1f} | {s['warm']:.1f} "
              f"| {s['wall']:.1f} |")
    slow = slow_files(files)
    print("SLOW_FILES = {" + ", ".join(f'"{k}": {v}' for k, v in slow.items()) + "}")
    costliest = sorted(rows, key=lambda r: -(r["self"] + r["children"] + r["warm"]))[:KEPT_TESTS]
    return {"suite": suite, "attributed_cpu_s": attributed, "worker_test_wall_s": workers, "files": files,
            "slow_files": slow, "costliest_tests": costliest}


def run_suite(rows: Path, pytest_args: list[str]) -> dict:
    """The README's test command with this plugin; the suite's wall, CPU and last line."""
    env = {**os.environ, ROWS_ENV: str(rows),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_time", *pytest_args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stdout.strip().splitlines()
    return {"wall": wall, "cpu": cpu, "returncode": done.returncode, "outcome": lines[-1] if lines else "no output",
            "load_before": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where the workers write their rows "
                        "(default: a fresh temporary folder)")
    parser.add_argument("--from-rows", type=Path, default=None, help="report a finished run's rows; run nothing")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    suite = None
    if args.from_rows is not None:
        folder = args.from_rows
    else:
        import tempfile
        folder = args.workdir or Path(tempfile.mkdtemp(prefix="suite-time-"))
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.glob("worker-*.jsonl")):
            print(f"suite_time: error: {folder} holds another run's rows; give an empty --workdir", file=sys.stderr)
            return 2
        print(f"suite_time: running the suite (about 10 minutes on two cores); rows in {folder}", flush=True)
        suite = run_suite(folder, args.pytest_args)
    rows = read_rows(folder)
    if not rows:
        print(f"suite_time: error: no rows in {folder}", file=sys.stderr)
        return 2
    result = report(rows, suite, args.top)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if suite is None or suite["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
