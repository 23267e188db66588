"""One pipeline message on the wire: a header describing every tensor it carries, then one payload.

A transfer (``pulse.traffic.Transfer``: the main path, the skips and shared
inputs riding with it) crosses as a header and a payload, whatever the number
of tensors (``pulse_torch.comm`` sends the payload inline behind the header
once both sides know its size: then one point-to-point message)::

    header  int64[HEADER_LEN]  tag, stamp, count, then per tensor: ndim, dtype code, shape[8]
    payload uint8[...]         every tensor's bytes, each padded to 8 bytes (aligned views)

Per-message costs (a header wait, a payload wait) dominate small transfers on
gloo, so one message per transfer instead of one per tensor is what keeps
relayed skips cheap; ``pulse.sim.program`` prices ``traffic.wire_messages``
messages per transfer. The receiver sizes its buffer from the header: a
tensor's shape depends on the microbatch size, which the bytes do not say.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from pulse.errors import PlanError
from pulse.traffic import MAX_TENSORS_PER_MESSAGE

MAX_DIMS = 8
SLOT = 2 + MAX_DIMS
HEADER_LEN = 3 + MAX_TENSORS_PER_MESSAGE * SLOT
HEADER_BYTES = HEADER_LEN * 8
ALIGN = 8
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
Layout = list[tuple[tuple[int, ...], torch.dtype]]


def encode_header(tensors: Sequence[Tensor], tag: int, stamp: int = 0) -> Tensor:
    """int64[HEADER_LEN] describing ``tensors`` (at most MAX_TENSORS_PER_MESSAGE)."""
    if not 1 <= len(tensors) <= MAX_TENSORS_PER_MESSAGE:
        raise PlanError(f"one message carries 1 to {MAX_TENSORS_PER_MESSAGE} tensors, got {len(tensors)}")
    values = [tag, stamp, len(tensors)]
    for t in tensors:
        if t.dim() > MAX_DIMS or t.dtype not in _CODE:
            raise PlanError(f"cannot send a {t.dim()}-d {t.dtype} tensor (at most {MAX_DIMS} dims, "
                            f"dtypes {', '.join(str(d) for d in DTYPES)})")
        values += [t.dim(), _CODE[t.dtype], *t.shape] + [0] * (MAX_DIMS - t.dim())
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[int, Layout, int]:
    """(tag, [(shape, dtype)] of each tensor, stamp) of the payload that follows."""
    values = [int(v) for v in header.tolist()]
    tag, stamp, count = values[:3]
    layout: Layout = []
    if len(values) == HEADER_LEN and 1 <= count <= MAX_TENSORS_PER_MESSAGE:
        for i in range(count):
            ndim, code, *dims = values[3 + i * SLOT: 3 + (i + 1) * SLOT]
            shape = tuple(dims[:ndim])
            if not (0 <= ndim <= MAX_DIMS and 0 <= code < len(DTYPES)) or min(shape, default=0) < 0:
                break
            layout.append((shape, DTYPES[code]))
    if len(layout) != count or count == 0:
        raise PlanError(f"malformed message header {values[:3 + SLOT]}...: a message that is not ours "
                        "(or half of one) arrived where a header was expected")
    return tag, layout, stamp


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def payload_bytes(layout: Layout) -> int:
    total = 0
    for shape, dtype in layout:
        numel = 1
        for n in shape:
            numel *= n
        total += _padded(numel * torch.empty((), dtype=dtype).element_size())
    return total


def pack(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Every tensor's bytes in one uint8 buffer, each padded to ALIGN."""
    parts = []
    for t in tensors:
        raw = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(raw.numel()) - raw.numel()
        parts.append(raw if pad == 0 else torch.cat([raw, raw.new_zeros(pad)]))
    return torch.cat(parts) if len(parts) > 1 else parts[0]  # a view: alive until the send completes


def unpack(payload: Tensor, layout: Layout) -> list[Tensor]:
    """The tensors of ``payload`` (views into it: aligned, no copy)."""
    out, offset = [], 0
    for shape, dtype in layout:
        size = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for n in shape:
            numel *= n
        raw = payload[offset: offset + numel * size]
        out.append(raw.view(dtype).reshape(shape))
        offset += _padded(numel * size)
    return out
