"""MindSpore's files are streamed: .npz written array by array into the atomic temp file, shares exported
array by array into diffusers' sharded safetensors. Skipped without MindSpore (or, for the export, diffusers).

::

    {key: array | tensor.asnumpy} ─ write_npz ─ each array made as its member is written, then dropped
    weights_rank<R>.npz ─ merge_shares: ShareArrays (names and shapes from the .npy headers; replicas compared
        a pair at a time) ─ write_pipeline(max_shard_bytes) ─ unet/diffusion_pytorch_model-0000k-of-0000N...
"""
from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")
try:
    import pulse_mindspore  # noqa: F401
except ImportError:  # the package is not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from pulse.data.backbone_weights import INDEX  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse_mindspore.checkpoint import write_npz  # noqa: E402
from pulse_mindspore.export import merge_shares, npz_shapes, write_pipeline  # noqa: E402
from pulse_mindspore.train import savez_atomic  # noqa: E402


def test_npz_arrays_are_made_one_at_a_time_and_load_with_numpy(tmp_path: Path) -> None:
    made: list[weakref.ref] = []
    alive_when_made: list[int] = []

    def source(i: int):
        def make() -> np.ndarray:
            alive_when_made.append(sum(r() is not None for r in made))
            array = np.full((64, 64), i, np.float32)
            made.append(weakref.ref(array))
            return array
        return make

    arrays = {f"param/w{i}": source(i) for i in range(5)}
    arrays["meta"] = np.frombuffer(b"{}", np.uint8)
    savez_atomic(tmp_path / "rank-0.npz", arrays)
    assert alive_when_made == [0] * 5  # the previous array was dropped before the next was made
    with np.load(tmp_path / "rank-0.npz", allow_pickle=False) as data:
        assert sorted(data.files) == sorted(arrays) and all(float(data[f"param/w{i}"][3, 3]) == i for i in range(5))
    assert npz_shapes(tmp_path / "rank-0.npz") == {**{f"param/w{i}": (64, 64) for i in range(5)}, "meta": (2,)}


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    def broken() -> np.ndarray:
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError):
        savez_atomic(tmp_path / "w.npz", {"a": np.zeros(3), "b": broken})
    assert list(tmp_path.iterdir()) == []
    with open(tmp_path / "x.npz", "wb") as f:  # write_npz streams into any file object
        write_npz(f, {"a": np.arange(3)})
    assert np.load(tmp_path / "x.npz")["a"].tolist() == [0, 1, 2]


def test_replicas_must_agree_bitwise(tmp_path: Path) -> None:
    np.savez(tmp_path / "weights_rank0.npz", a=np.ones(4, np.float32), b=np.zeros(2, np.float32))
    np.savez(tmp_path / "weights_rank1.npz", a=np.ones(4, np.float32))
    merged = merge_shares([tmp_path / "weights_rank0.npz", tmp_path / "weights_rank1.npz"])
    assert sorted(merged) == ["a", "b"] and merged["a"].tolist() == [1.0] * 4
    np.savez(tmp_path / "weights_rank1.npz", a=np.full(4, 2, np.float32))
    with pytest.raises(PulseError, match="'a' differs from another rank's copy"):
        merge_shares([tmp_path / "weights_rank0.npz", tmp_path / "weights_rank1.npz"])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(PulseError, match="not a readable .npz file"):
        merge_shares([tmp_path / "bad.npz"])


def test_shares_export_as_diffusers_shards(tmp_path: Path, tmp_path_factory) -> None:
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from pipeline_helpers import pipeline_fixture

    from pulse.data.pipeline_folder import read_pipeline

    pipeline = pipeline_fixture(tmp_path_factory)
    trained = {k: (v + 0.5).numpy() for k, v in diffusers.UNet2DConditionModel.from_pretrained(
        pipeline / "unet", local_files_only=True).state_dict().items()}
    keys = sorted(trained)
    half = len(keys) // 2
    np.savez(tmp_path / "weights_rank0.npz", **{k: trained[k] for k in keys[:half + 3]})  # 3 held twice
    np.savez(tmp_path / "weights_rank1.npz", **{k: trained[k] for k in keys[half:]})
    out = tmp_path / "exported"
    count = write_pipeline(read_pipeline(pipeline), merge_shares(sorted(tmp_path.glob("weights_rank*.npz"))), out,
                           max_shard_bytes=64 * 1024)
    assert count == sum(v.size for v in trained.values())
    index = json.loads((out / "unet" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 5
    loaded = diffusers.UNet2DConditionModel.from_pretrained(out / "unet", local_files_only=True).state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], torch.from_numpy(trained[k])) for k in keys)
