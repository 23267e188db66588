"""A plan priced over aspect-ratio buckets: each bucket's spec against the zoo's own builder at that size,
step time the share-weighted mean of independently simulated buckets, memory at the largest."""
import pytest

from pulse.bucket_pricing import BucketShare, costs_at, plan_for_buckets, predict_buckets, spec_at
from pulse.costs import AnalyticProfiler
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.planner import PlanRequest, make_plan, predict
from pulse.zoo import get_spec
from pulse.zoo.shapes import latent_shape

CLUSTER = load_cluster("cpu-local")
PROFILE = AnalyticProfiler(CLUSTER.hardware).profile


def figures_of(spec):
    return ([(l.name, l.flops, l.out_bytes, l.saved_bytes, l.attrs) for l in spec.layers],
            [(e.key, e.bytes) for e in spec.skips], [(s.name, s.bytes) for s in spec.shared_inputs])


@pytest.mark.parametrize("model", ["tiny-unet", "sd2-unet", "sdxl-unet"])
@pytest.mark.parametrize("num,den", [(2, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("options", [{}, {"split_transformers": True}])
def test_a_bucket_spec_is_the_zoo_builder_at_that_size(model, num, den, options):
    """Square buckets the zoo can build: every layer's FLOPs (attention's quadratic part too, whole or in
    a transformer's parts), output, saved and skip bytes and grid equal the builder's own at that resolution."""
    spec = get_spec(model, **options)
    _, height, width = latent_shape(spec)
    latent = (height * num // den, width * num // den)
    assert figures_of(spec_at(spec, latent)) == figures_of(get_spec(model, resolution=latent[0] * 8, **options))


def test_a_non_square_bucket_of_the_same_area_costs_the_same():
    spec = get_spec("tiny-unet")  # 16 x 16 latents: 8 x 32 has as many pixels (and attention tokens)
    wide = spec_at(spec, (8, 32))
    assert [(l.flops, l.out_bytes, l.saved_bytes) for l in wide.layers] == \
        [(l.flops, l.out_bytes, l.saved_bytes) for l in spec.layers]
    assert wide.layers[1].attrs["height"] == 8 and wide.layers[1].attrs["width"] == 32


def test_measured_tables_scale_by_each_layers_work():
    spec = get_spec("tiny-unet")
    measured = PROFILE(spec, 2)
    measured = type(measured)(**{**measured.__dict__, "source": "measured"})
    big = spec_at(spec, (32, 32))
    scaled = costs_at(measured, spec, big)
    reference = PROFILE(big, 2)  # the roofline is FLOP-bound here, so seconds follow FLOPs
    assert scaled.act_mem == pytest.approx(reference.act_mem, rel=1e-6)
    assert [b / a for a, b in zip(measured.fwd, scaled.fwd)] == \
        pytest.approx([b.flops / a.flops for a, b in zip(spec.layers, big.layers)])


def test_predicted_step_is_the_mix_of_simulated_buckets_and_memory_the_largest():
    spec = get_spec("tiny-unet")
    costs = PROFILE(spec, 2)
    mix = [BucketShare((16, 16), 3.0), BucketShare((32, 32), 1.0)]
    request = PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2, schedule="greedy_v_1f1b")
    plan = plan_for_buckets(spec, costs, CLUSTER, request, mix)
    big = get_spec("tiny-unet", resolution=256)
    at_largest = make_plan(big, PROFILE(big, 2), CLUSTER, request)
    assert plan.placement == at_largest.placement  # cut for the largest bucket's memory and time
    # each bucket simulated independently on the zoo's own spec at its size
    small_figures = predict(spec, costs, CLUSTER, plan)
    big_figures = predict(big, PROFILE(big, 2), CLUSTER, plan)
    got = plan.predicted
    assert got["step_seconds"] == pytest.approx(0.75 * small_figures["step_seconds"] + 0.25 * big_figures["step_seconds"])
    assert got["peak_memory_bytes"] == big_figures["peak_memory_bytes"] > small_figures["peak_memory_bytes"]
    assert [b["share"] for b in got["buckets"]] == [0.75, 0.25]
    assert predict_buckets(spec, costs, CLUSTER, plan, mix)["step_seconds"] == got["step_seconds"]


def test_square_only_backbones_and_empty_mixes_are_refused():
    with pytest.raises(PulseError, match="UNet backbones"):
        spec_at(get_spec("tiny-dit"), (4, 16))
    spec = get_spec("tiny-unet")
    plan = make_plan(spec, PROFILE(spec, 2), CLUSTER, PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2,
                                                                  schedule="greedy_v_1f1b"))
    with pytest.raises(PulseError, match="at least one bucket"):
        predict_buckets(spec, PROFILE(spec, 2), CLUSTER, plan, [])


def test_a_bucketed_cache_gives_the_samplers_mix(tmp_path):
    import json

    import numpy as np

    from pulse.bucket_pricing import cache_mix
    from pulse.train.bucket_sampler import BucketSampler

    members = {0: 5, 1: 12, 2: 3}  # images per bucket
    shards = [{"name": f"shard-{i:05d}", "bucket": k, "count": n, "members": []}
              for i, (k, n) in enumerate(members.items())]
    (tmp_path / "manifest.json").write_text(json.dumps({
        "pulse_latent_cache": 1, "complete": True, "shards": shards,
        "buckets": {"latents": [[4, 8, 24], [4, 16, 16], [4, 24, 8]], "sizes": [], "settings": {}}}))
    mix = cache_mix(str(tmp_path), global_batch=4)
    sampler = BucketSampler(np.repeat(list(members), list(members.values())), 1, 2, 2, seed=0)
    assert [b.latent for b in mix] == [(8, 24), (16, 16), (24, 8)]
    assert [b.share for b in mix] == pytest.approx(list(sampler.bucket_shares()))
    assert cache_mix(None, 4) is None and cache_mix(str(tmp_path / "none"), 4) is None


def test_images_give_the_mix_their_buckets_make(tmp_path):
    from PIL import Image

    from pulse.bucket_pricing import images_mix
    from pulse.data.buckets import BucketSettings, fit_image
    from pulse.data.captioned_images import Captioned

    sizes = [(40, 12), (12, 40), (20, 20), (30, 11), (22, 19), (10, 33), (41, 13)]
    items = []
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h)).save(tmp_path / f"{i}.png")
        items.append(Captioned(tmp_path / f"{i}.png", "x"))
    settings = BucketSettings(16, 8, 32, 8)
    mix = images_mix(items, settings, factor=2, global_batch=2)
    buckets = sorted({fit_image(s, settings).bucket for s in sizes})
    steps = [-(-sum(fit_image(s, settings).bucket == b for s in sizes) // 2) for b in buckets]
    assert [m.latent for m in mix] == [(h // 2, w // 2) for w, h in buckets]
    assert [m.share for m in mix] == pytest.approx([s / sum(steps) for s in steps])


def test_a_measured_chunk_scales_by_its_layers_work():
    """A chunk timed whole (``CostTable.spans``) at another bucket's size: its seconds times the ratio
    of its layers' FLOPs there and here, as its layers' own figures scale."""
    from dataclasses import replace
    spec = get_spec("tiny-unet")
    measured = replace(PROFILE(spec, 2), source="measured", spans=((0, 5, "F", 0.01), (5, 9, "B", 0.02)))
    big = spec_at(spec, (32, 32))
    scaled = costs_at(measured, spec, big)
    for (a, b, kind, t), (x, y, k, u) in zip(measured.spans, scaled.spans):
        assert (a, b, kind) == (x, y, k)
        assert u / t == pytest.approx(sum(l.flops for l in big.layers[a:b]) / sum(l.flops for l in spec.layers[a:b]))
    assert scaled.span(0, 5)[0] == pytest.approx(scaled.spans[0][3])
