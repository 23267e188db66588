"""The torch runtime alone across real processes (torchrun, gloo, CPU), its wire format and the
process-group backend choice.

A rank waiting on a silent peer times out naming it; a tag's later messages
ride inline into receives posted early; headers round-trip. The pipeline step
across processes, checked for both backends, is in
``tests/test_backend_processes.py``.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from process_rigs import torchrun  # noqa: E402
from pulse_torch.dist import accelerator_backend  # noqa: E402


def test_recv_from_a_silent_peer_times_out_naming_it(tmp_path: Path) -> None:
    torchrun(2, ["--mode", "silent-peer", "--recv-timeout", "1", "--timeout", "30"], tmp_path)
    record = json.loads((tmp_path / "silent.json").read_text())
    assert record["type"] == "CommTimeout"
    assert "from rank 1" in record["error"] and "timed out after 1 s" in record["error"]  # the wait it was given


def test_a_tags_later_messages_ride_inline_into_receives_posted_early(tmp_path: Path) -> None:
    """The first message of a tag is a header and a payload; once both sides know its size, one
    message into a receive posted before the send; a payload that grew goes as two again. Each
    direction between the two ranks goes through its own process group."""
    torchrun(2, ["--mode", "inline", "--timeout", "30"], tmp_path)
    record = json.loads((tmp_path / "inline.json").read_text())
    assert record["received"] == [[float(x + i) for x in range(n)] for i, n in enumerate((5, 5, 9))]
    assert record["wire"] == [2, 1, 2]
    assert record["left_posted"] == 0
    assert record["own_groups"]  # gloo: each direction between two ranks has its own process group


def test_hccl_is_chosen_when_torch_npu_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # a stand-in, no __spec__
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert accelerator_backend() == ("hccl", "npu")


def test_gloo_on_a_machine_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    if torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("this machine has an accelerator")
    assert accelerator_backend() == ("gloo", "cpu")
    # torch_npu present but no NPU visible: still gloo
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert accelerator_backend() == ("gloo", "cpu")


def test_header_round_trip_and_rejects_garbage() -> None:
    from pulse.errors import PlanError
    from pulse_torch.wire import HEADER_LEN, decode_header, encode_header, pack, payload_bytes, unpack

    t = torch.arange(30, dtype=torch.float64).reshape(2, 3, 5)
    odd = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)  # 6 bytes: the next tensor starts padded
    flag = torch.tensor([True, False])
    tag, layout, stamp = decode_header(encode_header([odd, t, flag], 12345, stamp=77))
    assert (tag, stamp) == (12345, 77)
    assert layout == [((3,), torch.bfloat16), ((2, 3, 5), torch.float64), ((2,), torch.bool)]
    payload = pack([odd, t, flag], torch.device("cpu"))
    assert payload.numel() == payload_bytes(layout) == 8 + 240 + 8
    for got, want in zip(unpack(payload, layout), [odd, t, flag]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    bad = encode_header([t], 1)
    bad[4] = 99  # dtype code 99
    with pytest.raises(PlanError, match="malformed"):
        decode_header(bad)
    with pytest.raises(PlanError, match="malformed"):
        decode_header(torch.zeros(HEADER_LEN, dtype=torch.int64))  # a message of no tensors
