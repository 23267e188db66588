"""What one rewrite of log.json costs as a run grows, and what rank 0 pays per step for it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_log.py [--sizes 10 1000 10000 100000]

Rank 0 used to rewrite the whole log (every step's record, serialized and fsynced
twice: ``pulse.atomic_io``) after every step, between two steps of the pipeline's
first rank while the others wait for it. ``StepLog`` now rewrites it after the
first step, then every 10 s and never for more than 1% of the time, and at
checkpoints, the last step and a failure. Per log size: one rewrite, timed
(median of 3), and what a step would pay for it on average with 100 ms steps,
then and now. Writes benchmarks/results/step_log.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pulse.train.run_outputs import StepLog
from pulse.train.runlog import StepRecord, write_log

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STEP_SECONDS = 0.1


def rewrite_seconds(steps: int, folder: Path) -> float:
    rows = [asdict(StepRecord(i, 0.5, STEP_SECONDS, 80.0, 123456, 0, 1.0, 1e-4)) for i in range(steps)]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        write_log(folder / "log.json", {"schedule": "1f1b", "global_batch": 8}, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_step_now(rewrite: float) -> float:
    """A step's average share of rewrites at ``StepLog``'s interval (steps of STEP_SECONDS)."""
    interval = max(StepLog.EVERY, StepLog.SLOWER * rewrite)
    return rewrite * STEP_SECONDS / (interval + rewrite)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--sizes", nargs="+", type=int, default=[10, 1000, 10000, 100000])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.sizes:
            rewrite = rewrite_seconds(steps, Path(tmp))
            rows.append({"steps_in_log": steps, "rewrite_ms": rewrite * 1e3, "per_step_before_ms": rewrite * 1e3,
                         "per_step_now_ms": per_step_now(rewrite) * 1e3})
    print(f"| steps in log.json | one rewrite ms | per {STEP_SECONDS * 1e3:.0f} ms step before | per step now |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['steps_in_log']} | {r['rewrite_ms']:.1f} | {r['per_step_before_ms']:.1f} ms | "
              f"{r['per_step_now_ms']:.3f} ms |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step_log.json").write_text(json.dumps({"step_seconds": STEP_SECONDS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
