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


def test_materialized_stage_is_the_whole_models_stage_initialized_alike() -> None:
    """A stage cut from the meta skeleton and materialized alone (what an sd2 TP rank holds) has the
    whole model's stage's parameters, computes the same function once given its weights, and draws
    its weights as the UNet's constructor does (norms at 1 and 0, the rest at the same spread)."""
    from peer_stages import UNET_CONFIG, WORKAROUNDS, Stage, build_meta_model, materialize

    torch.set_num_threads(1)
    whole = build_model(0)
    units = unet_units(whole)
    cut = len(units) // 2
    reference = Stage(whole, units, cut, len(units))
    skeleton = build_meta_model(UNET_CONFIG)
    stage = materialize(Stage(skeleton, unet_units(skeleton), cut, len(units)), seed=3)
    mine, theirs = dict(stage.named_parameters()), dict(reference.named_parameters())
    assert {n: p.shape for n, p in mine.items()} == {n: p.shape for n, p in theirs.items()}
    assert sum(p.numel() for p in mine.values()) < sum(p.numel() for p in whole.parameters())
    assert not any(p.is_meta for p in mine.values())
    for name, p in mine.items():
        p, ref = p.detach(), theirs[name].detach()
        if bool((ref == ref.flatten()[0]).all()):  # a norm's weight or bias: the constructor's constant
            assert torch.equal(p, ref), name
        elif ref.numel() >= 256:
            assert 0.8 < float(p.std() / ref.std()) < 1.25, name
    again = materialize(Stage(skeleton, unet_units(skeleton), cut, len(units)), seed=3)
    assert all(torch.equal(p, q) for p, q in zip(stage.parameters(), again.parameters()))
    stage.load_state_dict(reference.state_dict())
    batch = make_batch(2, seed=5)
    head = Stage(whole, units, 0, cut, workarounds=WORKAROUNDS)
    with torch.no_grad():
        carried = head(batch.sample, timesteps=batch.timesteps, ctx=batch.ctx)
        assert torch.equal(stage(*carried, timesteps=batch.timesteps, ctx=batch.ctx),
                           reference(*carried, timesteps=batch.timesteps, ctx=batch.ctx))


def test_sd2_reuses_the_committed_profile_only_where_it_prices_the_model() -> None:
    from peer_models import committed_profile, peer_model

    reused, why = committed_profile(peer_model("sd2"), 2)
    assert reused is not None and reused[0].name == "costs.yaml", why
    assert committed_profile(peer_model("sd2", 64), 2)[0] is None  # another resolution: another model
    assert committed_profile(peer_model("sd2"), 4)[0] is None  # its links were measured on 2 ranks
    assert committed_profile(peer_model("small"), 2)[0] is None


def test_sd2_defaults_and_quick_reports_stay_out_of_the_results(tmp_path: Path) -> None:
    args = peer_pipelining.parse(["--model", "sd2"])
    model = args.peer_model
    assert (args.pp, model.microbatch_size, model.microbatches_for(2), model.latent) == ([2], 1, 2, 32)
    assert args.out.name == "peer_pipelining_sd2.json" and args.out.parent == peer_pipelining.RESULTS
    assert model.pulse_model_args(tmp_path)[-1] == "resolution=256"
    quick = peer_pipelining.parse(["--model", "sd2", "--quick", "--workdir", str(tmp_path)])
    assert quick.out.parent == tmp_path and quick.peer_model.latent == 8 and quick.steps == 1
    small = peer_pipelining.parse(["--workdir", str(tmp_path)])
    assert "--model-option" not in small.peer_model.pulse_model_args(tmp_path)  # today's commands, unchanged
    assert small.out.name == "peer_pipelining.json" and small.pp == [2, 4]
