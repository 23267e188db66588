"""Each backend as the backend-parametrized tests drive it on the fake network.

A test takes ``backend`` ("torch" or "mindspore") as a pytest parameter and
asks ``rig(backend)`` for what differs between the frameworks: the backend
object, its batches and loss, its float type, its tolerances and a
single-device reference built without the backend under test::

    r = rig("torch")                       skips the test when torch is missing
    spec = r.spec("tiny-unet")             activations in r's float type on the wire
    run = local_run(spec, placement, program, r.make_backend(), r.make_batches(spec), r.loss_fn)
    grads, loss = r.reference(spec, M)     whole model, M microbatches, loss gradient scaled by 1/M

PyTorch runs float64 (gradients agree to 1e-5), MindSpore float32 (1e-4:
the pipeline sums skip and shared-input gradients in another order).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import pytest

from pulse.runtime.protocols import Backend, Batches, LossFn
from pulse.spec import ModelSpec
from pulse.zoo import get_spec

BACKENDS = ["torch", "mindspore"]
ACT_BYTES = {"torch": 8, "mindspore": 4}  # bytes of one activation element on the wire: float64, float32
MBS = 1  # samples per microbatch


def spec_of(backend: str, model: str) -> ModelSpec:
    """Zoo model ``model`` with ``backend``'s float type on the wire (framework-free: cases are
    planned when pytest collects them)."""
    return get_spec(model).with_act_bytes(ACT_BYTES[backend])


@dataclass(frozen=True)
class Rig:
    """What a backend-parametrized test needs to know about one backend."""

    name: str
    float_dtype: Any  # the framework's dtype of that float type
    int64_dtype: Any
    stage_microbatches: int  # M = this x P in the pipeline tests
    grad_tol: float  # max_relative_error of pipeline gradients against the reference
    loss_rel: float  # relative tolerance of the pipeline loss against the reference
    adamw_atol: float  # absolute tolerance of one AdamW step against its closed form
    make_backend: Callable[..., Backend]  # keywords: lr, weight_decay
    make_batches: Callable[[ModelSpec], Batches]
    loss_fn: LossFn
    to_numpy: Callable[[Any], np.ndarray]
    whole_model: Callable[[ModelSpec, int], tuple[dict[str, np.ndarray], float]]
    initial_weights: Callable[[ModelSpec], dict[str, np.ndarray]]

    @property
    def act_bytes(self) -> int:
        return ACT_BYTES[self.name]

    def spec(self, model: str) -> ModelSpec:
        return spec_of(self.name, model)

    def reference(self, spec: ModelSpec, microbatches: int) -> tuple[dict[str, np.ndarray], float]:
        """Gradients and mean loss of the whole model over ``microbatches`` (cached: several tests ask)."""
        return _reference(self.name, spec, microbatches)


def rig(name: str) -> Rig:
    """The rig of backend ``name``; skips the calling test when its framework is not installed."""
    pytest.importorskip(name)
    return _torch_rig() if name == "torch" else _mindspore_rig()


@lru_cache(maxsize=None)
def _reference(name: str, spec: ModelSpec, microbatches: int) -> tuple[dict[str, np.ndarray], float]:
    return rig(name).whole_model(spec, microbatches)


@lru_cache(maxsize=None)
def _torch_rig() -> Rig:
    import torch
    from pulse_torch.backend import TorchBackend
    from pulse_torch.diffusion import eps_loss
    from pulse_torch.model import build_model
    from torch_worker_check import make_batches, reference_gradients

    torch.set_num_threads(1)
    dtype = torch.float64

    def whole_model(spec: ModelSpec, microbatches: int) -> tuple[dict[str, np.ndarray], float]:
        grads, losses = reference_gradients(spec, [make_batches(spec, MBS)], microbatches, dtype)
        return grads, losses[0]

    def initial_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
        model = build_model(spec, seed=0, dtype=dtype)
        return {n[len("layers."):]: p.detach().numpy().copy() for n, p in model.named_parameters()}

    return Rig(name="torch", float_dtype=dtype, int64_dtype=torch.int64, stage_microbatches=2,
               grad_tol=1e-5, loss_rel=1e-12, adamw_atol=1e-12,
               make_backend=lambda **kw: TorchBackend(dtype=dtype, **kw),
               make_batches=lambda spec: make_batches(spec, MBS), loss_fn=eps_loss,
               to_numpy=lambda t: t.detach().cpu().numpy(), whole_model=whole_model,
               initial_weights=initial_weights)


@lru_cache(maxsize=None)
def _mindspore_rig() -> Rig:
    import mindspore as ms
    from mindspore_worker_check import make_batches, reference_gradients
    from pulse_mindspore.backend import MindSporeBackend
    from pulse_mindspore.diffusion import eps_loss
    from pulse_mindspore.model import build_model

    def initial_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
        return {n: p.asnumpy() for n, p in build_model(spec, seed=0).params_by_name().items()}

    # M = P: MindSpore's PyNative CPU kernels are slow, and M = P already runs every warm-up,
    # steady and cool-down slot of these schedules
    return Rig(name="mindspore", float_dtype=ms.float32, int64_dtype=ms.int64, stage_microbatches=1,
               grad_tol=1e-4, loss_rel=1e-6, adamw_atol=1e-6,
               make_backend=MindSporeBackend, make_batches=lambda spec: make_batches(spec, MBS), loss_fn=eps_loss,
               to_numpy=lambda t: t.asnumpy(), whole_model=lambda spec, m: reference_gradients(spec, m, MBS),
               initial_weights=initial_weights)


def max_relative_error(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], floor: float = 1e-6) -> float:
    """max |got - ref| / max |ref| over tensors, the denominator floored at ``floor`` x the largest
    reference entry: some gradients are zero in exact arithmetic and hold only rounding noise.
    Fails when the two hold different parameter names."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))[:6]
    scale = max(float(np.abs(r).max()) for r in ref.values())
    return max(float(np.abs(got[k] - r).max()) / max(float(np.abs(r).max()), floor * scale) for k, r in ref.items())
