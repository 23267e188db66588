"""Cross-backend parity over real processes: the same pp 2 plan trained by torchrun (gloo) and msrun (gloo + mccl).

``benchmarks/parity.py --processes`` with 2 steps instead of 20, on
tiny-uvit (MindSpore PyNative's CPU convolutions make a tiny-unet step 5-30 s
here; the UNet's layers are compared across the frameworks in
tests/test_mindspore_layers.py and its msrun pipeline against one process in
tests/test_backend_processes.py): pulse V at P = 2, greedy_v_1f1b, M = 2
microbatches of one sample, float32, the same weights and batches from
files. Step 1's loss comes before any update (only float summation order
differs between the frameworks); step 2's after one AdamW step on gradients
that crossed processes, so a wrong gradient, a lost message or a mismatched
weight moves it far beyond float32 rounding (measured: equal losses). About
30 s on 2 shared cores, both launches included. Skipped without MindSpore,
torch or msrun.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")
pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
STEPS = 2
TOL = 1e-5  # relative; measured 1e-7 .. 4e-7 (float32 rounding of sums taken in another order)


def test_torch_and_mindspore_processes_train_the_same_losses(tmp_path: Path) -> None:
    if not (Path(sys.executable).parent / "msrun").exists():
        pytest.skip(f"no msrun next to {sys.executable}")
    sys.path.insert(0, str(BENCH))
    try:
        from parity_processes import print_table, run_processes
    finally:
        sys.path.remove(str(BENCH))
    report = run_processes("tiny-uvit", STEPS, tmp_path, timeout=900)
    print_table(report)
    torch_loss, ms_loss = report["torch_loss"], report["mindspore_loss"]
    assert len(torch_loss) == len(ms_loss) == STEPS
    assert all(math.isfinite(x) and 0.1 < x < 10 for x in torch_loss + ms_loss)
    assert report["carriers"] == {"torch": "gloo", "mindspore": "gloo"}
    assert torch_loss[0] != torch_loss[1]  # another batch and updated weights: the steps are not copies
    for step, (t, m) in enumerate(zip(torch_loss, ms_loss), start=1):
        assert abs(t - m) <= TOL * abs(t), f"step {step}: torch {t!r} vs mindspore {m!r}"
