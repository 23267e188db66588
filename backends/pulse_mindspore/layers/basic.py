"""MindSpore building blocks with PyTorch's parameter names, shapes and default initialisations.

MindSpore's own cells name parameters differently (``nn.Dense``: ``weight``
but ``nn.LayerNorm``: ``gamma`` / ``beta``, ``nn.Embedding``:
``embedding_table``) and several ``mint`` kernels are missing on the CPU in
MindSpore 2.10 (``LayerNormExt``, ``GeluExt``, ``Conv2DExt``, ``Embedding``,
``StackExt``). So every block here is a small cell over ``ops`` that do run on
the CPU (the ``LayerNorm`` / ``Conv2D`` primitives, ``ops.gelu``, ``gather``),
named like ``torch.nn``: ``weight`` (out, in[, k, k]) and ``bias``.

Initial values are drawn with numpy by ``ParamInit`` (the distributions of
``torch.nn``'s defaults, not its random streams: weights are exchanged with
PyTorch by name through ``pulse_mindspore.weights``, never regenerated).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops
from mindspore.common.initializer import Zero, initializer


class ParamInit:
    """Makes parameters: values drawn from ``rng`` (numpy, seeded per layer), or shapes only.

    ``lazy=True`` backs every parameter by MindSpore's deferred ``initializer``
    (zeros, no values drawn, pages never touched): parameter counts of the
    full-size models without gigabytes of memory.
    """

    def __init__(self, rng: np.random.Generator | None = None, *, dtype: ms.Type = ms.float32,
                 lazy: bool = False) -> None:
        self.rng = rng if rng is not None else np.random.default_rng()
        self.dtype = dtype
        self.lazy = lazy

    def _param(self, shape: tuple[int, ...], draw: Callable[[], np.ndarray]) -> Parameter:
        if self.lazy:
            return Parameter(initializer(Zero(), shape, self.dtype))
        return Parameter(Tensor(np.asarray(draw(), dtype=np.float64).reshape(shape), dtype=self.dtype))

    def uniform(self, shape: tuple[int, ...], bound: float) -> Parameter:
        return self._param(shape, lambda: self.rng.uniform(-bound, bound, size=shape))

    def normal(self, shape: tuple[int, ...], std: float = 1.0) -> Parameter:
        return self._param(shape, lambda: self.rng.normal(0.0, std, size=shape))

    def trunc_normal(self, shape: tuple[int, ...], std: float, low: float = -2.0, high: float = 2.0) -> Parameter:
        """``torch.nn.init.trunc_normal_``: N(0, std) redrawn outside the absolute bounds [low, high]."""
        def draw() -> np.ndarray:
            x = self.rng.normal(0.0, std, size=shape)
            bad = (x < low) | (x > high)
            while bad.any():
                x[bad] = self.rng.normal(0.0, std, size=int(bad.sum()))
                bad = (x < low) | (x > high)
            return x
        return self._param(shape, draw)

    def constant(self, shape: tuple[int, ...], value: float) -> Parameter:
        return self._param(shape, lambda: np.full(shape, value))


def _fan_in_bound(fan_in: int) -> float:
    """``kaiming_uniform_(a=sqrt(5))`` and the default bias init both reduce to U(+-1/sqrt(fan_in))."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


class Linear(nn.Cell):
    """``torch.nn.Linear``; ``std`` switches to trunc_normal(std) weights and zero biases (U-ViT's init)."""

    def __init__(self, fin: int, fout: int, init: ParamInit, bias: bool = True, std: float | None = None) -> None:
        super().__init__()
        bound = _fan_in_bound(fin)
        if std is None:
            self.weight = init.uniform((fout, fin), bound)
            self.bias = init.uniform((fout,), bound) if bias else None
        else:
            self.weight = init.trunc_normal((fout, fin), std)
            self.bias = init.constant((fout,), 0.0) if bias else None

    def construct(self, x: Tensor) -> Tensor:
        return mint.nn.functional.linear(x, self.weight, self.bias)


class Conv2d(nn.Cell):
    """``torch.nn.Conv2d`` with square kernels, zero padding and a bias (float32 only on the CPU)."""

    def __init__(self, cin: int, cout: int, kernel: int, init: ParamInit, stride: int = 1, padding: int = 0) -> None:
        super().__init__()
        bound = _fan_in_bound(cin * kernel * kernel)
        self.stride, self.padding = stride, padding
        self.weight = init.uniform((cout, cin, kernel, kernel), bound)
        self.bias = init.uniform((cout,), bound)

    def construct(self, x: Tensor) -> Tensor:
        y = ops.conv2d(x, self.weight, stride=self.stride, pad_mode="pad", padding=self.padding)
        return y + self.bias.reshape(1, -1, 1, 1)


@lru_cache(maxsize=None)
def _layer_norm_op(eps: float) -> ops.LayerNorm:
    """The ``LayerNorm`` primitive over the last axis (one fused CPU kernel, unlike ``mint``'s missing one)."""
    return ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)


@lru_cache(maxsize=None)
def _unit_affine(dim: int, dtype: ms.Type) -> tuple[Tensor, Tensor]:
    """Constant ones / zeros of length ``dim``: the primitive always takes a scale and a shift."""
    return Tensor(np.ones(dim), dtype), Tensor(np.zeros(dim), dtype)


def layer_norm(x: Tensor, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """LayerNorm over the last axis (biased variance, as torch), affine when ``weight`` / ``bias`` are given."""
    ones, zeros = _unit_affine(x.shape[-1], x.dtype)
    y, _, _ = _layer_norm_op(float(eps))(x, ones if weight is None else weight, zeros if bias is None else bias)
    return y


class LayerNorm(nn.Cell):
    """``torch.nn.LayerNorm(dim, eps, elementwise_affine)``: ``weight`` ones, ``bias`` zeros."""

    def __init__(self, dim: int, init: ParamInit, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = init.constant((dim,), 1.0) if affine else None
        self.bias = init.constant((dim,), 0.0) if affine else None

    def construct(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.eps, self.weight, self.bias)


class GroupNorm(nn.Cell):
    """``torch.nn.GroupNorm(groups, channels, eps, affine=True)`` on (B, C, ...) tensors."""

    def __init__(self, groups: int, channels: int, init: ParamInit, eps: float = 1e-5) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = init.constant((channels,), 1.0)
        self.bias = init.constant((channels,), 0.0)

    def construct(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = layer_norm(x.reshape(shape[0], self.groups, -1), self.eps).reshape(shape)
        affine = (1, -1) + (1,) * (len(shape) - 2)
        return y * self.weight.reshape(affine) + self.bias.reshape(affine)


class Embedding(nn.Cell):
    """``torch.nn.Embedding``: a (num, dim) ``weight`` ~ N(0, 1), looked up by gather."""

    def __init__(self, num: int, dim: int, init: ParamInit) -> None:
        super().__init__()
        self.weight = init.normal((num, dim), 1.0)

    def construct(self, ids: Tensor) -> Tensor:
        return ops.gather(self.weight, ids, 0)


def silu(x: Tensor) -> Tensor:
    return ops.silu(x)


def gelu(x: Tensor) -> Tensor:
    """Exact (erf) GELU; ``ops.gelu`` runs on the CPU where ``mint``'s GeluExt does not."""
    return ops.gelu(x, approximate="none")


def gelu_tanh(x: Tensor) -> Tensor:
    """Tanh-approximated GELU (``ops.tanh`` itself is a coarse approximation on the CPU; this is not)."""
    return ops.gelu(x, approximate="tanh")


class Act(nn.Cell):
    """A parameter-free activation as a cell, so sequences keep torch's indices (``mlp.0``, ``mlp.2``)."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def construct(self, x: Tensor) -> Tensor:
        return self.fn(x)


class Identity(nn.Cell):
    """A placeholder keeping torch's list indices (diffusers' ``Dropout(0.0)`` slots)."""

    def construct(self, x: Tensor) -> Tensor:
        return x


def mlp_silu(fin: int, hidden: int, fout: int, init: ParamInit) -> nn.SequentialCell:
    """[Linear, SiLU, Linear]: the layout (and so the names ``0.*``, ``2.*``) of Hunyuan's small MLPs."""
    return nn.SequentialCell([Linear(fin, hidden, init), Act(silu), Linear(hidden, fout, init)])
