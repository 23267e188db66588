"""A CPU rank's first kernels, run before its memory baseline: what they fault in is the library's, not the stage's.

A CPU rank's measured memory is its resident peak above a baseline taken before it builds its stage
(``pulse.train.resident``). The first convolution, normalisation, attention, linear layer and AdamW
step a process runs fault in their code pages and set up per-thread state: about 25 MB with torch 2.13
on this project's CPU host (resident 291.7 -> 314.0 MB for one tiny conv, group norm and attention
forward and backward; 2.5 MB more for AdamW's first step). A device's allocator counts none of it (it
counts tensors) and the simulator does not price it; on tiny-unet it was a third of the stage (README's
first command: 0.09 GiB measured against 0.05 predicted). So each kind of kernel runs once, on tiny
tensors, before the baseline, as the libraries are imported before it. Nothing here draws from a random
generator: the run's draws are unchanged.
"""
from __future__ import annotations


def warm_kernels(autocast_dtype=None) -> None:
    """One forward, backward and AdamW step through the kinds of layers the models have, on a CPU; again
    under the run's autocast (``--precision bf16``), whose kernels are others."""
    import torch

    _one_step()
    if autocast_dtype is not None:
        with torch.autocast("cpu", dtype=autocast_dtype):
            _one_step()


def _one_step() -> None:
    import torch
    import torch.nn.functional as F

    channels, side = 8, 8
    weights = {"conv": torch.full((channels, channels, 3, 3), 0.01), "norm": torch.ones(channels),
               "proj": torch.full((16, side * side), 0.01)}
    for w in weights.values():
        w.requires_grad_(True)
    x = torch.linspace(-1, 1, 2 * channels * side * side).reshape(2, channels, side, side)
    h = F.silu(F.group_norm(F.conv2d(x, weights["conv"], padding=1), 4, weights["norm"]))
    h = F.interpolate(F.avg_pool2d(h, 2), scale_factor=2.0, mode="nearest")
    tokens = F.layer_norm(F.gelu(F.linear(h.flatten(2), weights["proj"])), (16,))
    attended = F.scaled_dot_product_attention(tokens, tokens, tokens)
    both = torch.cat([attended, tokens], dim=1)
    F.mse_loss(both.float(), torch.zeros(both.shape)).backward()
    torch.optim.AdamW(list(weights.values()), lr=1e-3).step()
