"""The optimizers a run may train with (``--optimizer``), as plan data: names, the library class users
know, the state each keeps per trained parameter, which backend has which. Framework-free: the memory
model (``pulse.sim.memory``), the command line and both backends read it.

State bytes, counted from each library's own ``step`` (fp32 parameters, as PULSE trains them)::

    adamw      torch.optim.AdamW                        exp_avg, exp_avg_sq             8 B/param
    adafactor  transformers.optimization.Adafactor      second moment factored over a   ~1.9 B/param
               (relative_step=False, scale_parameter    tensor's last two dims (rows +  (SD v2 UNet, exact
               =False: the given lr, as kohya runs it)  cols), whole for 1-D tensors    from its shapes)
    adamw8bit  bitsandbytes.optim.AdamW8bit             two uint8 moments + an fp32     2.03 B/param
                                                        absmax per 256-block; fp32
                                                        moments under 4,096 elements
    lion       lion_pytorch.Lion                        exp_avg                         4 B/param
    prodigy    prodigyopt.Prodigy                       s, p0, exp_avg, exp_avg_sq      16 B/param

MindSpore builds its own (``pulse_mindspore.optimizers``): AdamW, and ``mindspore.nn.AdaFactor`` for
adafactor (the same factoring, a few placeholder bytes more per tensor); the others are refused there.

``state_bytes(name, shape)`` is the exact count for one tensor (what ``optimizer.state`` holds for it
after a step); ``OptimizerKind.bytes_per_param`` the planner's figure, which knows parameter counts,
not shapes: exact for the element-wise ones, and for Adafactor and 8-bit AdamW the large-tensor rule
(their small-tensor and factoring terms are said per optimizer in ``how``).
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Sequence

from pulse.errors import PulseError

FP32 = 4
BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per 256 elements per moment
BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep fp32 moments
BNB_QMAP_BYTES = 2 * 256 * FP32  # its two quantization maps, one pair shared by every tensor of an optimizer
# Adafactor on the SD v2 UNet (865.9M parameters, diffusers' shapes): 1.885 bytes of factored state per
# parameter, mostly its 3x3 convolutions' (rows + cols = 2/3 of the weight's size); a model of linear layers
# (a DiT) holds far less, so this figure over-prices it rather than under-prices a UNet
ADAFACTOR_SD2_BYTES = 1.885


@dataclass(frozen=True)
class OptimizerKind:
    """One ``--optimizer``: the class users know, the state it keeps, where it runs."""

    name: str  # --optimizer NAME
    library: str  # the class a run builds (PyTorch backend)
    package: str  # what `pip install` gives it ("torch": nothing beyond PyTorch)
    bytes_per_param: float  # optimizer state per trained fp32 parameter, as the planner prices it
    how: str  # how bytes_per_param is counted (said by `pulse tune` / docs)
    # one optimizer per chunk equals one over the whole model: every parameter's update reads only its own
    # state (Adafactor factors per tensor: also). Prodigy's step size d sums over every parameter it steps.
    elementwise: bool = True
    default_lr: float | None = None  # the rate its authors say to use when --lr is not given
    backends: tuple[str, ...] = ("torch",)  # the backends that build it
    # param-group entries the optimizer learns as it steps (not hyper-parameters): checkpointed and restored
    group_state: tuple[str, ...] = ()


OPTIMIZERS: dict[str, OptimizerKind] = {o.name: o for o in (
    OptimizerKind("adamw", "torch.optim.AdamW", "torch", 8.0, "exp_avg and exp_avg_sq, fp32",
                  backends=("torch", "mindspore")),
    OptimizerKind("adafactor", "transformers.optimization.Adafactor", "transformers", ADAFACTOR_SD2_BYTES,
                  "second moment factored over each tensor's last two dims, fp32 rows + cols (1-D tensors "
                  "whole): the SD v2 UNet's 1.885 B/param, exact from its shapes (MindSpore's nn.AdaFactor: "
                  "the same, and 4-8 B more per tensor)", backends=("torch", "mindspore")),
    OptimizerKind("adamw8bit", "bitsandbytes.optim.AdamW8bit", "bitsandbytes", 2 + 2 * FP32 / BNB_BLOCK,
                  "two uint8 moments plus an fp32 absmax per 256-element block each (tensors under 4,096 "
                  "elements keep fp32 moments, 8 B: 0.04% of the SD v2 UNet's parameters)"),
    OptimizerKind("lion", "lion_pytorch.Lion", "lion-pytorch", 4.0, "exp_avg, fp32"),
    OptimizerKind("prodigy", "prodigyopt.Prodigy", "prodigyopt", 16.0,
                  "s, p0, exp_avg and exp_avg_sq, fp32 (p0 is one number for a tensor initialised to zeros)",
                  elementwise=False, default_lr=1.0, group_state=("d", "d_max", "d_numerator", "d_denom", "d_hat",
                                                                  "k")),
)}
NAMES = tuple(OPTIMIZERS)
DEFAULT = "adamw"


def optimizer_kind(name: str) -> OptimizerKind:
    """The optimizer ``--optimizer name`` names; one line listing the known ones otherwise."""
    kind = OPTIMIZERS.get(name)
    if kind is None:
        raise PulseError(f"--optimizer {name!r} is not one PULSE trains with; choose one of {', '.join(NAMES)}")
    return kind


def state_bytes(name: str, shape: Sequence[int], zeros: bool = False) -> int:
    """Bytes ``name``'s library keeps in ``optimizer.state`` for one fp32 tensor of ``shape`` after a step:
    its tensors (a 0-d ``step`` tensor counted as AdamW and Adafactor keep one), not the plain numbers.
    ``zeros``: the tensor was all zeros when the optimizer first stepped it (Prodigy keeps a 0-d p0 then).
    bitsandbytes' quantization maps, shared by every tensor, are ``shared_state_bytes``'."""
    optimizer_kind(name)
    n = math.prod(shape)
    if name == "adamw":
        return 2 * n * FP32 + FP32  # + the 0-d float32 step tensor
    if name == "lion":
        return n * FP32
    if name == "prodigy":
        return 3 * n * FP32 + (FP32 if zeros else n * FP32)
    if name == "adafactor":  # transformers' Adafactor (beta1 None: no first moment); + the 0-d RMS tensor
        if len(shape) < 2:
            return n * FP32 + FP32
        return (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * FP32 + FP32
    if n < BNB_MIN_8BIT:  # adamw8bit: fp32 moments for a small tensor
        return 2 * n * FP32
    return 2 * n + 2 * math.ceil(n / BNB_BLOCK) * FP32


def shared_state_bytes(name: str) -> int:
    """Bytes an optimizer's state shares between its tensors (bitsandbytes' two quantization maps)."""
    return BNB_QMAP_BYTES if name == "adamw8bit" else 0


def check_backend(name: str, backend: str) -> None:
    """Refuse, in one line, an optimizer ``--backend backend`` does not build."""
    kind = optimizer_kind(name)
    if backend not in kind.backends:
        raise PulseError(f"--optimizer {name} is not available with --backend {backend} (it builds "
                         f"{', '.join(o.name for o in OPTIMIZERS.values() if backend in o.backends)}); use "
                         f"--backend torch for {kind.library}")


def check_installed(name: str) -> None:
    """Refuse, in one line, an optimizer whose library is not installed here (found without importing it)."""
    kind = optimizer_kind(name)
    module = kind.library.split(".")[0]
    if importlib.util.find_spec(module) is None:
        raise PulseError(f"--optimizer {name} trains with {kind.library}, and {module} is not installed: "
                         f"pip install {kind.package} (or pip install -e '.[optimizers]')")


def check_pipeline(name: str, pp: int) -> None:
    """Refuse an optimizer that is not element-wise on a pipeline of several stages: each stage would
    step its own, and its estimate (Prodigy's d, a sum over every parameter) would differ from one
    optimizer's over the whole model."""
    kind = optimizer_kind(name)
    if pp > 1 and not kind.elementwise:
        raise PulseError(f"--optimizer {name} needs pp 1: its step size sums over every parameter of the model, "
                         f"and a pipeline stage ({pp} here) steps only its own; train it data-parallel "
                         "(--pp 1) or choose an element-wise optimizer (adamw, adafactor, adamw8bit, lion)")
