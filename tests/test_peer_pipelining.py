"""benchmarks/peer_pipelining.py's quick mode: torch.distributed.pipelining's 1F1B on two gloo processes
trains the hand-cut UNet stages to the losses one process computes from the same stages."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peer_pipelining  # noqa: E402
from peer_stages import build_model, make_batch, reference_losses, stages_for, unet_units  # noqa: E402


def test_quick_mode_tp_1f1b_equals_one_process_and_counts_bytes(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    assert peer_pipelining.main(["--quick", "--tp-only", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [row] = report["groups"]
    [tp] = row["tp"]
    assert tp["schedule"] == "1f1b" and tp["error"] is None
    assert all(b > 0 for b in tp["bytes"]) and tp["median_s"] > 0
    cuts = report["calibration"]["2"]["cuts"]["2"]
    torch.set_num_threads(1)
    model = build_model(0)
    losses, _ = reference_losses(stages_for(model, unet_units(model), cuts), make_batch(2 * 4, seed=0), 4)
    assert tp["first_losses"] == pytest.approx(losses, rel=1e-6, abs=1e-7)  # step 0: the same weights
    # one boundary, forward activations and backward gradients of 4 microbatches, every step
    per_microbatch = report["calibration"]["2"]["boundary_bytes_per_microbatch"][0]
    assert tp["bytes"][0] == 2 * 4 * per_microbatch
    assert out.with_suffix(".md").read_text().count("| 2 | free | TP 1f1b |") == 1
