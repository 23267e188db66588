"""The torch layer modules: parameter counts, shapes, skip wiring and seeding.

Numerics against functional references: tests/test_torch_layer_numerics.py.
"""

import pytest

torch = pytest.importorskip("torch")

from pulse.errors import SpecError  # noqa: E402
from pulse.zoo import ZOO_NAMES, get_spec  # noqa: E402
from pulse_torch.layers import build_layer, make_inputs, reference_key  # noqa: E402
from pulse_torch.model import build_model, layer_generator  # noqa: E402
from torch_layer_helpers import _gen, _layer, _model, one_thread  # noqa: E402,F401

TINY = ("tiny-unet", "tiny-uvit", "tiny-dit")
# sdxl-unet's time_embed reads SDXL's added inputs: built over diffusers' model only (tests/test_sdxl.py).
NATIVE = tuple(n for n in ZOO_NAMES if n != "sdxl-unet")
FULL = tuple(n for n in NATIVE if n not in TINY)


# -- parameter counts and reference names ---------------------------------------------------------
@pytest.mark.parametrize("name", NATIVE)
def test_every_layer_has_its_spec_parameter_count(name):
    spec = get_spec(name)
    model = build_model(spec, device="meta" if name in FULL else None)
    assert model.layer_params() == {layer.name: layer.params for layer in spec.layers}
    assert sum(p.numel() for p in model.parameters()) == spec.total_params
    if name in FULL:
        assert all(p.is_meta for p in model.parameters())


def _reference_state(name, **options):
    spec = get_spec(name, **options)
    model = build_model(spec, device="meta")
    keys = [(reference_key(spec.layers[spec.index(lname)], key), p.shape)
            for lname, module in model.layers.items() for key, p in module.state_dict().items()]
    state = dict(keys)
    assert len(state) == len(keys)  # no two layers claim one checkpoint tensor (split block halves)
    return state


def test_sd2_parameter_names_are_diffusers_names():
    state = _reference_state("sd2-unet")
    assert len(state) == 686  # UNet2DConditionModel(SD2).state_dict() has 686 tensors
    assert state["conv_in.weight"] == (320, 4, 3, 3)
    assert state["time_embedding.linear_1.weight"] == (1280, 320)
    assert state["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"] == (320, 1024)
    assert state["down_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj.weight"] == (5120, 640)
    assert state["mid_block.attentions.0.proj_in.weight"] == (1280, 1280)
    assert state["up_blocks.3.resnets.2.conv_shortcut.weight"] == (320, 640, 1, 1)
    assert state["up_blocks.2.upsamplers.0.conv.weight"] == (640, 640, 3, 3)
    assert state["conv_norm_out.weight"] == (320,) and state["conv_out.weight"] == (4, 320, 3, 3)


def test_uvit_and_hunyuan_parameter_names_are_the_references():
    uvit = _reference_state("uvit")
    assert uvit["pos_embed"] == (1, 258, 1152) and uvit["label_emb.weight"] == (1001, 1152)
    assert uvit["patch_embed.proj.weight"] == (1152, 4, 2, 2)
    assert uvit["in_blocks.0.attn.qkv.weight"] == (3456, 1152) and "in_blocks.0.attn.qkv.bias" not in uvit
    assert uvit["out_blocks.13.skip_linear.weight"] == (1152, 2304) and "mid_block.skip_linear.weight" not in uvit
    assert uvit["decoder_pred.weight"] == (16, 1152) and "final_layer.weight" not in uvit
    hdit = _reference_state("hunyuan-dit")
    assert hdit["text_embedding_padding"] == (333, 1024)
    assert hdit["pooler.positional_embedding"] == (257, 2048)
    assert hdit["extra_embedder.0.weight"] == (5632, 1024 + 6 * 256 + 1408)
    assert hdit["x_embedder.proj.weight"] == (1408, 4, 2, 2)
    assert hdit["blocks.0.attn1.Wqkv.weight"] == (4224, 1408) and hdit["blocks.0.attn1.q_norm.weight"] == (88,)
    assert hdit["blocks.39.skip_norm.weight"] == (2816,) and "blocks.20.skip_linear.weight" not in hdit
    assert hdit["blocks.21.skip_linear.weight"] == (1408, 2816)
    assert hdit["final_layer.adaLN_modulation.1.weight"] == (2816, 1408)
    assert not any("rope" in k for k in hdit)  # RoPE tables are not checkpoint state


@pytest.mark.parametrize("name", ["uvit", "hunyuan-dit"])
def test_split_blocks_map_the_same_checkpoint(name):
    """A block's _attn and _mlp layers together own exactly the whole block's reference tensors."""
    assert _reference_state(name) == _reference_state(name, split_blocks=False)


@pytest.mark.parametrize("name", ["sd2-unet", "tiny-unet"])
@pytest.mark.parametrize("option", ["split_resnets", "split_transformers"])
def test_split_unet_layers_map_the_same_checkpoint(name, option):
    """A ResnetBlock2D's _in and _out layers (a Transformer2DModel's _self<k> and _cross<k> parts) together
    own exactly the whole block's reference tensors."""
    assert _reference_state(name) == _reference_state(name, **{option: True})


# -- shapes, sizes, forward and backward ---------------------------------------------------------
def _trace(model, spec, x, shared):
    """Each layer's (main-path output, made shared inputs), recorded by hooks."""
    outs = {}
    hooks = [m.register_forward_hook(lambda m, a, out, n=n: outs.__setitem__(n, out))
             for n, m in model.layers.items()]
    y = model(x, shared)
    for h in hooks:
        h.remove()
    return y, outs


@pytest.mark.parametrize("name", TINY)
def test_outputs_have_the_spec_sizes(name):
    spec, model = _model(name)
    x, shared = make_inputs(spec, 2, _gen())
    y, outs = _trace(model, spec, x, shared)
    assert y.shape[0] == 2 and y.shape[2:] == x.shape[2:]
    made_bytes = {s.name: s.bytes for s in spec.shared_inputs if s.producer}
    for layer in spec.layers:
        h, made = outs[layer.name]
        assert h.shape[0] == 2 and h[0].numel() * spec.act_bytes == layer.out_bytes, layer.name
        for key, t in made.items():
            assert t[0].numel() * spec.act_bytes == made_bytes[key], (layer.name, key)
    assert set().union(*(made for _, made in outs.values())) == set(made_bytes)


@pytest.mark.parametrize("name", TINY)
def test_forward_backward_reaches_every_parameter(name):
    spec, model = _model(name)
    x, shared = make_inputs(spec, 2, _gen())
    model(x, shared).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_forward_reference_takes_the_runtime_batch_dict():
    spec, model = _model("tiny-uvit")
    x, shared = make_inputs(spec, 2, _gen())
    assert torch.equal(model.forward_reference({"h": x, **shared}), model(x, shared))


def test_make_inputs_shapes_ranges_and_determinism():
    spec = get_spec("tiny-dit")
    x, shared = make_inputs(spec, 3, _gen(5))
    assert x.shape == (3, 4, 8, 8)
    assert set(shared) == {s.name for s in spec.shared_inputs if s.producer is None}
    assert shared["timesteps"].dtype == torch.long and 0 <= shared["timesteps"].min() <= shared["timesteps"].max() < 1000
    assert shared["text_t5"].shape == (3, 8, 64) and shared["text_clip"].shape == (3, 8, 32)
    mask = shared["text_t5_mask"]
    assert mask[:, 0].all() and (mask[:, 1:] <= mask[:, :-1]).all()  # a valid prefix, then padding
    assert shared["image_meta_size"].tolist()[0] == [64.0, 64.0, 64.0, 64.0, 0.0, 0.0]
    x2, shared2 = make_inputs(spec, 3, _gen(5))
    assert torch.equal(x, x2) and all(torch.equal(shared[k], shared2[k]) for k in shared)
    _, uvit = make_inputs(get_spec("tiny-uvit"), 64, _gen())
    assert 0 <= uvit["labels"].min() and uvit["labels"].max() < 11
    _, unet = make_inputs(get_spec("tiny-unet"), 2, _gen())
    assert unet["context"].shape == (2, 8, 32)


# -- seeding -----------------------------------------------------------------------------------------
def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_seeded_builds_are_identical_and_leave_the_global_rng_alone():
    spec = get_spec("tiny-dit")
    state = torch.get_rng_state()
    a, b, c = build_model(spec, seed=7), build_model(spec, seed=7), build_model(spec, seed=8)
    assert torch.equal(state, torch.get_rng_state())
    assert _same_weights(a, b) and not _same_weights(a, c)
    torch.manual_seed(3)
    d = build_model(spec)
    torch.manual_seed(3)
    assert _same_weights(d, build_model(spec))


def test_a_layer_built_alone_gets_the_model_s_weights():
    """What a pipeline stage does: build only its layers, seeded by name."""
    spec, model = _model("tiny-unet", seed=11)
    for lname in ("down0_attn0", "up1_res1", "conv_out"):
        alone = build_layer(_layer(spec, lname), generator=layer_generator(11, lname))
        assert _same_weights(alone, model.layers[lname])


def test_dtype_and_errors():
    spec = get_spec("tiny-unet")
    assert build_layer(_layer(spec, "conv_in"), dtype=torch.float64).weight.dtype == torch.float64
    resnet = build_layer(_layer(spec, "up0_res0"))
    with pytest.raises(SpecError, match="expects 1 skip"):
        resnet(torch.zeros(1, 64, 4, 4), {}, [])
    with pytest.raises(SpecError, match="'temb'"):
        resnet(torch.zeros(1, 64, 4, 4), {}, [torch.zeros(1, 64, 4, 4)])
    from dataclasses import replace
    with pytest.raises(SpecError, match="no module for kind"):
        build_layer(replace(spec.layers[0], kind="mystery"))


# -- skip wiring: the walker against the references' own stack loops -------------------------------
def _run(model, name, h, shared, skips=()):
    out, made = model.layers[name](h, shared, list(skips))
    shared.update(made)
    return out


def _stack_walk(spec, model, x, shared, push, pop):
    """Walk the layers with the reference's push / pop rule instead of the spec's edges."""
    shared, stack, h = dict(shared), [], x
    for i, layer in enumerate(spec.layers):
        h = _run(model, layer.name, h, shared, [stack.pop()] if pop(i, layer.name) else [])
        if push(i, layer.name):
            stack.append(h)
    assert not stack
    return h


def _unet_push(spec):
    """diffusers: conv_in, then every down-block (resnet[, attention]) pair's output and downsampler."""
    names = [l.name for l in spec.layers]

    def push(i, name):
        following = names[i + 1] if i + 1 < len(names) else ""
        pair_ends = name.startswith("down") and not following.startswith(name.split("_")[0] + "_attn")
        return name == "conv_in" or pair_ends
    return push


def _reference_rules(spec):
    """The reference forward's push / pop rule per layer name (split or whole blocks).

    U-ViT: every in-block's output is pushed, every out-block pops. HunyuanDiT:
    blocks < depth/2 - 1 push, blocks > depth/2 pop. A block pushes its output
    (its last layer, ``_mlp`` when split) and pops where it fuses the skip (its
    first layer, ``_attn`` when split).
    """
    names = [l.name for l in spec.layers]
    block = {n: n.rsplit("_", 1)[0] if n.endswith(("_attn", "_mlp")) else n for n in names}
    first = {n: not n.endswith("_mlp") for n in names}
    last = {n: not n.endswith("_attn") for n in names}
    if spec.meta["family"] == "uvit":
        push = lambda i, n: block[n].startswith("in") and last[n]  # noqa: E731
        pop = lambda i, n: block[n].startswith("out") and first[n]  # noqa: E731
    else:
        index = {n: int(block[n][5:]) for n in names if block[n].startswith("block")}
        half = len(set(index.values())) // 2
        push = lambda i, n: index.get(n, half) < half - 1 and last[n]  # noqa: E731
        pop = lambda i, n: index.get(n, 0) > half and first[n]  # noqa: E731
    return push, pop


@pytest.mark.parametrize("name", TINY)
def test_spec_skips_reproduce_the_reference_stack(name):
    spec, model = _model(name)
    x, shared = make_inputs(spec, 2, _gen())
    if name == "tiny-unet":
        push, pop = _unet_push(spec), lambda i, n: n.startswith("up") and "_res" in n
    else:
        push, pop = _reference_rules(spec)
    assert torch.equal(_stack_walk(spec, model, x, shared, push, pop), model(x, shared))


def _load_by_reference_key(dst_spec, dst, src_spec, src):
    """Copy ``src``'s weights into ``dst`` through the reference checkpoint names."""
    ckpt = {reference_key(src_spec.layers[src_spec.index(lname)], key): t
            for lname, m in src.layers.items() for key, t in m.state_dict().items()}
    used = set()
    for lname, m in dst.layers.items():
        layer = dst_spec.layers[dst_spec.index(lname)]
        state = {key: ckpt[reference_key(layer, key)] for key in m.state_dict()}
        used |= {reference_key(layer, key) for key in state}
        m.load_state_dict(state)
    assert used == set(ckpt)


@pytest.mark.parametrize("name", ["tiny-uvit", "tiny-dit"])
def test_split_blocks_equal_the_whole_blocks(name):
    """Two layers per block compute exactly what one layer per block did, forward and backward.

    The whole-block model (``split_blocks=False``) runs the reference's own
    push / pop loop over blocks; the split model, loaded from its checkpoint,
    runs the spec's skip edges. (Also checked once against the pre-split
    block modules of commit e538bd3: bit-identical outputs and gradients.)
    """
    whole_spec, split_spec = get_spec(name, split_blocks=False), get_spec(name)
    whole = build_model(whole_spec, seed=3)
    assert whole.layer_params() == {l.name: l.params for l in whole_spec.layers}
    split = build_model(split_spec, seed=4)
    _load_by_reference_key(split_spec, split, whole_spec, whole)
    x, shared = make_inputs(split_spec, 2, _gen(9))
    want = _stack_walk(whole_spec, whole, x, shared, *_reference_rules(whole_spec))
    got = split(x, shared)
    assert torch.equal(got, want)
    want.square().mean().backward()
    got.square().mean().backward()
    g_whole, g_split = _grads_by_reference_key(whole_spec, whole), _grads_by_reference_key(split_spec, split)
    assert g_whole.keys() == g_split.keys()
    assert all(torch.equal(g_whole[k], g_split[k]) for k in g_whole)


@pytest.mark.parametrize("options", [{"split_resnets": True}, {"split_transformers": True},
                                     {"split_transformers": True, "transformer_layers": (2, 1)},
                                     # only the blocks a plan's cuts fall inside (pulse.partition.fitted_splits)
                                     {"split_resnets": ("down1_res0", "up1_res1"), "split_transformers": ("mid_attn",)}])
def test_split_unet_layers_equal_the_whole_blocks(options):
    """Two layers per ResnetBlock2D (``split_resnets``), two per transformer block (``split_transformers``,
    also at two blocks a model) compute what one layer per block does, forward and backward, with the
    same weights (float64: the parts run the same operations in the same order)."""
    depth = {k: v for k, v in options.items() if k == "transformer_layers"}
    whole_spec, split_spec = get_spec("tiny-unet", **depth), get_spec("tiny-unet", **options)
    assert split_spec.num_layers > whole_spec.num_layers
    whole, split = build_model(whole_spec, seed=3).double(), build_model(split_spec, seed=4).double()
    _load_by_reference_key(split_spec, split, whole_spec, whole)
    x, shared = make_inputs(split_spec, 2, _gen(9))
    x, shared = x.double(), {k: v.double() if v.is_floating_point() else v for k, v in shared.items()}
    want, got = whole(x, shared), split(x, shared)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(want.detach().abs().max()))
    want.square().mean().backward()
    got.square().mean().backward()
    g_whole, g_split = _grads_by_reference_key(whole_spec, whole), _grads_by_reference_key(split_spec, split)
    assert g_whole.keys() == g_split.keys()
    assert all(torch.allclose(g_whole[k], g_split[k], rtol=1e-10, atol=1e-14) for k in g_whole)
    # another grid than the spec's (an aspect bucket: 8 x 32 latents for a 16 x 16 spec): each part reads
    # the grid from its input
    wide = torch.randn(2, x.shape[1], 8, 32, generator=_gen(5), dtype=torch.float64)
    with torch.no_grad():
        want, got = whole(wide, shared), split(wide, shared)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))


def _grads_by_reference_key(spec, model):
    return {reference_key(spec.layers[spec.index(lname)], key): p.grad
            for lname, m in model.layers.items() for key, p in m.named_parameters()}
