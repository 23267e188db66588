"""Validation images users can read: per-prompt seed, negative prompt, guidance scale and steps, kohya's
prompt files, and the images in TensorBoard beside the scalars.

::

    kohya line  'a cat --n blurry --s 30 --l 7.5 --d 1234 --w 512 --h 512'  == sd-scripts' line_to_prompt_dict
                (its code, verbatim below, as the reference); an option PULSE does not draw with: one line
    write_samples   the same seed draws the same images twice, another seed others; the negative prompt,
                    guidance scale and steps reach the pipeline: its images == diffusers' own pipeline called
                    with the same arguments (the tiny SD pipeline)
    TensorBoard     the PNGs as image summaries, read back with tensorboard's EventAccumulator
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pulse.args.run_args import rank_entry_parser, run_config_of
from pulse.errors import PulseError
from pulse.train.validation_prompts import (ValidationPrompt, parse_prompt_line, read_prompt_file,
                                            validation_prompts)


def kohya_line_to_prompt_dict(line: str) -> dict:
    """kohya-ss/sd-scripts library/train_util.py line_to_prompt_dict (Apache-2.0), the options PULSE draws
    with, verbatim but for the logger."""
    prompt_args = line.split(" --")
    prompt_dict = {}
    prompt_dict["prompt"] = prompt_args[0]
    for parg in prompt_args:
        try:
            m = re.match(r"w (\d+)", parg, re.IGNORECASE)
            if m:
                prompt_dict["width"] = int(m.group(1))
                continue
            m = re.match(r"h (\d+)", parg, re.IGNORECASE)
            if m:
                prompt_dict["height"] = int(m.group(1))
                continue
            m = re.match(r"d (\d+)", parg, re.IGNORECASE)
            if m:
                prompt_dict["seed"] = int(m.group(1))
                continue
            m = re.match(r"s (\d+)", parg, re.IGNORECASE)
            if m:  # steps
                prompt_dict["sample_steps"] = max(1, min(1000, int(m.group(1))))
                continue
            m = re.match(r"l ([\d\.]+)", parg, re.IGNORECASE)
            if m:  # scale
                prompt_dict["scale"] = float(m.group(1))
                continue
            m = re.match(r"n (.+)", parg, re.IGNORECASE)
            if m:  # negative prompt
                prompt_dict["negative_prompt"] = m.group(1)
                continue
        except ValueError:
            pass
    return prompt_dict


KOHYA_NAMES = {"prompt": "prompt", "negative_prompt": "negative_prompt", "sample_steps": "steps",
               "scale": "guidance_scale", "seed": "seed", "width": "width", "height": "height"}


@pytest.mark.parametrize("line", [
    "a castle --n blurry, ugly --s 30 --l 7.5 --d 1234 --w 512 --h 768",
    "masterpiece, a red cat on a mat",
    "a dog --d 7",
    "a dog --s 5000 --l 12 --W 640",  # steps kept in 1..1000 as kohya; option letters in either case
    "a dog --n low quality --l 0.5",
])
def test_a_prompt_line_reads_as_kohyas_sample_prompts(line: str) -> None:
    theirs = {KOHYA_NAMES[k]: v for k, v in kohya_line_to_prompt_dict(line).items()}
    ours = parse_prompt_line(line)
    assert {k: v for k, v in vars(ours).items() if v is not None} == theirs


@pytest.mark.parametrize("line, says", [
    ("a dog --ss euler_a", "'--ss euler_a' is not one PULSE draws with"),
    ("a dog --s many", "needs a number after --s"),
    ("a dog --w 4", "width 4 is outside 8..16384"),
    ("a dog --d -5", "seed -5 is outside 0..2^63-1"),
])
def test_a_line_pulse_cannot_draw_is_one_line(line: str, says: str) -> None:
    with pytest.raises(PulseError, match=re.escape(says)) as caught:
        parse_prompt_line(line, "prompts.txt:3")
    assert str(caught.value).startswith("prompts.txt:3: ") and "\n" not in str(caught.value)


def test_prompt_files_txt_and_json_and_the_runs_defaults(tmp_path: Path) -> None:
    txt = tmp_path / "prompts.txt"
    txt.write_text("# validation prompts\n\na red cat --d 5\n  \na blue dog --n green --l 3\n")
    assert read_prompt_file(txt) == [ValidationPrompt("a red cat", seed=5),
                                     ValidationPrompt("a blue dog", negative_prompt="green", guidance_scale=3.0)]
    js = tmp_path / "prompts.json"
    js.write_text(json.dumps(["a cat --s 4", {"prompt": "a dog", "scale": 2.5, "sample_steps": 3, "seed": 1}]))
    assert read_prompt_file(js) == [ValidationPrompt("a cat", steps=4),
                                    ValidationPrompt("a dog", steps=3, guidance_scale=2.5, seed=1)]
    # the run's settings fill what a line leaves out; the line's own win
    merged = validation_prompts([], str(txt), negative_prompt="ugly", steps=9, guidance_scale=6.0, seed=11)
    assert merged == [ValidationPrompt("a red cat", "ugly", 9, 6.0, 5),
                      ValidationPrompt("a blue dog", "green", 9, 3.0, 11)]
    assert validation_prompts(["a", "b"], None, seed=2) == [ValidationPrompt("a", seed=2), ValidationPrompt("b", seed=2)]
    js.write_text(json.dumps([{"prompt": "a dog", "sampler": "ddim"}]))
    with pytest.raises(PulseError, match="unknown: sampler"):
        read_prompt_file(js)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(PulseError, match="no prompt in it"):
        read_prompt_file(tmp_path / "empty.txt")
    with pytest.raises(PulseError, match="cannot read it"):
        read_prompt_file(tmp_path / "missing.txt")


def test_the_validation_flags_reach_the_run_configuration() -> None:
    args = rank_entry_parser("x", "torchrun").parse_args([
        "--plan", "p", "--num-inference-steps", "7", "--validation-negative-prompt", "blurry", "--guidance-scale",
        "4.5", "--validation-seed", "99", "--sample-prompts", "p.txt"])
    config = run_config_of(args)
    assert (config.sample_steps, config.validation_negative_prompt, config.guidance_scale, config.validation_seed,
            config.sample_prompts) == (7, "blurry", 4.5, 99, "p.txt")


# -- the images, drawn by the tiny pipeline ---------------------------------------------------------------------
def pixels(paths) -> list[np.ndarray]:
    from PIL import Image

    return [np.asarray(Image.open(p).convert("RGB")) for p in paths]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory, monkeypatch_module):
    """write_samples with the tiny pipeline's own UNet standing in for a checkpoint's weights."""
    pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from pipeline_helpers import tiny_pipeline
    from pulse_torch.pipeline import samples

    root = tmp_path_factory.mktemp("validation_images")
    pipeline = root / "pipeline"
    tiny_pipeline(pipeline)
    unet = diffusers.UNet2DConditionModel.from_pretrained(str(pipeline / "unet"), local_files_only=True)
    monkeypatch_module.setattr(samples, "trained_weights", lambda where, step, ema: dict(unet.named_parameters()))

    def write(name: str, prompts, steps: int = 2, seed: int = 0):
        return samples.write_samples(str(pipeline), root / "step-1", 1, root / name, prompts, steps, seed)
    return pipeline, write


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_same_seed_draws_the_same_images_and_another_seed_others(drawn) -> None:
    _, write = drawn
    prompt = ValidationPrompt("a red cat", seed=1234)
    first, again = pixels(write("a", [prompt])), pixels(write("b", [prompt]))
    other = pixels(write("c", [ValidationPrompt("a red cat", seed=4321)]))
    assert len(first) == 2 and all(np.array_equal(x, y) for x, y in zip(first, again))
    assert not any(np.array_equal(x, y) for x, y in zip(first, other))
    # a prompt without a seed of its own draws with the run's (--validation-seed, else --seed)
    assert all(np.array_equal(x, y) for x, y in zip(pixels(write("d", ["a red cat"], seed=1234)), first))


def test_negative_prompt_guidance_and_steps_reach_the_pipeline_call(drawn) -> None:
    import torch
    from diffusers import DiffusionPipeline

    pipeline, write = drawn
    prompt = ValidationPrompt("a red cat", negative_prompt="a blue dog", steps=3, guidance_scale=9.0, seed=7)
    ours = pixels(write("ours", [prompt]))
    pipe = DiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True).to("cpu", torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def theirs(**changes) -> list[np.ndarray]:
        call = {**dict(negative_prompt="a blue dog", num_inference_steps=3, guidance_scale=9.0), **changes}
        images = pipe("a red cat", num_images_per_prompt=2, height=16, width=16,
                      generator=torch.Generator().manual_seed(7), **call).images
        return [np.asarray(image) for image in images]
    assert all(np.array_equal(x, y) for x, y in zip(ours, theirs()))
    # each setting changes the images: were one not passed on, the comparison above would fail
    for changed in (dict(negative_prompt="a green square"), dict(guidance_scale=2.0), dict(num_inference_steps=2)):
        assert not all(np.array_equal(x, y) for x, y in zip(ours, theirs(**changed))), changed


def test_the_images_go_to_tensorboard_beside_the_scalars(drawn, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pulse.train.run_outputs import StepLog, guard_samples
    from pulse.train.runlog import StepRecord

    _, write = drawn
    paths = write("board", [ValidationPrompt("a red cat", seed=3), ValidationPrompt("a blue dog", seed=4)])
    log = StepLog(tmp_path / "log.json", {"placement": "v", "global_batch": 4}, report_to="tensorboard")
    log([StepRecord(1, 0.5, 0.1, 10.0, 0, 0, None, 1e-4, val_loss=0.25)], True)
    guard_samples(lambda step: paths, log)(1)
    log.board.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == [f"validation/{i}" for i in range(4)]
    for i, path in enumerate(paths):
        (image,) = events.Images(f"validation/{i}")
        assert image.step == 1 and (image.width, image.height) == (16, 16)
        assert image.encoded_image_string == path.read_bytes()
    assert [s.value for s in events.Scalars("val/loss")] == [0.25]
    assert [s.value for s in events.Scalars("train/loss")] == [0.5]
