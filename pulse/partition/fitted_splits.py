"""Finer layers only where a cut falls.

``split_resnets`` and ``split_transformers`` cut every ResnetBlock2D and Transformer2DModel in two, so
that the partitioner can balance; but each half is a layer more to launch in every pass, on every
microbatch (SD v2 at finer layers: 85 layers against 47, 3.0 ms of compute above the floor per 910A
device at pp 8, batch 32, where the plan's cuts enter 6 of the 38 blocks). A plan needs only the blocks
its cuts fall inside split::

    finer spec + placement ─ blocks_cut ─▶ {"split_resnets": ("up1_res0", ...), "split_transformers": ...}
                                             │ build (the zoo, with those options)
                                             ▼
                            fitted spec, the same cuts on its layers (``fit_splits``)

The fitted plan runs the same chunks on the same devices; only the blocks no cut enters are one
layer again. Pure: the caller says how a spec is built from options.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pulse.placement import Placement
from pulse.spec import ModelSpec
from pulse.zoo.common import BLOCK_NAME_OPTIONS
from pulse.zoo.unet_blocks import SPLIT_OPTIONS, block_of


@dataclass(frozen=True)
class FittedSplits:
    options: dict  # split_resnets / split_transformers: the blocks a cut falls inside, False where none
    spec: ModelSpec  # the model with only those blocks in two
    placement: Placement  # the same chunks, on ``spec``'s layers

    @property
    def plan_options(self) -> dict:
        """``options`` as a plan's model_options hold them (YAML lists, false where no block is split)."""
        return {option: list(names) if names else False for option, names in self.options.items()}


def blocks_cut(spec: ModelSpec, placement: Placement) -> dict:
    """Per split option, the blocks ``placement`` cuts between two of their layers (False: none)."""
    cut: dict[str, list[str]] = {option: [] for option in BLOCK_NAME_OPTIONS}
    for chunk in placement.chunks[1:]:
        before, after = spec.layers[chunk.start - 1], spec.layers[chunk.start]
        block = block_of(after)
        if block is not None and block == block_of(before):
            cut[SPLIT_OPTIONS[after.kind]].append(block)
    return {option: tuple(dict.fromkeys(names)) or False for option, names in cut.items()}


def fit_splits(spec: ModelSpec, placement: Placement, build: Callable[[dict], ModelSpec]) -> FittedSplits:
    """``placement`` (on ``spec``) on the model ``build`` makes with only the blocks it cuts split."""
    options = blocks_cut(spec, placement)
    fitted = build(options)
    index = {layer.name: i for i, layer in enumerate(fitted.layers)}

    def moved(layer: int) -> int:
        if layer == spec.num_layers:
            return fitted.num_layers
        name = spec.layers[layer].name  # a chunk starts at a block's first part where no cut enters it
        return index[name] if name in index else index[block_of(spec.layers[layer])]

    chunks = tuple(replace(c, start=moved(c.start), end=moved(c.end)) for c in placement.chunks)
    fitted_placement = replace(placement, chunks=chunks)
    fitted_placement.validate(fitted.num_layers)
    return FittedSplits(options, fitted, fitted_placement)
