"""The model zoo: parameter counts, FLOPs, skips and YAML files, checked against hand counts.

The exact totals were also checked offline against the real modules (diffusers
UNet2DConditionModel / HunyuanDiT2DModel built from config on the meta device,
and the U-ViT reference code), layer by layer for the UNets.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pulse.errors import SpecError
from pulse.spec_io import load_spec, save_spec
from pulse.zoo import ZOO_NAMES, get_spec

MODELS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
SD2_PARAMS = 865_910_724  # diffusers UNet2DConditionModel, stabilityai/stable-diffusion-2


@pytest.fixture(scope="module")
def specs():
    return {name: get_spec(name) for name in ZOO_NAMES}


def test_registry_lists_every_entry():
    assert set(ZOO_NAMES) == {"sd2-unet", "sd2-unet-768", "sdxl-unet", "uvit", "hunyuan-dit",
                              "tiny-unet", "tiny-uvit", "tiny-dit"}


# -- SD2 UNet -------------------------------------------------------------------

def test_sd2_total_params_match_the_real_model(specs):
    total = specs["sd2-unet"].total_params
    assert abs(total - SD2_PARAMS) / SD2_PARAMS < 0.005
    assert total == SD2_PARAMS


def _layer(spec, name):
    return spec.layers[spec.index(name)]


def test_sd2_block_params_by_hand(specs):
    s = specs["sd2-unet"]
    assert _layer(s, "down0_res0").params == 2 * (320 * 320 * 9 + 320) + 1280 * 320 + 320 + 2 * (2 * 320)
    # 640 -> 1280 ResNet: two GroupNorms, two 3x3 convs, temb projection, 1x1 shortcut.
    assert _layer(s, "down2_res0").params == (2 * 640 + 640 * 1280 * 9 + 1280 + 1280 * 1280 + 1280
                                              + 2 * 1280 + 1280 * 1280 * 9 + 1280 + 640 * 1280 + 1280)
    c = 320
    attn = (2 * c + (c * c + c)                                   # GroupNorm, proj_in
            + 2 * c + 3 * c * c + (c * c + c)                     # LN1, attn1 q k v (no bias), to_out
            + 2 * c + c * c + 2 * 1024 * c + (c * c + c)          # LN2, attn2 q, k v from 1024, to_out
            + 2 * c + (c * 8 * c + 8 * c) + (4 * c * c + c)       # LN3, GEGLU proj, FF out
            + (c * c + c))                                        # proj_out
    assert _layer(s, "down0_attn0").params == attn
    assert _layer(s, "time_embed").params == 320 * 1280 + 1280 + 1280 * 1280 + 1280
    assert _layer(s, "conv_in").params == 4 * 320 * 9 + 320
    assert _layer(s, "conv_out").params == 2 * 320 + 320 * 4 * 9 + 4


def test_sd2_conv_flops_by_hand(specs):
    s = specs["sd2-unet"]
    assert _layer(s, "conv_in").flops == 2 * 4 * 320 * 3 * 3 * 64 * 64
    assert _layer(s, "conv_out").flops == 2 * 320 * 4 * 3 * 3 * 64 * 64
    assert _layer(s, "down0_down").flops == 2 * 320 * 320 * 3 * 3 * 32 * 32  # stride 2: 64 -> 32
    assert _layer(s, "up1_up").flops == 2 * 1280 * 1280 * 3 * 3 * 32 * 32    # 16 -> 32, conv after


def test_sd2_attention_flops_by_hand(specs):
    n, c, l, ctx = 8 * 8, 1280, 77, 1024
    expected = (2 * (2 * n * c * c)                                   # proj_in, proj_out
                + 4 * (2 * n * c * c) + 2 * (2 * n * n * c)           # attn1: q k v out, QK^T, AV
                + 2 * (2 * n * c * c) + 2 * (2 * l * ctx * c) + 2 * (2 * n * l * c)  # attn2
                + 2 * n * c * 8 * c + 2 * n * 4 * c * c)              # GEGLU feed-forward
    assert _layer(specs["sd2-unet"], "mid_attn").flops == expected


def test_sd2_768_scales_conv_flops_by_2_25(specs):
    small, big = specs["sd2-unet"], specs["sd2-unet-768"]
    for name in ("conv_in", "down1_down", "up0_up", "conv_out"):  # pure convs
        assert _layer(big, name).flops == pytest.approx(2.25 * _layer(small, name).flops, rel=1e-12)
    assert big.total_params == small.total_params
    assert _layer(big, "conv_in").attrs["height"] == 96


def test_sd2_resolution_option_is_the_768_entry(specs):
    spec = get_spec("sd2-unet", resolution=768)
    assert spec == specs["sd2-unet-768"] and spec.name == "sd2-unet-768"
    assert get_spec("sd2-unet", resolution=512) == specs["sd2-unet"]


def test_sd2_skips_are_diffusers_down_block_res_samples(specs):
    s = specs["sd2-unet"]
    assert len(s.skips) == 12
    sources = {e.src for e in s.skips}
    assert sources == {"conv_in", "down0_attn0", "down0_attn1", "down0_down", "down1_attn0", "down1_attn1",
                       "down1_down", "down2_attn0", "down2_attn1", "down2_down", "down3_res0", "down3_res1"}
    by_dst = {e.dst: e for e in s.skips}
    assert by_dst["up3_res2"].src == "conv_in" and by_dst["up3_res2"].bytes == 320 * 64 * 64 * 2
    assert by_dst["up0_res0"].src == "down3_res1" and by_dst["up0_res0"].bytes == 1280 * 8 * 8 * 2
    for edge in s.skips:  # the consumer concatenates exactly the skip's channels
        dst, src = _layer(s, edge.dst), _layer(s, edge.src)
        assert dst.kind == "resnet"
        assert dst.attrs["skip_channels"] == src.attrs.get("out_channels", src.attrs.get("channels"))
        assert edge.bytes == src.out_bytes


def test_sd2_shared_inputs(specs):
    shared = {s.name: s for s in specs["sd2-unet"].shared_inputs}
    assert shared["temb"].producer == "time_embed" and shared["temb"].bytes == 1280 * 2
    assert shared["context"].producer is None and shared["context"].bytes == 77 * 1024 * 2


# -- U-ViT and Hunyuan-DiT ------------------------------------------------------

def test_uvit_h2(specs):
    s = specs["uvit"]
    assert s.total_params == 500_832_016  # paper: 501M
    kinds = [l.kind for l in s.layers]
    assert kinds.count("uvit_block_attn") == kinds.count("uvit_block_mlp") == 29
    assert s.num_layers == 1 + 2 * 29 + 1  # embed, 29 blocks as _attn + _mlp, final
    assert len(s.skips) == 14
    assert {(e.src, e.dst) for e in s.skips} == {(f"in{13 - i}_mlp", f"out{i}_attn") for i in range(14)}
    d, n = 1152, 258  # 256 patches + time token + label token
    assert s.skips[0].bytes == n * d * 2
    attn, mlp = _layer(s, "out0_attn"), _layer(s, "out0_mlp")
    assert attn.params == 2 * d + 3 * d * d + (d * d + d) + (2 * d * d + d)  # LN1, qkv (no bias), proj, skip_linear
    assert mlp.params == 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)     # LN2, fc1, fc2
    assert attn.flops == 2 * n * d * (3 * d + d + 2 * d) + 4 * n * n * d
    assert mlp.flops == 2 * n * d * 8 * d
    assert _layer(s, "in0_attn").params == attn.params - (2 * d * d + d)  # no skip_linear
    assert [l.name for l in s.layers[14 * 2 + 1:14 * 2 + 3]] == ["mid_attn", "mid_mlp"]


def test_hunyuan_dit(specs):
    s = specs["hunyuan-dit"]
    assert s.total_params == 1_516_534_048  # about 1.5B
    assert s.num_layers == 2 + 2 * 40 + 1  # cond_embed, patch_embed, 40 blocks as _attn + _mlp, final
    assert len(s.skips) == 19
    assert {(e.src, e.dst) for e in s.skips} == {(f"block{i}_mlp", f"block{39 - i}_attn") for i in range(19)}
    assert [l.attrs["skip"] for l in s.layers if l.kind == "hdit_block_attn"] == [i > 20 for i in range(40)]
    assert [l.kind for l in s.layers].count("hdit_block_mlp") == 40
    attn, mlp = _layer(s, "block0_attn"), _layer(s, "block0_mlp")
    assert attn.attrs["head_dim"] == 88 and attn.attrs["tokens"] == 4096
    assert mlp.attrs["mlp_hidden"] == 6144 and mlp.params == 2 * 1408 + (1408 * 6144 + 6144) + (6144 * 1408 + 1408)
    assert _layer(s, "block39_attn").params - attn.params == 2 * 2816 + 2816 * 1408 + 1408  # skip_norm, skip_linear
    assert _layer(s, "block39_mlp").params == mlp.params
    shared = {x.name: x for x in s.shared_inputs}
    assert shared["c"].producer == "cond_embed" and shared["c"].bytes == 1408 * 2
    assert shared["context"].bytes == (77 + 256) * 1024 * 2


@pytest.mark.parametrize("name, resnets", [("sd2-unet", 22), ("sdxl-unet", 17), ("tiny-unet", 8)])
def test_split_resnets_sum_to_the_whole_resnets(specs, name, resnets):
    """``split_resnets``: each ResnetBlock2D as two layers, parameters and FLOPs summing to the whole block;
    the first half's output carries the block's input behind ``y``; a decoder skip goes to the first half."""
    whole, split = specs[name], get_spec(name, split_resnets=True)
    assert split.num_layers == whole.num_layers + resnets
    assert split.total_params == whole.total_params and split.total_flops == whole.total_flops
    assert split.shared_inputs == whole.shared_inputs
    for layer in whole.layers:
        if layer.kind != "resnet":
            assert _layer(split, layer.name) == layer
            continue
        first, second = _layer(split, f"{layer.name}_in"), _layer(split, f"{layer.name}_out")
        assert (first.kind, second.kind) == ("resnet_in", "resnet_out")
        assert first.params + second.params == layer.params and first.flops + second.flops == layer.flops
        a = layer.attrs
        assert first.out_bytes == layer.out_bytes * (a["in_channels"] + a["out_channels"]) // a["out_channels"]
        assert second.out_bytes == layer.out_bytes
        assert first.attrs["ref_module"] == second.attrs["ref_module"] == a["ref_module"]
    renamed = {l.name: f"{l.name}_out" if l.kind == "resnet" else l.name for l in whole.layers}
    assert [(e.src, e.dst, e.bytes) for e in split.skips] == \
        [(renamed[e.src], f"{e.dst}_in", e.bytes) for e in whole.skips]


@pytest.mark.parametrize("name, attentions", [("sd2-unet", 16), ("sdxl-unet", 70), ("tiny-unet", 4)])
def test_split_transformers_sum_to_the_whole_models(specs, name, attentions):
    """``split_transformers``: each Transformer2DModel as two layers per block, parameters, FLOPs and saved
    bytes summing to the whole model's; every part but the last carries the model's input behind the
    tokens; a skip leaves from the last part."""
    whole, split = specs[name], get_spec(name, split_transformers=True)
    blocks = sum(l.attrs["num_layers"] for l in whole.layers if l.kind == "transformer2d")
    assert blocks == attentions  # SDXL: 7 x 10 blocks (a Transformer2DModel per level-2 attention and the mid)
    assert split.num_layers == whole.num_layers + 2 * blocks - len([l for l in whole.layers if l.kind == "transformer2d"])
    assert split.total_params == whole.total_params and split.total_flops == whole.total_flops
    assert split.shared_inputs == whole.shared_inputs
    for layer in whole.layers:
        if layer.kind != "transformer2d":
            assert _layer(split, layer.name) == layer
            continue
        parts = [_layer(split, f"{layer.name}_{half}{k}") for k in range(layer.attrs["num_layers"])
                 for half in ("self", "cross")]
        assert sum(p.params for p in parts) == layer.params and sum(p.flops for p in parts) == layer.flops
        assert sum(p.saved_bytes for p in parts) == layer.saved_bytes  # each saved tensor in the part making it
        assert [p.out_bytes for p in parts] == [2 * layer.out_bytes] * (len(parts) - 1) + [layer.out_bytes]
        assert {p.attrs["ref_module"] for p in parts} == {layer.attrs["ref_module"]}
    last = {l.name: f"{l.name}_cross{l.attrs['num_layers'] - 1}" if l.kind == "transformer2d" else l.name
            for l in whole.layers}
    assert [(e.src, e.dst, e.bytes) for e in split.skips] == [(last[e.src], e.dst, e.bytes) for e in whole.skips]


@pytest.mark.parametrize("name, blocks", [("uvit", 29), ("hunyuan-dit", 40), ("tiny-uvit", 7), ("tiny-dit", 8)])
def test_split_blocks_sum_to_the_whole_blocks(specs, name, blocks):
    """``split_blocks=False`` is the one-layer-per-block spec: each block is exactly its two halves fused."""
    split, whole = specs[name], get_spec(name, split_blocks=False)
    assert split.num_layers == whole.num_layers + blocks
    assert len(split.skips) == len(whole.skips) and split.shared_inputs == whole.shared_inputs
    assert split.total_params == whole.total_params and split.total_flops == whole.total_flops
    for layer in whole.layers:
        if not layer.kind.endswith("_block"):
            assert _layer(split, layer.name) == layer
            continue
        attn, mlp = _layer(split, f"{layer.name}_attn"), _layer(split, f"{layer.name}_mlp")
        assert (attn.kind, mlp.kind) == (f"{layer.kind}_attn", f"{layer.kind}_mlp")
        assert attn.params + mlp.params == layer.params and attn.flops + mlp.flops == layer.flops
        assert attn.saved_bytes + mlp.saved_bytes == layer.saved_bytes
        assert attn.out_bytes == mlp.out_bytes == layer.out_bytes
        assert attn.attrs["ref_module"] == mlp.attrs["ref_module"] == layer.attrs["ref_module"]
        assert {**attn.attrs, **mlp.attrs} == layer.attrs
    for a, b in zip(split.skips, whole.skips):
        assert (a.src, a.dst, a.bytes) == (f"{b.src}_mlp", f"{b.dst}_attn", b.bytes)


@pytest.mark.parametrize("name, layers", [("tiny-uvit", 1 + 2 * 7 + 1), ("tiny-dit", 2 + 2 * 8 + 1)])
def test_tiny_layer_counts(specs, name, layers):
    assert specs[name].num_layers == layers


# -- every entry ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-unet", "tiny-uvit", "tiny-dit"])
def test_tiny_variants_are_small(specs, name):
    assert 0 < specs[name].total_params < 1_000_000
    assert len(specs[name].skips) >= 3


def test_tiny_variants_share_the_layer_kinds():
    pairs = [("sd2-unet", "tiny-unet"), ("uvit", "tiny-uvit"), ("hunyuan-dit", "tiny-dit")]
    for big, tiny in pairs:
        assert {l.kind for l in get_spec(big).layers} == {l.kind for l in get_spec(tiny).layers}


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_specs_are_nested_and_plain(specs, name):
    spec = specs[name]
    assert spec.crossing_pairs() == []
    for layer in spec.layers:
        assert "." not in layer.name
        assert layer.params >= 0 and layer.flops > 0 and layer.out_bytes > 0 and layer.saved_bytes > 0
        assert all(isinstance(v, (int, float, str, bool)) for v in layer.attrs.values()), layer.name
    for edge in spec.skips:
        assert edge.bytes == _layer(spec, edge.src).out_bytes


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_yaml_files_match_the_zoo(specs, name, tmp_path):
    spec = specs[name]
    on_disk = load_spec(MODELS_DIR / f"{name}.yaml")
    assert on_disk == spec
    assert [l.attrs for l in on_disk.layers] == [l.attrs for l in spec.layers]
    assert on_disk.meta == spec.meta
    save_spec(spec, tmp_path / "m.yaml")
    assert get_spec(str(tmp_path / "m.yaml")) == spec


def test_unknown_name_lists_the_zoo():
    with pytest.raises(SpecError) as info:
        get_spec("sd3-mmdit")
    assert "sd2-unet" in str(info.value) and "tiny-dit" in str(info.value)


@pytest.mark.parametrize("options", [{"channels": 8}, {"resolution": 500}, {"depth": 8}])
def test_bad_options_are_spec_errors(options):
    name = "uvit" if "depth" in options else "sd2-unet"
    with pytest.raises(SpecError):
        get_spec(name, **options)


def test_options_override_the_config():
    spec = get_spec("tiny-dit", depth=6)
    assert [l.kind for l in spec.layers].count("hdit_block_attn") == 6 and len(spec.skips) == 2


def test_zoo_imports_no_framework():
    code = "import sys, pulse.zoo; sys.exit(any(m in sys.modules for m in ('torch', 'mindspore')))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
