"""What cheaper gradient communication would give the headline rows still far from their compute floor.

    python benchmarks/gradient_whatif.py [--rows sd2-unet:ascend-910a-2x8:32 ...] [--grad-bytes 2 1 0]

The headline (benchmarks/headline.py) all-reduces fp16 gradients, 2 bytes a parameter. Sharding them
(reduce-scatter, then each replica steps its shard and all-gathers the weights behind the next step's
forwards), 8-bit reductions or compression move fewer bytes after the last backward. Each row is tuned
again as the headline tunes it (every strategy, both SD v2 layerings, fitted layers) with the data-parallel
buckets priced at ``--grad-bytes`` bytes a parameter: 1 is a reduce-scatter of fp16 gradients (half a ring
all-reduce) with the all-gather hidden, 0 is gradient synchronisation that costs nothing, the most any such
scheme could give. Only the step's time is asked about: each rank's held gradients are priced at the same
bytes, which binds nowhere on these rows (4 GiB peaks against a 30 GiB budget). Each strategy's best is
printed beside its compute floor (``pulse.sim.floor``, at its own microbatching).

Writes benchmarks/results/gradient_whatif.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from pulse.hardware import load_cluster
from pulse.sim.memory import MemoryModel
from pulse.tune.tuner import TuneRequest, default_budget, tune
from pulse.zoo import get_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headline import LAYERINGS, STRATEGIES, _floor_of, one_f_one_b_only  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = ("sd2-unet:ascend-910a-2x8:32",)


def best_by_strategy(model: str, cluster_name: str, batch: int, grad_bytes: int) -> dict[str, dict]:
    """Each strategy's fastest over the model's layerings, with gradients priced at ``grad_bytes``."""
    cluster = load_cluster(cluster_name)
    floor_spec = get_spec(model)  # the floor is the work at the model's blocks, as the headline prices it
    memory = replace(MemoryModel(), grad_bytes=grad_bytes)
    best: dict[str, dict] = {}
    for options in LAYERINGS.get(model, {"blocks": {}}).values():
        spec = get_spec(model, **options)
        fit = (lambda split, o=options: get_spec(model, **{**o, **split})) if options else None
        result = tune(TuneRequest(spec, cluster, batch, default_budget(cluster), memory=memory),
                      keep_best_of=one_f_one_b_only, fit_layers=fit)
        for strategy in STRATEGIES:
            e = result.best_by_strategy.get(strategy)
            if e is None or (strategy in best and best[strategy]["step_s"] <= e.iteration_time):
                continue
            c = e.candidate
            parts = e.breakdown.parts() if e.breakdown is not None else {}
            best[strategy] = {"label": c.label, "step_s": e.iteration_time, "breakdown_s": parts,
                              **_floor_of(floor_spec, cluster, c.microbatch_size, c.pp, c.num_microbatches,
                                          e.iteration_time)}
    return best


def markdown(rows: list[dict]) -> str:
    lines = ["| row | gradient bytes / parameter | strategy | best (ms) | vs floor | exposed all-reduce (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for strategy, v in row["strategies"].items():
            exposed = v["breakdown_s"].get("exposed_allreduce")
            lines.append(f"| {row['row']} | {row['grad_bytes']} | {strategy}: {v['label']} | {v['step_s'] * 1e3:.1f} | "
                         f"{v['step_over_floor']:.3f}x | {'-' if exposed is None else f'{exposed * 1e3:.1f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="model:cluster:global batch")
    parser.add_argument("--grad-bytes", nargs="+", type=int, default=[2, 1, 0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gradient_whatif.json")
    args = parser.parse_args(argv)
    rows = []
    for text in args.rows:
        model, cluster_name, batch = text.split(":")
        for grad_bytes in args.grad_bytes:
            started = time.monotonic()
            strategies = best_by_strategy(model, cluster_name, int(batch), grad_bytes)
            rows.append({"row": text, "grad_bytes": grad_bytes, "strategies": strategies,
                         "seconds": round(time.monotonic() - started, 1)})
            print(f"{text} at {grad_bytes} B/parameter: tuned in {rows[-1]['seconds']} s", flush=True)
    print(markdown(rows))
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
