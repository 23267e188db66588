"""What the diffusers-model tests share: the single-device training step they compare pipelines with."""
from __future__ import annotations

import numpy as np
import torch

from pulse_torch.diffusers_adapter import DiffusersAdapter
from pulse_torch.diffusion import eps_loss
from torch_worker_check import make_batches


def single_device_reference(adapter: DiffusersAdapter, microbatches: int) -> tuple[dict[str, np.ndarray], float]:
    """Single-device training on the model itself: model(...) per microbatch, loss gradient / M;
    every parameter's gradient (zeros where none) and the mean loss."""
    adapter.model.zero_grad(set_to_none=True)
    batches, total = make_batches(adapter.spec, 1), 0.0
    for mb in range(microbatches):
        batch = batches(mb)
        out = adapter.call_model(batch)
        loss, grad = eps_loss({"h": out}, batch)
        out.backward(grad["h"] / microbatches)
        total += float(loss)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy().copy()
             for n, p in adapter.model.named_parameters()}
    return grads, total / microbatches
