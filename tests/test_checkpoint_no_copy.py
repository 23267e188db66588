"""A rank's checkpoint is written from its own tensors: no second copy of the weights, AdamW state or EMA.

::

    rank_payload ─ params, optimizer moments, EMA: the live tensors (detached), not .cpu().clone()s
        ─ torch.save writes each where it lies (a device one: copied to the host storage by storage)

Checked by catching the payload torch.save is handed: every tensor in it shares memory with the
one training uses. The round trip (resume equals the uninterrupted run) is test_checkpoint / test_ema's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_ema import zoo_unet  # noqa: E402

from pulse.train.loop import StepSettings  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402


def test_the_payload_holds_the_live_tensors_not_copies(tmp_path: Path, monkeypatch) -> None:
    job = zoo_unet(StepSettings(lr=1e-3, ema=0.9))
    job.train(0, 1)
    payloads: list[dict] = []
    save = torch.save

    def caught(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj:
            payloads.append(obj)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", caught)
    where = job.save(tmp_path, 1)
    assert len(payloads) == 2
    live = {n: p for s in job.shards() for n, p in s.parameters().items()}
    states = {n: chunk.optimizer.state[p] for chunk in job.chunks for n, p in job.backend.parameters(chunk).items()}
    saved = {n: t for payload in payloads for n, t in payload["params"].items()}
    assert saved.keys() == live.keys() and len(saved) > 10
    assert all(saved[n].data_ptr() == live[n].data_ptr() for n in live)
    moments = {n: st for payload in payloads for n, st in payload["optimizer"].items()}
    assert all(moments[n][k].data_ptr() == states[n][k].data_ptr() for n in moments for k in ("exp_avg", "exp_avg_sq"))
    ema = {n: t for payload in payloads for n, t in payload["ema"].items()}
    assert ema.keys() == live.keys() and all(ema[n].data_ptr() == job.backend.ema[n].data_ptr() for n in ema)
    merged = checkpoint.merge_weights(where, 1)  # and the file holds their values
    assert all(torch.equal(merged[n], live[n]) for n in live)
