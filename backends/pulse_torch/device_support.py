"""What this node's accelerator can do, asked of torch (and torch_npu): bf16, and how fp16 overflow shows.

::

    pulse train --precision bf16 ─▶ python -m pulse_torch.device_support   (one JSON line, this node's device)
                                    ─▶ pulse.device_check: refused in one line, exit 2, before launch
    every rank (pulse_torch.job)  ─▶ check_precision(config.precision, device): the same refusal for a rank
                                    started by hand (torchrun without `pulse train`)
                                  ─▶ saturation_overflow_flag(device): Ascend 910A's overflow status

bf16: CUDA needs compute capability 8.0 (Ampere) or later: a V100 (7.0) has no bf16 units, and
a recent ``torch.cuda.is_bf16_supported()`` says True there anyway (its ``including_emulation``
defaults to True), so it is asked with ``including_emulation=False``. Ascend: the first-generation 910 parts (Atlas
training series, "910A") have none; torch_npu's own rule is ``IsBF16Supported(): soc >=
Ascend910B1`` (torch_npu/csrc/core/npu/NpuVariables.cpp), and the names below are the SoC
versions before Ascend910B1 there (the bare "Ascend910B" among them).
"""
from __future__ import annotations

import json
from typing import Callable

import torch

from pulse.errors import PulseError

FIRST_GENERATION_ASCEND = ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B")


def accelerator() -> str:
    """This node's device type as the ranks will pick it: npu, cuda or cpu (``pulse_torch.dist``)."""
    from pulse_torch.dist import accelerator_backend

    return accelerator_backend()[1]


def _kind_and_index(device: str) -> tuple[str, int]:
    """``npu:1`` -> ("npu", 1), parsed here: torch.device("npu") exists only once torch_npu is imported."""
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def device_name(device: str) -> str:
    kind, index = _kind_and_index(device)
    if kind == "cpu":
        return "cpu"
    return str(getattr(torch, kind).get_device_name(index))


def bf16_supported(device: str) -> bool:
    kind, _ = _kind_and_index(device)
    if kind == "cuda":
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # an older torch: no such argument, and emulation was not counted
            return bool(torch.cuda.is_bf16_supported())
    if kind == "npu":
        return device_name(device) not in FIRST_GENERATION_ASCEND
    return True  # CPU kernels compute bf16


def bf16_refusal(device: str) -> str | None:
    """Why ``--precision bf16`` cannot train on ``device`` (None: it can)."""
    if bf16_supported(device):
        return None
    name = device_name(device)
    why = ("no bfloat16 units before compute capability 8.0" if _kind_and_index(device)[0] == "cuda"
           else "first-generation Ascend 910 has no bfloat16 compute")
    return (f"--precision bf16: this node's {name} cannot train in bf16 ({why}); "
            "use --precision fp16 (loss-scaled) or fp32")


def check_precision(precision: str, device: str) -> None:
    """A rank's guard: refuse bf16 on a device without it (the launcher refuses first when it sees it)."""
    if precision == "bf16" and (reason := bf16_refusal(device)) is not None:
        raise PulseError(reason)


def saturation_overflow_flag(device: str) -> Callable[[], bool] | None:
    """Ascend in saturation mode (910A: Atlas training series, the only mode CANN runs there): an
    fp16 overflow becomes +-max and NaN becomes 0, so no isfinite sees it; the device's overflow
    flag does. Returns a read-and-clear of that flag, after clearing it once (what ran before the
    first step is not training); None where overflows are inf/NaN (CUDA, CPU, Ascend 910B on).

    torch_npu's documented API (torch_npu.npu.utils; hiascend.com PyTorch API reference
    "torch_npu.npu.utils.is_support_inf_nan": True for INF_NAN mode, False for saturation mode;
    "torch_npu.npu.get_npu_overflow_flag" / "clear_npu_overflow_flag": Atlas training series),
    as its own GradScaler and DeepSpeed's NPU adaptor use them.
    """
    if _kind_and_index(device)[0] != "npu":
        return None
    from torch_npu.npu import utils as npu_utils

    if npu_utils.is_support_inf_nan():
        return None
    npu_utils.clear_npu_overflow_flag()

    def read_and_clear() -> bool:
        flagged = bool(npu_utils.get_npu_overflow_flag())
        npu_utils.clear_npu_overflow_flag()  # the next step starts from zero
        return flagged

    return read_and_clear


def describe(device: str) -> dict:
    """What `pulse train` asks before launching (``pulse.device_check``)."""
    return {"device": _kind_and_index(device)[0], "name": device_name(device), "bf16_refusal": bf16_refusal(device)}


if __name__ == "__main__":  # python -m pulse_torch.device_support: this node's first device, one JSON line
    kind = accelerator()
    print(json.dumps(describe(kind if kind == "cpu" else f"{kind}:0")))
