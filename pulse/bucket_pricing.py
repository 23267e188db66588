"""A plan priced over aspect-ratio buckets: memory at the largest bucket, time over the bucket mix.

A bucketed run trains each step at one bucket's latent size (``pulse.train.bucket_sampler``), so its
activations, messages and compute change step by step::

    spec at the model's latent (H, W) ─ spec_at(latent (h, w)): per layer, what grows with the image
        grows by r = h*w / (H*W): output, saved and skip bytes, convolution and linear FLOPs; the
        UNet attention's token-by-token scores by r^2 (tokens = pixels of its level); the time
        embedding's MLP and the text context not at all
    cost table ─ costs_at: a measured table's per-layer seconds and act_mem scaled by r (per action
        and optimizer costs stay), an analytic one profiled again on spec_at
    plan_for_buckets: the plan made at the largest bucket (its memory is the run's peak)
    predict_buckets:  each bucket simulated; step_seconds = sum(share_k * step_k), the peak memory the
                      largest over buckets, per bucket figures under "buckets"

kohya's buckets at one target area have areas within a few percent of it, so every bucket prices
close to the square; --bucket-no-upscale buckets can be much smaller.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.grad_buckets import BUCKET_CAP_BYTES
from pulse.hardware import Cluster
from pulse.plan import Plan
from pulse.spec import Layer, ModelSpec
from pulse.zoo.common import attention_flops, linear_flops
from pulse.zoo.shapes import latent_shape
from pulse.zoo.unet_blocks import ATTENTION_KINDS

FIXED_FLOPS = ("time_embed",)  # the timestep MLP: the same work at any image size
SQUARE_ONLY = ("uvit_embed", "hdit_patch_embed")  # U-ViT's pos_embed, Hunyuan-DiT's RoPE grid and unpatchify
TEMB_RESNETS = ("resnet", "resnet_in")  # ResNet blocks (or first halves) projecting the time embedding


@dataclass(frozen=True)
class BucketShare:
    latent: tuple[int, int]  # (height, width) in latents: the bucket's pixels / the VAE's factor
    share: float  # of the run's steps (BucketSampler.bucket_shares)


def area_ratio(spec: ModelSpec, latent: tuple[int, int]) -> float:
    _, height, width = latent_shape(spec)
    return latent[0] * latent[1] / (height * width)


def _layer_at(layer: Layer, r: float, sides: tuple[float, float], act_bytes: int) -> Layer:
    attrs = dict(layer.attrs)
    if "height" in attrs and "width" in attrs:  # the grid this layer sees at the bucket
        attrs["height"], attrs["width"] = round(attrs["height"] * sides[0]), round(attrs["width"] * sides[1])
    if layer.kind in FIXED_FLOPS:  # the latent passes through (its output grows); the MLP's work does not
        return replace(layer, out_bytes=round(layer.out_bytes * r), attrs=attrs)
    flops, saved = layer.flops * r, layer.saved_bytes * r
    if layer.kind in ATTENTION_KINDS:  # self-attention scores grow with tokens^2, the context's k, v not at all
        a = layer.attrs
        n, c = a["height"] * a["width"], a["channels"]
        selfs, crosses = ((a["num_layers"],) * 2 if layer.kind == "transformer2d"
                          else (int(a["half"] == "self"), int(a["half"] == "cross")))  # a part: one half of a block
        quadratic = selfs * attention_flops(n, n, c)
        fixed_flops = crosses * 2 * linear_flops(a["context_dim"], c, a["context_len"])  # the context's k, v
        fixed_saved = crosses * 2 * a["context_len"] * c * act_bytes
        flops = (layer.flops - quadratic - fixed_flops) * r + quadratic * r * r + fixed_flops
        saved = (layer.saved_bytes - fixed_saved) * r + fixed_saved
    elif layer.kind in TEMB_RESNETS:  # the time embedding's projection: one vector per sample at any size
        a = layer.attrs
        fixed_flops, fixed_saved = 2 * a["temb_channels"] * a["out_channels"], a["temb_channels"] * act_bytes
        flops = (layer.flops - fixed_flops) * r + fixed_flops
        saved = (layer.saved_bytes - fixed_saved) * r + fixed_saved
    return replace(layer, flops=float(flops), out_bytes=round(layer.out_bytes * r), saved_bytes=round(saved),
                   attrs=attrs)


def spec_at(spec: ModelSpec, latent: tuple[int, int]) -> ModelSpec:
    """``spec`` trained at another latent (height, width) (a UNet: its layers take any grid)."""
    _, height, width = latent_shape(spec)
    if (height, width) == tuple(latent):
        return spec
    _check_grid(spec)
    r = area_ratio(spec, latent)
    sides = (latent[0] / height, latent[1] / width)
    return replace(spec, layers=tuple(_layer_at(l, r, sides, spec.act_bytes) for l in spec.layers),
                   skips=tuple(replace(e, bytes=round(e.bytes * r)) for e in spec.skips))


def _check_grid(spec: ModelSpec) -> None:
    square = [l.kind for l in spec.layers if l.kind in SQUARE_ONLY]
    if square:
        raise PulseError(f"aspect-ratio buckets train UNet backbones; {spec.name}'s {square[0]} layer holds tables "
                         "for one square grid (position embeddings, RoPE): train it without --buckets")


def _ratios(old: tuple[float, ...], new: tuple[float, ...]) -> list[float]:
    return [n / o if o else 1.0 for o, n in zip(old, new)]


def costs_at(costs: CostTable, spec: ModelSpec, bucket_spec: ModelSpec,
             profiler: Callable[[ModelSpec, int], CostTable] | None = None) -> CostTable:
    """The cost table of ``bucket_spec`` (``spec_at``): an analytic table profiled again on it (``profiler``),
    a measured one scaled layer by layer (seconds by the layer's FLOPs ratio, act_mem by its saved bytes')."""
    if bucket_spec is spec:
        return costs
    if costs.source.startswith("analytic") and profiler is not None:
        fresh = profiler(bucket_spec, costs.microbatch_size)
        if costs.whole_backward_in_b:  # as the backend's traits ran the table (BackendTraits.runs)
            fresh = replace(fresh, whole_backward_in_b=True, bwd_input=fresh.bwd, bwd_weight=(0.0,) * len(fresh.bwd))
        return replace(fresh, encoder_fwd=costs.encoder_fwd)
    work = _ratios(tuple(l.flops for l in spec.layers), tuple(l.flops for l in bucket_spec.layers))
    kept = _ratios(tuple(l.saved_bytes for l in spec.layers), tuple(l.saved_bytes for l in bucket_spec.layers))

    def seconds(column: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(s * w for s, w in zip(column, work)) if column else column

    flops = [l.flops for l in spec.layers], [l.flops for l in bucket_spec.layers]

    def span_work(a: int, b: int) -> float:  # a measured chunk scaled as its layers' work
        return sum(flops[1][a:b]) / sum(flops[0][a:b]) if sum(flops[0][a:b]) > 0 else 1.0

    return replace(costs, fwd=seconds(costs.fwd), bwd=seconds(costs.bwd), bwd_input=seconds(costs.bwd_input),
                   bwd_weight=seconds(costs.bwd_weight),
                   act_mem=tuple(round(m * k) for m, k in zip(costs.act_mem, kept)),
                   spans=tuple((a, b, k, t * span_work(a, b)) for a, b, k, t in costs.spans))


def largest(mix: list[BucketShare]) -> BucketShare:
    """The bucket whose steps hold the most (the largest latent area)."""
    if not mix or any(b.share < 0 for b in mix) or sum(b.share for b in mix) <= 0:
        raise PulseError("a bucket mix needs at least one bucket and shares >= 0 that sum above 0")
    return max(mix, key=lambda b: b.latent[0] * b.latent[1])


def predict_buckets(spec: ModelSpec, costs: CostTable, cluster: Cluster, plan: Plan, mix: list[BucketShare],
                    adapters: tuple[int, ...] | None = None, memory=None,
                    bucket_cap: int = BUCKET_CAP_BYTES) -> dict:
    """``pulse.planner.predict`` over the bucket mix: step time the share-weighted mean of each bucket's
    simulated step, memory the largest bucket's (the peak over buckets), each bucket's figures under
    ``buckets``."""
    from pulse.planner import predict

    _check_grid(spec)
    largest(mix)  # refuses an empty or negative mix
    total = sum(b.share for b in mix)
    profiler = AnalyticProfiler(cluster.hardware).profile
    rows = []
    for bucket in mix:
        at = spec_at(spec, bucket.latent)
        figures = predict(at, costs_at(costs, spec, at, profiler), cluster, plan, adapters, memory, bucket_cap)
        if "note" in figures:  # not simulated: the plan's own note says why
            return figures
        rows.append((bucket.share / total, bucket, figures))
    out = dict(max(rows, key=lambda row: row[2]["peak_memory_bytes"])[2])  # the peak bucket's memory figures
    out["step_seconds"] = sum(share * f["step_seconds"] for share, _, f in rows)
    out["pipeline_seconds"] = sum(share * f["pipeline_seconds"] for share, _, f in rows)
    out["pipeline_bytes_per_step"] = sum(share * f["pipeline_bytes_per_step"] for share, _, f in rows)
    out.pop("samples_per_second", None)
    out["buckets"] = [{"latent": list(b.latent), "share": share, "step_seconds": f["step_seconds"],
                       "peak_memory_bytes": f["peak_memory_bytes"]} for share, b, f in rows]
    return out


def plan_for_buckets(spec: ModelSpec, costs: CostTable, cluster: Cluster, request, mix: list[BucketShare],
                     **hooks) -> Plan:
    """``pulse.planner.make_plan`` at the largest bucket (memory caps and cuts for the run's peak), then
    predicted over the mix."""
    from pulse.planner import make_plan

    _check_grid(spec)
    top = spec_at(spec, largest(mix).latent)
    plan = make_plan(top, costs_at(costs, spec, top, AnalyticProfiler(cluster.hardware).profile), cluster,
                     request, **hooks)
    costs, cluster = request.traits.runs(costs, cluster)
    return replace(plan, predicted=predict_buckets(spec, costs, request.link_cluster(cluster), plan, mix,
                                                   request.adapters, request.memory, request.bucket_cap))


def cache_mix(path: str | None, global_batch: int) -> list[BucketShare] | None:
    """A bucketed latent cache's mix (``pulse cache-latents --buckets``): each bucket's share of an epoch's
    steps as ``pulse.train.bucket_sampler`` draws them (its images over the global batch, rounded up);
    None for anything else."""
    from pathlib import Path

    from pulse.data.shards import read_manifest

    if path is None or not Path(path).is_dir():
        return None
    manifest = read_manifest(Path(path))
    if not manifest or "buckets" not in manifest:
        return None
    counts = [0] * len(manifest["buckets"]["latents"])
    for shard in manifest["shards"]:
        counts[int(shard["bucket"])] += int(shard["count"])
    steps = [-(-c // global_batch) for c in counts]
    return [BucketShare((int(shape[1]), int(shape[2])), s / sum(steps))
            for shape, s in zip(manifest["buckets"]["latents"], steps) if s]


def images_mix(items, settings, factor: int, global_batch: int) -> list[BucketShare]:
    """`pulse train --images --buckets`: each bucket's share of steps from the images' header sizes
    (``pulse.data.buckets``' assignment, as the ranks make it), latents at the VAE's ``factor``."""
    from PIL import Image

    from pulse.data.buckets import bucket_resolutions, select_bucket

    resos = None if settings.no_upscale else bucket_resolutions(settings)
    counts: dict[tuple[int, int], int] = {}
    for item in items:
        with Image.open(item.image if hasattr(type(item), "image") else item.path) as image:
            bucket, _ = select_bucket(image.size, settings, resos)
        counts[bucket] = counts.get(bucket, 0) + 1
    steps = {b: -(-c // global_batch) for b, c in sorted(counts.items())}
    return [BucketShare((h // factor, w // factor), s / sum(steps.values())) for (w, h), s in steps.items()]
