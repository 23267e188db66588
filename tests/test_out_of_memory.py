"""A rank whose allocator fails says so in one line with its device's predicted peak and exits 2
(``pulse.train.out_of_memory``, ``run_outputs.guarded``); any other exception stays a traceback."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pulse.train.out_of_memory import allocator_failure, out_of_memory_line, predicted_peak

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backends"))
from pulse_mindspore.traits import OUT_OF_MEMORY as MINDSPORE  # noqa: E402
from pulse_torch.traits import OUT_OF_MEMORY as TORCH  # noqa: E402

# what a MindSpore 2.10 CPU worker raised when SD v2's pipeline device 1 filled this 24 GiB host
# (`pulse train --backend mindspore --diffusers-config SD2 --model-option resolution=256 --pp 2`)
MINDSPORE_TEXT = """
----------------------------------------------------
- Memory not enough:
----------------------------------------------------
Memory isn't enough and alloc failed, kernel name: 967_Default/Mul-op613, alloc size: 58982400B.

----------------------------------------------------
- C++ Call Stack: (For framework developers)
----------------------------------------------------
mindspore/ccsrc/backend/ms_backend/runtime/graph_scheduler/base/graph_scheduler.cc:1168 Run
"""


def test_a_failed_cpu_allocation_in_torch_is_named() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError) as caught:
        torch.empty(1 << 50)  # 4 PiB of float32: the CPU allocator refuses it
    line = allocator_failure(caught.value, TORCH)
    assert line is not None and "can't allocate memory" in line and "\n" not in line


def test_mindspore_s_most_telling_line_is_kept() -> None:
    line = allocator_failure(RuntimeError(MINDSPORE_TEXT), MINDSPORE)
    assert line == ("Memory isn't enough and alloc failed, kernel name: 967_Default/Mul-op613, "
                    "alloc size: 58982400B.")


@pytest.mark.parametrize("markers", [TORCH, MINDSPORE])
def test_other_failures_are_not_taken_for_memory(markers) -> None:
    for exc in (RuntimeError("The size of tensor a (4) must match the size of tensor b (8)"),
                ValueError("memory_format must be contiguous"), KeyError("up0_res0")):
        assert allocator_failure(exc, markers) is None


def test_the_line_names_the_rank_s_pipeline_device_and_its_prediction() -> None:
    predicted = {"peak_memory_bytes": 9 * 2**30, "peak_memory_bytes_per_device": [2**30, 3 * 2**30]}
    assert predicted_peak(predicted, pp=2, dp=2, rank=3) == (3 * 2**30, 1)  # rank = replica * pp + stage
    assert predicted_peak({"peak_memory_bytes": 9 * 2**30}, pp=2, dp=1, rank=0) == (9 * 2**30, 0)
    line = out_of_memory_line("alloc failed", "MindSpore", 3, predicted, 2, 2)
    assert line.startswith("out of memory on pipeline device 1 (MindSpore: alloc failed); the plan predicted "
                           "3.00 GiB for it; fit it with more pipeline stages (--pp)")
    assert out_of_memory_line("alloc failed", "PyTorch", None).startswith("out of memory on rank ? (PyTorch")


RANK = """
import sys
sys.path.insert(0, {backends!r})
import torch
from pulse.train.out_of_memory import reporter
from pulse.train.run_outputs import guarded
from pulse_torch.traits import TRAITS

def body():
    if sys.argv[1] == "memory":
        torch.empty(1 << 50)
    raise RuntimeError("a bug of ours")

print("exit", guarded("rank-entry", "1", False, body,
                      reporter(TRAITS, {plan!r}, "1")))
"""


@pytest.fixture()
def rank_script(tmp_path: Path) -> Path:
    plan = tmp_path / "plan.yaml"
    subprocess.run([sys.executable, "-m", "pulse.cli.main", "plan", "--model", "tiny-unet", "--pp", "2",
                    "--out", str(plan)], check=True, capture_output=True, cwd=tmp_path)
    data = yaml.safe_load(plan.read_text())  # the figures `pulse train` adds when it prices the run
    data["predicted"].update(peak_memory_bytes=3 * 2**30, peak_memory_bytes_per_device=[2**30, 3 * 2**30])
    plan.write_text(yaml.safe_dump(data))
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK.format(backends=str(REPO / "backends"), plan=str(plan))))
    return script


def test_a_rank_out_of_memory_is_one_line_and_exit_2(rank_script: Path) -> None:
    done = subprocess.run([sys.executable, str(rank_script), "memory"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("rank-entry: rank 1: error: out of memory on pipeline device 1 (PyTorch: ")
    assert "can't allocate memory" in lines[0] and "the plan predicted 3.00 GiB for it" in lines[0]
    assert "exit" not in done.stdout  # left at once, as a rank whose peer died does


def test_any_other_exception_is_still_a_traceback(rank_script: Path) -> None:
    done = subprocess.run([sys.executable, str(rank_script), "bug"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr and "a bug of ours" in done.stderr
