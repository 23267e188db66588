"""Images and captions in, a diffusers pipeline out, through the real commands (65-85 s on a shared core).

::

    tiny SD pipeline + 6 captioned PNGs ─ the cache encoder (in process) ─ pulse train --diffusers-config PIPE/unet
    --data CACHE --pp 2 --steps 2 --checkpoint-every 2 ─ the same --steps 3 --resume --save-final
    ─ pulse export ─ DiffusionPipeline.from_pretrained ─ a 2-step image

Checked: the resumed run continues (steps 0-2 in its log, no error: the resume bug of diffusers models),
the exported backbone's weights equal the checkpoint's (and differ from the untrained ones), the other
parts are the input pipeline's, and the pipeline samples an image; bad checkpoints are one line, exit 2.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import RESOLUTION, image_folder, pipeline_fixture  # noqa: E402
from pulse_torch.checkpoint import merge_weights  # noqa: E402
from pulse_torch.cache_latents import main as cache_main  # noqa: E402
from pulse_torch.export import main as export_main  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def pulse(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"pulse {args[0]}: {done.stderr[-3000:]}"
    return done


def train(pipe: Path, cache: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    return pulse("train", "--diffusers-config", str(pipe / "unet"), "--data", str(cache), "--pp", "2",
                 "--microbatch-size", "1", "--schedule", "gpipe", "--out-dir", str(run), *extra)


@pytest.fixture(scope="module")
def exported(pipeline: Path, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("finetune")
    images, cache, run, out = image_folder(root / "images", 6), root / "cache", root / "run", root / "exported"
    assert cache_main(["--pipeline", str(pipeline), "--images", str(images), "--out", str(cache)]) == 0  # in process
    assert json.loads((cache / "manifest.json").read_text())["complete"]
    train(pipeline, cache, run, "--steps", "2", "--checkpoint-every", "2")
    resumed = train(pipeline, cache, run, "--steps", "3", "--resume", "--save-final")
    assert "resume: step 2 from" in resumed.stdout
    log = json.loads((run / "log.json").read_text())
    assert [s["step"] for s in log["steps"]] == [0, 1, 2] and "latent cache: 6 images" in log["run"]["data"]
    step = run / "checkpoints" / "step-3"
    pulse("export", "--checkpoint", str(step), "--pipeline", str(pipeline), "--out", str(out))
    return run, out


def test_the_exported_pipeline_holds_the_trained_backbone(pipeline: Path, exported) -> None:
    run, out = exported
    assert not list(out.parent.glob(".exported.tmp*"))  # built aside, renamed whole
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    pipe = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    trained = merge_weights(run / "checkpoints" / "step-3", 3)
    final = torch.load(run / "final_weights.pt", weights_only=True)
    params = dict(pipe.unet.named_parameters())
    assert set(params) == set(trained) == set(final)
    assert all(torch.equal(params[n], trained[n]) and torch.equal(trained[n], final[n]) for n in params)
    before = diffusers.UNet2DConditionModel.from_pretrained(pipeline / "unet", local_files_only=True)
    moved = [n for n, p in before.named_parameters() if not torch.equal(p, params[n])]
    assert len(moved) > len(params) // 2  # three AdamW steps moved the weights
    original = diffusers.DiffusionPipeline.from_pretrained(pipeline, local_files_only=True)
    for part in ("vae", "text_encoder"):
        a, b = getattr(pipe, part).state_dict(), getattr(original, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    image = pipe("a red cat", num_inference_steps=2, height=RESOLUTION, width=RESOLUTION, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, RESOLUTION, RESOLUTION, 3) and np.isfinite(image).all()


def test_export_refuses_incomplete_or_foreign_checkpoints_in_one_line(pipeline: Path, exported, tmp_path: Path,
                                                                       capsys) -> None:
    run, out = exported
    broken = tmp_path / "step-3"
    shutil.copytree(run / "checkpoints" / "step-3", broken)
    (broken / "manifest.json").unlink()
    cases = [(["--checkpoint", str(broken)], "not a complete checkpoint: no manifest"),
             (["--checkpoint", str(tmp_path / "none")], "no folder"),
             (["--checkpoint", str(run / "checkpoints" / "step-3"), "--out", str(out)], "exists"),
             (["--checkpoint", str(run / "checkpoints"), "--pipeline", str(tmp_path)], "no model_index.json")]
    for args, says in cases:
        argv = {"--pipeline": str(pipeline), "--out": str(tmp_path / "new"), **dict(zip(args[::2], args[1::2]))}
        assert export_main([w for kv in argv.items() for w in kv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "new").exists()
