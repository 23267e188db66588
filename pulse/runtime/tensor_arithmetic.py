"""``Backend.add`` and ``Backend.scale`` for every framework whose tensors overload ``+`` and ``*``.

Both backends' tensors do (torch, MindSpore), so the executor's gradient
sums and scalings are written once; a backend mixes this class in.
"""
from __future__ import annotations

from typing import Any


class OperatorArithmetic:
    """Gradient arithmetic by Python's operators: a new tensor each time, never in place."""

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def scale(self, t: Any, factor: float) -> Any:
        return t * factor
