"""A long run's memory: does any rank grow? (issue #42 item 6)

::

    python benchmarks/soak.py [--steps 2000] [--every 100] [--workdir DIR]

``pulse train --pipeline TINY --pp 2 --dp 2 --steps N --checkpoint-every 200 --checkpoints-total-limit 2
--ema 0.999 --sample-every 500`` on the tests' tiny SD pipeline (synthetic latents), as a user runs it
(torchrun, gloo, four ranks on this machine). While it trains, each rank's resident size (VmRSS, read
through psutil) is sampled with the step the run has reached (its progress line); for every rank the
benchmark keeps the last sample of each ``--every``-step window and fits a line to those after the
warm-up (the first 10% of the steps, at least one checkpoint and one sample): the slope, MB per 100
steps, is what a leak would show. Target: below 1 MB per 100 steps per rank.

Prints a table; writes ``benchmarks/results/soak.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROGRESS = re.compile(r"train \[[#-]*\]\s+(\d+)/(\d+)")


def rank_processes(root_pid: int) -> dict[int, "object"]:
    """The run's rank processes by global rank (their RANK environment variable)."""
    import psutil

    ranks = {}
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return ranks
    for child in children:
        try:
            if "pulse_torch.train" in " ".join(child.cmdline()):
                rank = child.environ().get("RANK")
                if rank is not None:
                    ranks[int(rank)] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def fit_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, bytes), in bytes per step."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--workdir", default="/tmp/pulse-soak")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    pipe = workdir / "pipeline"
    if not (pipe / "model_index.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from pipeline_helpers import tiny_pipeline

        tiny_pipeline(pipe)
    out = workdir / f"run-{int(time.time())}"
    cmd = [str(ROOT / ".venv" / "bin" / "pulse"), "train", "--pipeline", str(pipe), "--pp", "2", "--dp", "2",
           "--steps", str(args.steps), "--checkpoint-every", "200", "--checkpoints-total-limit", "2",
           "--ema", "0.999", "--sample-every", "500", "--sample-steps", "2", "--out-dir", str(out)]
    print(" ".join(cmd), flush=True)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    reached = {"step": 0}
    samples: dict[int, list[tuple[int, int]]] = {}
    tail: list[str] = []

    def read_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail[:] = (tail + [line])[-20:]
            for match in PROGRESS.finditer(line):
                reached["step"] = int(match.group(1))

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    start = time.time()
    while process.poll() is None:
        for rank, proc in rank_processes(process.pid).items():
            try:
                samples.setdefault(rank, []).append((reached["step"], proc.memory_info().rss))
            except Exception:  # a rank that just exited
                continue
        time.sleep(0.5)
    reader.join(timeout=5)
    seconds = time.time() - start
    if process.returncode != 0:
        print("".join(tail), file=sys.stderr)
        return 1
    warm = min(max(args.steps // 10, 500), args.steps // 2)  # after a checkpoint and a sample, or half a short run
    rows = []
    for rank, points in sorted(samples.items()):
        windows: dict[int, tuple[int, int]] = {}
        for step, rss in points:
            windows[step // args.every] = (step, rss)  # the last sample of each window
        kept = [(s, r) for s, r in windows.values() if s >= warm]
        slope = fit_slope(kept) if len(kept) >= 2 else float("nan")
        rows.append({"rank": rank, "samples": len(points), "windows_after_warmup": len(kept),
                     "rss_first_mb": kept[0][1] / 1e6 if kept else None, "rss_last_mb": kept[-1][1] / 1e6 if kept else None,
                     "slope_mb_per_100_steps": slope * 100 / 1e6,
                     "series": [[s, r] for s, r in sorted(windows.values())]})
    lines = ["| rank | RSS after warm-up (MB) | RSS at the end (MB) | slope (MB / 100 steps) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['rank']} | {r['rss_first_mb']:.1f} | {r['rss_last_mb']:.1f} | {r['slope_mb_per_100_steps']:+.3f} |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(cmd), "steps": args.steps, "warmup_steps": warm, "seconds": seconds,
              "target_mb_per_100_steps": 1.0, "ranks": rows}
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "soak.md").write_text(f"# Soak (`python benchmarks/soak.py --steps {args.steps}`)\n\n"
                                     f"{args.steps} steps in {seconds:.0f} s; slopes fitted after step {warm}.\n\n"
                                     + text + "\n")
    return 0 if all(abs(r["slope_mb_per_100_steps"]) < 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
