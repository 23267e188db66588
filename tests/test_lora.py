"""LoRA (``--lora-rank``) on the tiny offline SD pipeline's UNet, PyTorch backend.

::

    pipelined gradients (pp 2, 1F1B and zero-bubble V) == model(...) with the same peft adapters, one device
    a pipelined step                                    changes the adapters, not one base weight
    4 steps == 2 + checkpoint + fresh model + load + 2  (adapters, AdamW state, EMA: bit for bit)
    export_lora ─ pytorch_lora_weights.safetensors      pipe.load_lora_weights(OUT) computes what training did
    export_lora(fused) ─ a whole pipeline folder        its plain UNet computes base + adapters (fp32, 1e-6)
    write_samples(lora=...)                             draws with the checkpoint's adapters on the base UNet
    bad flags                                           one line (RunConfig; MindSpore before launch)
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from pipeline_helpers import pipeline_fixture  # noqa: E402
from test_ema import Pipelined, resumed_equals_uninterrupted  # noqa: E402

from pulse_mindspore.traits import check_options  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.errors import PulseError, SpecError  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import StepSettings  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402
from pulse_torch.diffusers_adapter import from_diffusers, load_diffusers, load_model  # noqa: E402
from pulse_torch.diffusers_adapter.lora import WEIGHT_NAME, LoraSettings, add_lora, export_lora  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from torch_worker_check import make_batches, max_relative_error  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
LORA = LoraSettings.of(4, 8.0)  # alpha != rank: the scale 2 must survive export
M = 4  # microbatches of one sample


def lora_adapter(pipeline: Path, dtype: torch.dtype = torch.float32, seed: int = 0):
    model = load_model(pipeline / "unet", dtype=dtype)
    adapter = from_diffusers(model)
    add_lora(adapter, LORA, seed)
    return adapter


def lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def nonzero_b(model) -> None:
    """lora_B starts at zero (then lora_A's gradient is zero too): seeded values make both gradients real."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_params(model).items():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("schedule,placement_kind", [("1f1b", "sequential"), ("zero_bubble_v", "v")])
def test_pipelined_lora_gradients_equal_single_device_peft(pipeline: Path, schedule: str,
                                                           placement_kind: str) -> None:
    ref = lora_adapter(pipeline, torch.float64)
    nonzero_b(ref.model)
    ref.model.zero_grad(set_to_none=True)
    batches, total = make_batches(ref.spec, 1), 0.0
    for mb in range(M):
        out = ref.call_model(batches(mb))
        loss, grad = eps_loss({"h": out}, batches(mb))
        out.backward(grad["h"] / M)
        total += float(loss)
    want = {n: p.grad.numpy().copy() for n, p in lora_params(ref.model).items()}
    assert all(p.grad is None for p in ref.model.parameters() if not p.requires_grad)  # the base is frozen

    adapter = lora_adapter(pipeline, torch.float64)
    nonzero_b(adapter.model)
    spec = adapter.spec.with_act_bytes(8)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    placement = partition("sequential", spec, costs, 2) if placement_kind == "sequential" else \
        partition("pulse", spec, costs, 2, folds=1)
    program = lower(make_schedule(schedule, placement, M), spec, placement)
    run = local_run(spec, placement, program, adapter.backend(), make_batches(spec, 1), eps_loss)
    run.step()
    got = {n: g.numpy() for n, g in run.gradients().items()}
    # 4 transformer blocks x (attn1, attn2) x 4 projections x (A, B): the adapters and nothing else
    assert got.keys() == want.keys() and len(got) == 4 * 2 * 4 * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in got)
    assert min(float(abs(g).max()) for g in want.values()) > 0
    assert max_relative_error(got, want) < 1e-10
    assert run.loss() == pytest.approx(total / M, rel=1e-12)


def lora_job(pipeline: Path, settings: StepSettings):
    adapter = lora_adapter(pipeline)
    return Pipelined(f"diffusers:{pipeline / 'unet'}", lambda: adapter.backend(lr=1e-3), adapter.spec,
                     settings), adapter


def test_a_step_trains_the_adapters_and_not_the_base(pipeline: Path) -> None:
    job, adapter = lora_job(pipeline, StepSettings(lr=1e-3))
    base = {n: p.detach().clone() for n, p in adapter.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in lora_params(adapter.model).items()}
    job.train(0, 1)
    assert [n for n, p in adapter.model.named_parameters() if n in base and not torch.equal(p, base[n])] == []
    changed = [n for n, p in lora_params(adapter.model).items() if not torch.equal(p, before[n])]
    assert sorted(changed) == sorted(n for n in before if ".lora_B." in n)  # B moves first (A's grad is 0 at B=0)
    opt_params = sum(len(g["params"]) for c in job.chunks for g in c.optimizer.param_groups)
    assert opt_params == len(before)  # AdamW holds state for the adapters only


def test_resume_keeps_the_adapters_their_adamw_and_ema(pipeline: Path, tmp_path: Path) -> None:
    make = lambda: lora_job(pipeline, StepSettings(lr=1e-3, ema=0.999))[0]  # noqa: E731
    agreed = resumed_equals_uninterrupted(make, tmp_path)
    saved = checkpoint.merge_weights(tmp_path / "whole" / "step-4", 4)
    assert agreed == len(saved) == 64 and all(".lora_" in n for n in saved)  # the base is not in checkpoints


def test_export_writes_lora_weights_that_load_lora_weights_loads(pipeline: Path, tmp_path: Path) -> None:
    job, adapter = lora_job(pipeline, StepSettings(lr=1e-2))
    job.train(0, 2)
    where = job.save(tmp_path / "ckpt", 2)
    out = tmp_path / "lora"
    said = export_lora(str(pipeline), checkpoint.merge_weights(where, 2), LORA, out, str(where))
    assert (out / WEIGHT_NAME).is_file() and "LoRA rank 4" in said
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
    plain = load_diffusers(f"diffusers:{pipeline / 'unet'}")  # the base UNet without adapters
    pipe.load_lora_weights(str(out))
    batch = make_batches(adapter.spec, 1)(0)
    with torch.no_grad():
        trained = adapter.call_model(batch)
        loaded = call_unet_of(pipe.unet, adapter, batch)
        base = plain.call_model(batch)
    assert float((trained - base).abs().max()) > 1e-4  # the adapters change the output...
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)  # ...and load as they trained
    with pytest.raises(PulseError, match="do not match --lora-rank 8"):
        export_lora(str(pipeline), checkpoint.merge_weights(where, 2), LoraSettings.of(8), tmp_path / "x", "ckpt")


def test_kohya_export_loads_in_diffusers_as_the_same_unet(pipeline: Path, tmp_path: Path) -> None:
    """``--lora-format kohya``: lora_unet_* keys with lora_down / lora_up / alpha (sd-scripts' networks/lora.py,
    A1111 and ComfyUI), which diffusers' load_lora_weights converts: the same UNet as the diffusers export."""
    from safetensors import safe_open

    job, adapter = lora_job(pipeline, StepSettings(lr=1e-2))
    nonzero_b(adapter.model)
    job.train(0, 1)
    where = job.save(tmp_path / "ckpt", 1)
    weights = checkpoint.merge_weights(where, 1)
    kohya = LoraSettings.of(LORA.rank, LORA.alpha, file_format="kohya")
    said = export_lora(str(pipeline), weights, kohya, tmp_path / "kohya", str(where))
    assert "kohya's lora_unet_* keys" in said
    with safe_open(str(tmp_path / "kohya" / WEIGHT_NAME), "pt") as f:
        keys = set(f.keys())
        assert float(f.get_tensor(sorted(k for k in keys if k.endswith(".alpha"))[0])) == LORA.alpha
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    assert {k.rsplit(".", 2)[-2] if k.endswith(".weight") else "alpha" for k in keys} == {"lora_down", "lora_up",
                                                                                          "alpha"}
    assert len(keys) == 3 * len(weights) // 2  # down, up and alpha for each adapted module
    export_lora(str(pipeline), weights, LORA, tmp_path / "peft", str(where))
    unets = {}
    for name in ("kohya", "peft"):
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
        pipe.load_lora_weights(str(tmp_path / name))
        pipe.fuse_lora()
        unets[name] = {n.replace(".base_layer", ""): p.detach() for n, p in pipe.unet.named_parameters()
                       if "lora" not in n}
    base = dict(load_model(pipeline / "unet").named_parameters())
    moved = [n for n, p in unets["peft"].items() if not torch.equal(p, base[n])]
    assert moved and all(".to_" in n for n in moved)  # the adapters fused into their projections
    assert unets["kohya"].keys() == unets["peft"].keys()
    for n, p in unets["peft"].items():
        torch.testing.assert_close(unets["kohya"][n], p, rtol=1e-6, atol=1e-7)


def test_fuse_exports_a_pipeline_whose_unet_computes_base_plus_adapters(pipeline: Path, tmp_path: Path,
                                                                       capsys) -> None:
    from pulse_torch.train import publish

    job, adapter = lora_job(pipeline, StepSettings(lr=1e-2))
    nonzero_b(adapter.model)  # adapters far from zero: the fused weights differ from the base's
    job.train(0, 1)
    job.save(tmp_path / "run" / "checkpoints", 1)
    out = tmp_path / "fused"
    config = RunConfig(steps=1, pipeline=str(pipeline), lora_rank=LORA.rank, lora_alpha=LORA.alpha, export=str(out),
                       fuse=True)
    publish(config, tmp_path / "run")  # what rank 0 does after the last checkpoint of `--export DIR --fuse`
    assert f"export: wrote {out}: unet/ with LoRA rank 4" in capsys.readouterr().out
    assert not (out / WEIGHT_NAME).exists()
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(out), local_files_only=True)
    assert not [n for n, _ in pipe.unet.named_parameters() if "lora" in n]  # a plain UNet, adapters merged
    plain = load_diffusers(f"diffusers:{pipeline / 'unet'}")
    batch = make_batches(adapter.spec, 1)(0)
    with torch.no_grad():
        trained = adapter.call_model(batch)  # base + (alpha / R) B A, unmerged, in fp32
        fused = call_unet_of(pipe.unet, adapter, batch)
        base = plain.call_model(batch)
    assert float((trained - base).abs().max()) > 1e-2
    torch.testing.assert_close(fused, trained, rtol=1e-6, atol=1e-6)  # merged W + sBA rounds once more


def test_samples_draw_with_the_trained_adapters(pipeline: Path, tmp_path: Path, monkeypatch) -> None:
    import numpy as np
    from PIL import Image

    from pulse_torch.pipeline import samples

    from pulse_torch.train import sampler_hook

    job, adapter = lora_job(pipeline, StepSettings(lr=1e-2))
    job.save(tmp_path / "fresh", 1)  # lora_B = 0: the adapters change nothing yet
    nonzero_b(adapter.model)
    job.train(0, 1)
    trained = job.save(tmp_path / "trained", 1)

    def pixels(paths: list[Path]) -> np.ndarray:
        assert [p.name for p in paths] == ["step-1-0.png", "step-1-1.png"]
        return np.stack([np.asarray(Image.open(p)) for p in paths])

    def draw(checkpoints: str) -> np.ndarray:  # as rank 0 does at `--sample-every` with `--lora-rank`
        config = RunConfig(pipeline=str(pipeline), lora_rank=LORA.rank, lora_alpha=LORA.alpha, sample_every=1,
                           sample_prompt=["a red cat"], sample_steps=2, checkpoint_dir=str(tmp_path / checkpoints))
        sampler_hook(config, tmp_path / f"run-{checkpoints}", "cpu")(1)
        return pixels(sorted((tmp_path / f"run-{checkpoints}" / "samples").glob("step-1-*.png")))

    with_adapters, zero_adapters = draw("trained"), draw("fresh")
    unet = diffusers.UNet2DConditionModel.from_pretrained(str(pipeline / "unet"), local_files_only=True)
    monkeypatch.setattr(samples, "trained_weights", lambda where, step, ema: dict(unet.named_parameters()))
    base = pixels(samples.write_samples(str(pipeline), trained, 1, tmp_path / "base", ["a red cat"], 2, 0))
    assert np.array_equal(zero_adapters, base)  # sampling with adapters adds nothing of its own...
    assert not np.array_equal(with_adapters, base)  # ...and draws with what they learned


def call_unet_of(unet, adapter, batch):
    from pulse_torch.diffusers_adapter.unet import call_unet

    return call_unet(unet, {k: v.to(dtype=adapter.dtype) if v.is_floating_point() else v for k, v in batch.items()})


def test_bad_lora_flags_are_one_line(pipeline: Path, tmp_path: Path) -> None:
    with pytest.raises(PulseError, match="--lora-rank needs --pipeline"):
        RunConfig(lora_rank=4)
    with pytest.raises(PulseError, match="give --lora-rank R too"):
        RunConfig(lora_alpha=8.0, pipeline=str(pipeline))
    with pytest.raises(PulseError, match="--fuse merges a LoRA run's adapters"):
        RunConfig(fuse=True, export=str(tmp_path / "x"), pipeline=str(pipeline))
    with pytest.raises(PulseError, match="--fuse merges a LoRA run's adapters"):
        RunConfig(fuse=True, lora_rank=4, pipeline=str(pipeline))
    with pytest.raises(PulseError, match="--lora-rank 4 is not supported with --backend mindspore"):
        check_options(RunConfig(lora_rank=4, pipeline=str(pipeline)))
    adapter = from_diffusers(load_model(pipeline / "unet"))
    with pytest.raises(SpecError, match="--lora-targets to_nothing"):
        add_lora(adapter, LoraSettings.of(4, targets="to_nothing"), 0)
    assert LoraSettings.of(4) == LoraSettings(4, 4.0, ("to_q", "to_k", "to_v", "to_out.0"))


def test_pulse_train_lora_pp2_dp2_exports_loadable_weights(pipeline: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    run, out = tmp_path / "run", tmp_path / "lora"
    done = subprocess.run(
        [sys.executable, "-m", "pulse.cli.main", "train", "--pipeline", str(pipeline), "--pp", "2", "--dp", "2",
         "--microbatch-size", "1", "--steps", "2", "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8",
         "--export", str(out), "--out-dir", str(run)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = checkpoint.merge_weights(run / "checkpoints" / "step-2", 2)
    assert len(saved) == 64 and all(".lora_" in n for n in saved)  # each rank saved its chunks' adapters
    from safetensors.torch import load_file

    written = load_file(str(out / WEIGHT_NAME))
    assert len(written) == 64 and all(n.startswith("unet.") for n in written)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True)
    pipe.load_lora_weights(str(out))
    loaded = {n: p for n, p in pipe.unet.named_parameters() if ".lora_" in n}
    by_trained = {n.replace(".default.", ".default_0."): t for n, t in saved.items()}
    assert loaded.keys() == by_trained.keys()
    assert all(torch.equal(loaded[n], by_trained[n]) for n in loaded)


def test_pulse_export_of_a_lora_checkpoint_is_one_line(pipeline: Path, tmp_path: Path) -> None:
    from pulse.train.checkpoints import CheckpointError
    from pulse_torch.export import export_step
    from pulse.data.pipeline_folder import read_pipeline

    job, _ = lora_job(pipeline, StepSettings(lr=1e-3))
    job.train(0, 1)
    where = job.save(tmp_path / "ckpt", 1)
    with pytest.raises(CheckpointError, match="a LoRA run's checkpoint"):
        export_step(read_pipeline(pipeline), 1, where, tmp_path / "out")
