"""How long `pulse tune` takes for SD v2 as the cluster grows: 2x8, 128x8 and 1,024x8 Ascend 910A.

Each case runs `pulse tune --model sd2-unet --cluster C --global-batch B --format json` as a
separate process (wall seconds, and the user seconds of it and its workers), with the host's
load average beside it: the machine is shared, so a figure means something only next to the
load it ran under and next to another run made in the same conditions. ``--label before
--code DIR`` times another copy of the code (a tree with ``pulse/`` and ``configs/``, e.g.
``git archive COMMIT pulse configs | tar -x -C DIR``, with the commit's name in ``DIR/COMMIT``)
under the same conditions.

    python benchmarks/tune_speed.py [--label after] [--code DIR] [--cases 2x8,128x8,1024x8]

Global batch: 256 on 2x8 (the headline's), one sample per device on the larger clusters
(1,024 and 8,192): at 256 the 8,192-device search has one shape left (pp 32, M 1).
The 128x8 and 1,024x8 clusters are the 2x8 one with more nodes, written to a temporary folder.
Prints a table and merges ``{label: rows}`` into benchmarks/results/tune_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "tune_speed.json"
CASES = {"2x8": (2, 256), "128x8": (128, 1024), "1024x8": (1024, 8192)}  # nodes, global batch
TARGETS = {"2x8": 15.0, "1024x8": 60.0}  # seconds, issue #43


def cluster_file(folder: Path, nodes: int) -> Path:
    path = folder / f"ascend-910a-{nodes}x8.yaml"
    path.write_text(f"name: ascend-910a-{nodes}x8\nhardware: ascend-910a\nnodes: {nodes}\n")
    return path


def time_case(code: Path, cluster: Path, batch: int, folder: Path) -> dict:
    """One `pulse tune` run in a child process, started from ``code`` (its ``pulse`` is imported)."""
    plan = folder / "plan.yaml"
    command = [sys.executable, "-c", "import sys; from pulse.cli.main import main; sys.exit(main(sys.argv[1:]))",
               "tune", "--model", "sd2-unet", "--cluster", str(cluster), "--global-batch", str(batch),
               "--format", "json", "--out", str(plan)]
    env = dict(os.environ, PYTHONPATH=str(code))
    load_before = os.getloadavg()[0]
    user_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    started = time.monotonic()
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    user = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - user_before
    if done.returncode:
        raise SystemExit(f"pulse tune failed ({cluster.name}): {done.stderr.strip().splitlines()[-1]}")
    report = json.loads(done.stdout)
    winner = report["winner"]
    return {"wall_s": round(wall, 2), "user_s": round(user, 2), "load_1min_before": round(load_before, 2),
            "load_1min_after": round(os.getloadavg()[0], 2), "search_seconds": round(report["search_seconds"], 2),
            "counts": report["counts"], "winner": winner["label"],
            "winner_step_ms": round(winner["step_seconds"] * 1e3, 3)}


def commit_of(code: Path) -> str:
    """The commit a tree holds: its COMMIT file (an archived copy), else git's HEAD (uncommitted edits unseen)."""
    marker = code / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after", help="the key the rows are stored under")
    parser.add_argument("--code", type=Path, default=ROOT, help="a tree whose pulse/ to time (default: this one)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.cases.split(","):
            nodes, batch = CASES[name]
            rows[name] = dict(time_case(args.code.resolve(), cluster_file(folder, nodes), batch, folder),
                              global_batch=batch, devices=nodes * 8)
            row = rows[name]
            print(f"{args.label:>8} {name:>7} B={batch:<5} {row['wall_s']:7.2f} s wall {row['user_s']:7.2f} s user  "
                  f"load {row['load_1min_before']:.2f}->{row['load_1min_after']:.2f}  "
                  f"target {TARGETS.get(name, '-')}  winner {row['winner']}", flush=True)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results[args.label] = {"code": str(args.code), "commit": commit_of(args.code.resolve()), "cases": rows,
                           "uptime": os.popen("uptime").read().strip()}
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
