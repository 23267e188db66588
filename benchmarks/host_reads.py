"""How often a training step makes the host wait for the device, under a fake ProcessGroupNCCL.

    .venv/bin/python benchmarks/host_reads.py [--source DIR] [--label NAME]

Every rank of a tiny-unet greedy V 1F1B plan is a thread running the real ``pulse_torch``
communicator and training step (``build_job`` + ``train_step``) over ``tests/fake_nccl.py``
(NCCL's point-to-point rules, ``pulse.runtime.rendezvous``). Counted per rank and step, as a
device would stall the host: reads of a tensor's value on the host (``.cpu()``, ``.item()``,
``.tolist()``, ``.numpy()``, ``float()``; torch.optim's host-resident step counters excluded)
and waits given a timeout (ProcessGroupNCCL then polls from the host instead of ordering the
stream). Two steps: the first sends each message class's one header.

``--source DIR`` runs another checkout's ``pulse`` and ``pulse_torch`` under the same fake (this
file's ``fake_nccl.py``, ``test_device_messages.py`` and ``pulse/runtime/rendezvous.py`` are
copied into it): code before the process group per direction hangs under NCCL's rules, so there
messages are buffered whatever their size (``eager_bytes`` huge) and share one group, as it ran.
Writes benchmarks/results/host_reads.json (``--label`` names the row).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = [(2, 4), (2, 8), (4, 8), (4, 16)]  # (pp, microbatches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="a checkout of PULSE (default: this one)")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    if source != ROOT:  # the fake and the counting test harness travel with this file
        for rel in ("tests/fake_nccl.py", "tests/test_device_messages.py", "pulse/runtime/rendezvous.py"):
            shutil.copy(ROOT / rel, source / rel)
    sys.path[:0] = [str(source / "tests"), str(source / "backends"), str(source)]
    from _pytest.monkeypatch import MonkeyPatch

    import test_device_messages as harness

    new_layout = source == ROOT
    rows = []
    print(f"{'plan':<14} {'rank':>4} {'reads step 0':>13} {'reads step 1':>13} {'host waits step 1':>18}")
    for pp, microbatches in CASES:
        patch = MonkeyPatch()
        try:
            _, per_step, errors = harness.run_ranks(patch, harness.tiny_plan(pp, "greedy_v_1f1b", microbatches),
                                                    steps=2, per_direction=new_layout,
                                                    eager_bytes=0 if new_layout else 1 << 40)
        finally:
            patch.undo()
        if any(errors):
            raise SystemExit(f"pp{pp} M={microbatches}: {next(e for e in errors if e)!r}")
        for rank in range(pp):
            row = {"label": args.label, "pp": pp, "microbatches": microbatches, "rank": rank,
                   "host_reads": [per_step[s][(rank, "host reads")] for s in range(2)],
                   "host_waits": [per_step[s][(rank, "host waits")] for s in range(2)]}
            rows.append(row)
            print(f"pp{pp} M={microbatches:<8} {rank:>4} {row['host_reads'][0]:>13} {row['host_reads'][1]:>13} "
                  f"{row['host_waits'][1]:>18}")
    out = HERE / "results" / "host_reads.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[args.label] = rows
    out.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
