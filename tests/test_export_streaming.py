"""``pulse export`` streams: diffusers' sharded safetensors out of mapped rank files, never the whole model.

::

    tiny SD pipeline ─ two in-process pipeline ranks, 2 AdamW steps with EMA ─ step-2/ (rank-0.pt, rank-1.pt)
        ─ export_step(max_shard_bytes=64 KiB) ─ unet/diffusion_pytorch_model-0000k-of-0000N.safetensors + index
        ─ UNet2DConditionModel / DiffusionPipeline.from_pretrained: the trained (or EMA) weights, bit for bit

Checked too: the dtype each tensor is stored in is the pipeline's own (an fp16 UNet stays fp16), the
writer never holds more than one shard's worth of tensors (a hook on what it is handed), and the
rank files are mapped, not read whole (the window drops a mapping once it has handed out enough).
"""
from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from pipeline_helpers import pipeline_fixture  # noqa: E402
from test_ema import diffusers_unet  # noqa: E402

from pulse.backbone_shards import TensorInfo, plan_shards  # noqa: E402
from pulse.data.backbone_weights import INDEX, WEIGHTS, backbone_weights, read_header  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.train.checkpoints import CheckpointError  # noqa: E402
from pulse.train.loop import StepSettings  # noqa: E402
from pulse_torch import backbone_files, step_weights  # noqa: E402
from pulse_torch.checkpoint import merge_weights  # noqa: E402
from pulse_torch.export import export_step  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
SHARD = 64 * 1024  # bytes: the tiny UNet (~1.7 MB) in many shards


@pytest.fixture(scope="module")
def trained(pipeline: Path, tmp_path_factory) -> Path:
    """step-2/ of two pipeline ranks that trained the tiny pipeline's UNet with EMA."""
    job, _ = diffusers_unet(pipeline, StepSettings(lr=1e-3, ema=0.9))
    job.train(0, 2)
    return job.save(tmp_path_factory.mktemp("ckpt"), 2)


def unet_params(folder: Path) -> dict:
    return dict(diffusers.UNet2DConditionModel.from_pretrained(folder, local_files_only=True).named_parameters())


def test_the_export_is_diffusers_shards_that_load_back_as_the_trained_weights(pipeline, trained, tmp_path) -> None:
    out = tmp_path / "out"
    said = export_step(read_pipeline(pipeline), 2, trained, out, max_shard_bytes=SHARD)
    unet = out / "unet"
    index = json.loads((unet / INDEX).read_text())
    files = sorted(p.name for p in unet.glob("*.safetensors"))
    n = len(files)
    assert n > 5 and f"{n} shards" in said and not (unet / WEIGHTS).exists()
    assert files == [f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    for f in files:  # at most a shard's bytes, or one tensor bigger than a shard alone
        entries = read_header(unet / f).values()
        held = sum(torch.Size(e.shape).numel() * 4 for e in entries)
        assert held <= SHARD or len(entries) == 1
    want = merge_weights(trained, 2)
    got = unet_params(unet)
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    before = unet_params(pipeline / "unet")
    assert sum(not torch.equal(before[k], got[k]) for k in got) > len(got) // 2  # trained, not the input's
    assert (unet / "config.json").read_bytes() == (pipeline / "unet" / "config.json").read_bytes()
    assert not list(tmp_path.glob(".out.tmp*"))  # built aside, renamed whole
    pipe = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert all(torch.equal(p, want[k]) for k, p in pipe.unet.named_parameters())


def test_ema_export_and_one_file_when_it_fits(pipeline, trained, tmp_path) -> None:
    out = tmp_path / "ema"
    export_step(read_pipeline(pipeline), 2, trained, out, ema=True)  # diffusers' default shard: one file
    assert (out / "unet" / WEIGHTS).is_file() and not (out / "unet" / INDEX).exists()
    want, raw = merge_weights(trained, 2, ema=True), merge_weights(trained, 2)
    got = unet_params(out / "unet")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sum(not torch.equal(raw[k], want[k]) for k in want) > len(want) // 2  # the averages, not the weights


def test_each_tensor_is_stored_in_the_pipelines_dtype(pipeline, trained, tmp_path) -> None:
    half = tmp_path / "half"
    shutil.copytree(pipeline, half)
    for f in (half / "unet").glob("*.safetensors"):
        f.unlink()
    diffusers.UNet2DConditionModel.from_pretrained(pipeline / "unet").half().save_pretrained(half / "unet")
    out = tmp_path / "out"
    export_step(read_pipeline(half), 2, trained, out, max_shard_bytes=SHARD)
    assert {e.dtype for e in backbone_weights(out / "unet").values()} == {"F16"}
    want = merge_weights(trained, 2)
    got = unet_params(out / "unet")  # loaded as float32 by diffusers: the fp16 values, widened
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].half().float()) for k in want)


def test_the_writer_never_holds_more_than_a_shards_worth(pipeline, trained, tmp_path, monkeypatch) -> None:
    """Every array handed to the writer is watched: at any moment those still alive fit in one shard."""
    handed: list[tuple[weakref.ref, int]] = []
    alive_peak = [0]
    stored_bytes = backbone_files.stored_bytes

    def watched(tensor, info):  # reference counting frees an array the writer dropped: no gc.collect needed
        alive = sum(size for ref, size in handed if ref() is not None)
        alive_peak[0] = max(alive_peak[0], alive)
        out = stored_bytes(tensor, info)
        handed.append((weakref.ref(out), out.nbytes))
        return out

    monkeypatch.setattr(backbone_files, "stored_bytes", watched)
    export_step(read_pipeline(pipeline), 2, trained, tmp_path / "out", max_shard_bytes=SHARD)
    total = sum(size for _, size in handed)
    biggest = max(size for _, size in handed)
    assert total > 20 * SHARD  # the model is many shards...
    assert alive_peak[0] <= max(SHARD, biggest)  # ...and no more than one is held at a time


def test_rank_files_are_mapped_and_dropped_by_the_window(trained) -> None:
    weights = step_weights.step_weights(trained, 2, window_bytes=4 * SHARD)
    maps: set[int] = set()
    for name in weights:
        weights[name]
        maps.add(id(weights._mapped[1]))
    files = {weights.file_of[n] for n in weights}
    assert len(files) == 2 and len(maps) > 2 * len(files)  # each file mapped again after every window
    assert weights.numel() == sum(t.numel() for t in merge_weights(trained, 2).values())


def test_refusals_come_before_anything_is_written(pipeline, trained, tmp_path) -> None:
    other = tmp_path / "other"
    shutil.copytree(pipeline, other)
    config = json.loads((other / "unet" / "config.json").read_text())
    (other / "unet" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 16}))
    with pytest.raises(CheckpointError, match="has shape"):
        export_step(read_pipeline(other), 2, trained, tmp_path / "out")
    no_ema = tmp_path / "plain"
    job, _ = diffusers_unet(pipeline, StepSettings(lr=1e-3))
    job.train(0, 1)
    where = job.save(no_ema, 1)
    with pytest.raises(CheckpointError, match="holds no EMA weights"):
        export_step(read_pipeline(pipeline), 1, where, tmp_path / "out", ema=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_shards_follow_huggingface_hubs_rule_and_names() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    sizes = [6, 6, 2, 6, 2, 2, 12, 3]  # a tensor over the limit (12 > 10) goes alone, as the hub's splitter does
    infos = [TensorInfo(f"t{i}", "U8", (s,)) for i, s in enumerate(sizes)]
    theirs = split_torch_state_dict_into_shards({t.name: torch.zeros(t.shape, dtype=torch.uint8) for t in infos},
                                                max_shard_size=10,
                                                filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    ours = {s.filename: [t.name for t in s.tensors] for s in plan_shards(infos, 10)}
    assert ours == theirs.filename_to_tensors and len(ours) == 5
    assert [s.filename for s in plan_shards(infos[:2], 100)] == [WEIGHTS]


def test_buffers_come_from_the_pipelines_own_files(pipeline, trained, tmp_path) -> None:
    """A backbone with persistent buffers (none in SD's UNet: made here of one parameter) keeps the folder's."""
    folder = read_pipeline(pipeline)
    layout = backbone_files.backbone_layout(folder)
    buffer = "conv_in.bias"
    parameters = {n: s for n, s in layout.parameters.items() if n != buffer}
    layout = backbone_files.BackboneLayout(parameters, {buffer: layout.parameters[buffer]}, layout.stored)
    weights = {n: t for n, t in merge_weights(trained, 2).items() if n != buffer}
    infos = backbone_files.tensor_infos(layout, weights, trained, folder, CheckpointError)
    assert infos[-1].name == buffer
    backbone_files.write_backbone(tmp_path / "unet", folder, weights, infos, layout, SHARD)
    got = unet_params(tmp_path / "unet")
    assert torch.equal(got[buffer], unet_params(pipeline / "unet")[buffer])
    assert all(torch.equal(got[n], t) for n, t in weights.items())
    config_only = backbone_files.BackboneLayout(layout.parameters, layout.buffers, None)
    with pytest.raises(CheckpointError, match="a config only, and the model keeps buffers"):
        backbone_files.tensor_infos(config_only, weights, trained, folder, CheckpointError)
