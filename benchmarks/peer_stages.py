"""A diffusers UNet2DConditionModel cut by hand into sequential stages, as torch.distributed.pipelining
wants them: each stage an ``nn.Module`` whose forward takes and returns plain tensors.

The UNet as a flat list of units, each one call of the model's own module::

    time      model.time_proj(t) -> model.time_embedding            makes temb
    conv_in   model.conv_in(h)                                      push h
    resnet    down_blocks.i.resnets.j(h, temb) / mid_block.resnets.j
    attn      <block>.attentions.j(h, encoder_hidden_states=ctx)    (down: push h after it)
    down      down_blocks.i.downsamplers.0(h)                       push h
    up_resnet up_blocks.k.resnets.j(cat[h, pop()], temb)
    upsample  up_blocks.k.upsamplers.0(h)
    conv_out  model.conv_out(model.conv_act(model.conv_norm_out(h)))

A stage is a contiguous run of units. What crosses its boundary is what a
sequential pipeline has to move: the main activation, every skip pushed
before the boundary and popped after it (relayed through each boundary it
spans, forward and backward: the baseline's cost), and temb. The text
context and the timesteps are the batch's own: every rank gets them as
keyword arguments of ``schedule.step`` (pipelining hands a rank's kwargs to
its own stages, split into microbatches like the args), so they cross no link
— the strongest form of the baseline, not the weakest.

    stage 0:      forward(sample, *, timesteps, ctx)      -> (h, *skips, temb)
    stage i:      forward(h, *skips, temb, *, timesteps, ctx) -> (h, *skips', temb)
    last stage:   forward(h, *skips, temb, *, timesteps, ctx) -> eps

The two workarounds torch.distributed.pipelining needed (``WORKAROUNDS``; a
stage built without one shows what fails, ``peer_pipelining.py --probe``):

* ``contiguous_grads``: a hook on each stage input makes its gradient
  contiguous (gloo cannot receive into the strided buffer pipelining would
  otherwise allocate for a concatenated skip's gradient);
* ``fresh_outputs``: a non-last stage returns clones of every output but a
  freshly computed h. The zero-bubble schedules end a stage's input-backward
  with ``t.detach_()`` on every output; the weight-backward that follows
  still needs the tensors the stage's own units saved, and a skip or temb
  the stage returns is also an input of its later units ("Trying to use a
  saved tensor that has been detached in-place"); a returned input or view
  cannot be detached in place at all.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

# The diffusers UNet the peer benchmark trains (validate.py's "diffusers-unet": seconds per step on CPU).
UNET_CONFIG = {"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64, 64], "layers_per_block": 1,
               "sample_size": 32, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 32,
               "attention_head_dim": 8, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                             "DownBlock2D"],
               "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
# What torch.distributed.pipelining needed to train this model (module docstring): by name, so that a
# run can leave one out and show what fails without it.
WORKAROUNDS = ("contiguous_grads", "fresh_outputs")
CONTEXT_LEN = 77  # text tokens: what PULSE assumes for a config-only UNet folder (CLIP's 77)


@dataclass(frozen=True)
class Unit:
    """One call of the model's own module: ``kind`` (see the module docstring), ``path`` the module's
    name in the model, ``push`` whether h becomes a skip after it."""

    kind: str
    path: str
    push: bool = False


def unet_units(model: nn.Module) -> list[Unit]:
    """The UNet's forward as units, in call order (plain config: no class/addition embeddings, no FreeU)."""
    units = [Unit("time", "time_embedding"), Unit("conv_in", "conv_in", push=True)]
    for i, block in enumerate(model.down_blocks):
        attentions = getattr(block, "attentions", None)
        for j in range(len(block.resnets)):
            units.append(Unit("resnet", f"down_blocks.{i}.resnets.{j}", push=attentions is None))
            if attentions is not None:
                units.append(Unit("attn", f"down_blocks.{i}.attentions.{j}", push=True))
        if block.downsamplers is not None:
            units.append(Unit("down", f"down_blocks.{i}.downsamplers.0", push=True))
    mid = model.mid_block
    units.append(Unit("resnet", "mid_block.resnets.0"))
    for j in range(len(mid.attentions)):
        units += [Unit("attn", f"mid_block.attentions.{j}"), Unit("resnet", f"mid_block.resnets.{j + 1}")]
    for k, block in enumerate(model.up_blocks):
        attentions = getattr(block, "attentions", None)
        for j in range(len(block.resnets)):
            units.append(Unit("up_resnet", f"up_blocks.{k}.resnets.{j}"))
            if attentions is not None:
                units.append(Unit("attn", f"up_blocks.{k}.attentions.{j}"))
        if block.upsamplers is not None:
            units.append(Unit("upsample", f"up_blocks.{k}.upsamplers.0"))
    return units + [Unit("conv_out", "conv_out")]


class UnitCall(nn.Module):
    """One unit over the model's own module(s); ``forward(h, skips, temb, ctx, timesteps) -> (h, temb)``,
    ``skips`` pushed or popped in place."""

    def __init__(self, model: nn.Module, unit: Unit) -> None:
        super().__init__()
        self.kind, self.push = unit.kind, unit.push
        self.inner = model.get_submodule(unit.path)
        if unit.kind == "time":
            self.time_proj = model.time_proj  # a parameter-free sinusoid
        if unit.kind == "conv_out":
            self.norm, self.act = model.conv_norm_out, model.conv_act

    def forward(self, h: Tensor, skips: list[Tensor], temb: Tensor | None, ctx: Tensor,
                timesteps: Tensor) -> tuple[Tensor, Tensor | None]:
        kind = self.kind
        if kind == "time":  # diffusers' get_time_embed: the sinusoid in fp32, cast to the sample's dtype
            return h, self.inner(self.time_proj(timesteps).to(h.dtype), None)
        if kind in ("conv_in", "down"):
            h = self.inner(h)
        elif kind == "resnet":
            h = self.inner(h, temb)
        elif kind == "up_resnet":
            h = self.inner(torch.cat([h, skips.pop()], dim=1), temb)
        elif kind == "attn":
            h = self.inner(h, encoder_hidden_states=ctx, return_dict=False)[0]
        elif kind == "upsample":
            h = self.inner(h, None)
        elif kind == "conv_out":
            h = self.inner(self.act(self.norm(h)))
        if self.push:
            skips.append(h)
        return h, temb


def contiguous_grad(t: Tensor) -> None:
    """Make ``t``'s gradient contiguous (a hook, once per tensor: pipelining reuses its receive
    buffers). A skip a stage receives and concatenates gets its gradient from ``torch.cat``'s
    backward as a strided slice; pipelining allocates the previous stage's receive buffer with
    those strides (``empty_strided``) and gloo refuses to receive into, or send from, a
    non-contiguous tensor. Hooks reach ``autograd.grad`` (zero bubble) and ``.grad`` alike."""
    if t.requires_grad and not getattr(t, "_contiguous_grad", False):
        t.register_hook(lambda g: g.contiguous())
        t._contiguous_grad = True  # type: ignore[attr-defined]


class Stage(nn.Module):
    """Units ``[start, end)`` of the model as one pipelining stage (signatures in the module docstring);
    ``pending``: the skips pushed before ``start`` and not yet popped."""

    def __init__(self, model: nn.Module, units: Sequence[Unit], start: int, end: int,
                 workarounds: Sequence[str] = WORKAROUNDS) -> None:
        super().__init__()
        self.calls = nn.ModuleList(UnitCall(model, u) for u in units[start:end])
        self.first, self.last = start == 0, end == len(units)
        self.pending = pending_skips(units, start)
        unknown = set(workarounds) - set(WORKAROUNDS)
        if unknown:
            raise ValueError(f"unknown workarounds {sorted(unknown)}; known: {WORKAROUNDS}")
        self.contiguous_grads, self.fresh_outputs = (w in workarounds for w in WORKAROUNDS)

    def forward(self, *tensors: Tensor, timesteps: Tensor, ctx: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self.first:
            h, skips, temb = tensors[0], [], None
        else:
            h, *skips, temb = tensors
            for t in tensors if self.contiguous_grads else ():
                contiguous_grad(t)
        for call in self.calls:
            h, temb = call(h, skips, temb, ctx, timesteps)
        if self.last:
            return h
        out = (h, *skips, temb)
        if self.fresh_outputs:  # see the module docstring: pipelining detach_()es what a stage returns
            inputs = {id(t) for t in tensors}
            out = tuple(t.clone() if i > 0 or id(t) in inputs or t._is_view() else t for i, t in enumerate(out))
        return out


def pending_skips(units: Sequence[Unit], boundary: int) -> int:
    """Skips pushed before unit ``boundary`` and still waiting for their up_resnet."""
    return sum(u.push for u in units[:boundary]) - sum(u.kind == "up_resnet" for u in units[:boundary])


def balanced_cuts(costs: Sequence[float], parts: int) -> list[int]:
    """Cut points ``[0, c1, ..., len(costs)]`` into ``parts`` contiguous runs: the least largest run
    (the compute balance a user aims for when cutting a pipeline by hand), and among the cuts that
    reach it the most even (least sum of squares: a few heavy units set the largest run, and
    without this the other runs could be anything from empty to nearly as heavy)."""
    bound = _cheapest_cuts(costs, parts, lambda before, run: max(before, run))[0] * (1 + 1e-9)
    return _cheapest_cuts(costs, parts, lambda before, run: before + run * run if run <= bound else math.inf)[1]


def _cheapest_cuts(costs: Sequence[float], parts: int,
                   combine: Callable[[float, float], float]) -> tuple[float, list[int]]:
    """Dynamic programme over contiguous runs: the cuts whose runs, folded by ``combine``, cost least."""
    n, prefix = len(costs), [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = combine(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    cuts, j = [n], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        cuts.append(j)
    return best[parts][n], cuts[::-1]


def build_model(seed: int = 0, config: dict | None = None) -> nn.Module:
    """The benchmark's UNet (``config``, default ``UNET_CONFIG``), random weights from ``seed``, built
    offline from the config."""
    import diffusers

    torch.manual_seed(seed)
    return diffusers.UNet2DConditionModel(**_init_arguments(config or UNET_CONFIG))


def build_meta_model(config: dict) -> nn.Module:
    """The UNet's structure on the meta device, no parameter memory: what a rank cuts its stages from
    before it materializes them (torchtitan's way: no rank ever holds the whole model)."""
    import diffusers

    with torch.device("meta"):
        return diffusers.UNet2DConditionModel(**_init_arguments(config))


def materialize(module: nn.Module, seed: int) -> nn.Module:
    """``module``'s meta parameters made real on the CPU and initialized from ``seed`` as the UNet's
    constructor initializes them: each submodule's own ``reset_parameters`` (torch's default
    initialization, which diffusers' UNet2DConditionModel keeps: Conv2d, Linear, GroupNorm, LayerNorm).
    A parameter no ``reset_parameters`` reaches, or a buffer (``to_empty`` leaves both as garbage),
    is refused rather than trained uninitialized."""
    module.to_empty(device="cpu")
    torch.manual_seed(seed)
    initialized: set[int] = set()
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
            initialized |= {id(p) for p in sub.parameters(recurse=False)}
    missed = [name for name, p in module.named_parameters() if id(p) not in initialized]
    buffers = [name for name, _ in module.named_buffers()]
    if missed or buffers:
        raise RuntimeError(f"cannot materialize: no reset_parameters for {missed[:3]}, buffers {buffers[:3]}")
    return module


def _init_arguments(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


@dataclass(frozen=True)
class Batch:
    """One step's global batch: the noisy latents the model sees, their timesteps, the text context
    and the noise (the epsilon target)."""

    sample: Tensor
    timesteps: Tensor
    ctx: Tensor
    target: Tensor


def make_batch(global_batch: int, seed: int, config: dict | None = None, latent: int | None = None) -> Batch:
    """Random latents ``latent`` x ``latent`` (default the config's ``sample_size``), timesteps, a text
    context of ``CONTEXT_LEN`` tokens of the config's ``cross_attention_dim``, and the noise target."""
    config = config or UNET_CONFIG
    g = torch.Generator().manual_seed(seed)
    size, channels = latent or config["sample_size"], config["in_channels"]
    return Batch(torch.randn(global_batch, channels, size, size, generator=g),
                 torch.randint(0, 1000, (global_batch,), generator=g),
                 torch.randn(global_batch, CONTEXT_LEN, config["cross_attention_dim"], generator=g),
                 torch.randn(global_batch, channels, size, size, generator=g))


def unit_forward_seconds(model: nn.Module, units: Sequence[Unit], batch: Batch, repeats: int = 3) -> list[float]:
    """Each unit's forward time on one microbatch (the least of ``repeats``: on a shared host a run
    is only ever slowed), one process: what the hand split balances."""
    calls = [UnitCall(model, u) for u in units]
    times: list[list[float]] = [[] for _ in units]
    with torch.no_grad():
        for _ in range(repeats + 1):
            h, skips, temb = batch.sample, [], None
            for i, call in enumerate(calls):
                start = time.perf_counter()
                h, temb = call(h, skips, temb, batch.ctx, batch.timesteps)
                times[i].append(time.perf_counter() - start)
    return [min(t[1:]) for t in times]  # the first pass warms the kernels


def stages_for(model: nn.Module, units: Sequence[Unit], cuts: Sequence[int]) -> list[Stage]:
    return [Stage(model, units, a, b) for a, b in zip(cuts, cuts[1:])]


def reference_losses(stages: Sequence[Stage], batch: Batch, microbatches: int) -> tuple[list[float], list[float]]:
    """The stages run one after another in one process on each microbatch: (each microbatch's loss,
    each stage's forward+backward seconds summed over the microbatches). Gradients accumulate as
    pipelining's (loss / microbatches)."""
    losses, seconds = [], [0.0] * len(stages)
    chunks = [torch.tensor_split(t, microbatches) for t in (batch.sample, batch.timesteps, batch.ctx, batch.target)]
    for sample, timesteps, ctx, target in zip(*chunks):
        carried: tuple[Tensor, ...] = (sample,)
        records = []
        for s, stage in enumerate(stages):
            start = time.perf_counter()
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point() and s > 0) for t in carried)
            out = stage(*inputs, timesteps=timesteps, ctx=ctx)
            seconds[s] += time.perf_counter() - start
            records.append((inputs, out))
            carried = out if isinstance(out, tuple) else (out,)
        loss = torch.nn.functional.mse_loss(carried[0], target)
        losses.append(float(loss.detach()))
        grads: tuple[Tensor | None, ...] = (None,)
        for s in range(len(stages) - 1, -1, -1):  # backward stage by stage, as the pipeline does
            inputs, out = records[s]
            start = time.perf_counter()
            if s == len(stages) - 1:
                (loss / microbatches).backward()
            else:
                pairs = [(o, g) for o, g in zip(out, grads) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = tuple(t.grad for t in inputs)
            seconds[s] += time.perf_counter() - start
    return losses, seconds


def tensor_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def boundary_bytes(stages: Sequence[Stage], batch: Batch, microbatches: int) -> list[int]:
    """Bytes each stage boundary carries forward per microbatch (what stage i returns, i < last)."""
    sample, timesteps, ctx = (torch.tensor_split(t, microbatches)[0] for t in (batch.sample, batch.timesteps,
                                                                                 batch.ctx))
    out, sizes = (sample,), []
    with torch.no_grad():
        for stage in stages[:-1]:
            out = stage(*out, timesteps=timesteps, ctx=ctx)
            sizes.append(tensor_bytes(out))
    return sizes
