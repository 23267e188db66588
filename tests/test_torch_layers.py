"""The torch layer modules: parameter counts, shapes, skip wiring, seeding, and numerics.

Numerics are checked against independent functional re-statements of the
reference code (diffusers, baofff/U-ViT, Tencent/HunyuanDiT) sharing the
weights: F.* calls, per-head softmax loops, complex-number RoPE, the
reference's own ``F.multi_head_attention_forward`` pooling, index loops for
unpatchify. diffusers is not installed, so nothing compares to it directly.
"""
import math
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from pulse.errors import SpecError  # noqa: E402
from pulse.zoo import ZOO_NAMES, get_spec  # noqa: E402
from pulse_torch.layers import build_layer, make_inputs, reference_key  # noqa: E402
from pulse_torch.model import build_model, layer_generator  # noqa: E402

TINY = ("tiny-unet", "tiny-uvit", "tiny-dit")
FULL = tuple(n for n in ZOO_NAMES if n not in TINY)
ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops gain nothing from threads, and OpenMP spin-waits badly on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _model(name, seed=0):
    spec = get_spec(name)
    return spec, build_model(spec, seed=seed)


def _layer(spec, name):
    return spec.layers[spec.index(name)]


# -- parameter counts and reference names ---------------------------------------------------------
@pytest.mark.parametrize("name", ZOO_NAMES)
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
def test_forward_backward_is_fast_and_reaches_every_parameter(name):
    spec, model = _model(name)
    x, shared = make_inputs(spec, 2, _gen())
    model(x, shared).square().mean().backward()  # warm-up: kernel selection, allocator
    model.zero_grad()
    start = time.perf_counter()
    model(x, shared).square().mean().backward()
    assert time.perf_counter() - start < 1.0
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


def _grads_by_reference_key(spec, model):
    return {reference_key(spec.layers[spec.index(lname)], key): p.grad
            for lname, m in model.layers.items() for key, p in m.named_parameters()}


# -- numerics against functional references -----------------------------------------------------
def _lin(mod, x):
    return F.linear(x, mod.weight, mod.bias)


def _ln(mod, x, eps):
    return F.layer_norm(x, mod.normalized_shape, mod.weight, mod.bias, eps)


def _naive_attention(q, k, v, heads):
    """softmax(q k^T / sqrt(d)) v, one head at a time, on (B, N, H * D)."""
    d = q.shape[-1] // heads
    outs = []
    for i in range(heads):
        s = slice(i * d, (i + 1) * d)
        w = torch.softmax(q[..., s] @ k[..., s].transpose(-1, -2) / math.sqrt(d), dim=-1)
        outs.append(w @ v[..., s])
    return torch.cat(outs, dim=-1)


def _diffusers_timestep_embedding(t, dim, flip_sin_to_cos, shift, max_period=10000):
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / (half - shift)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1) if flip_sin_to_cos else emb


def _dit_timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _unpatchify_loops(x, p, c):
    b, n, _ = x.shape
    g = int(n ** 0.5)
    out = torch.empty(b, c, g * p, g * p)
    for hi in range(g):
        for wi in range(g):
            for p1 in range(p):
                for p2 in range(p):
                    out[:, :, hi * p + p1, wi * p + p2] = x[:, hi * g + wi, (p1 * p + p2) * c:(p1 * p + p2 + 1) * c]
    return out


def test_unet_time_embed_and_resnets_match_functional_code():
    spec, model = _model("tiny-unet")
    g = _gen(1)
    t = torch.tensor([0, 999])
    te, a = model.layers["time_embed"], _layer(spec, "time_embed").attrs
    h, made = te(torch.ones(2, 4, 16, 16), {"timesteps": t}, [])
    emb = _diffusers_timestep_embedding(t, a["sinusoid_dim"], True, 0)
    assert torch.equal(h, torch.ones(2, 4, 16, 16))
    assert torch.allclose(made["temb"], _lin(te.linear_2, F.silu(_lin(te.linear_1, emb))), atol=ATOL)
    temb = torch.randn(2, 128, generator=g)
    for lname, main_c, size in (("up0_res0", 64, 4), ("mid_res0", 64, 4), ("up1_res1", 32, 16)):
        m, a = model.layers[lname], _layer(spec, lname).attrs
        x = torch.randn(2, main_c, size, size, generator=g)
        skips = [torch.randn(2, a["skip_channels"], size, size, generator=g)] if a["skip_channels"] else []
        xin = torch.cat([x, *skips], dim=1)
        y = F.silu(F.group_norm(xin, a["groups"], m.norm1.weight, m.norm1.bias, a["eps"]))
        y = F.conv2d(y, m.conv1.weight, m.conv1.bias, padding=1) + _lin(m.time_emb_proj, F.silu(temb))[..., None, None]
        y = F.silu(F.group_norm(y, a["groups"], m.norm2.weight, m.norm2.bias, a["eps"]))
        y = F.conv2d(y, m.conv2.weight, m.conv2.bias, padding=1)
        short = F.conv2d(xin, m.conv_shortcut.weight, m.conv_shortcut.bias) if a["conv_shortcut"] else xin
        out, _ = m(x, {"temb": temb}, skips)
        assert torch.allclose(out, short + y, atol=ATOL), lname


def test_unet_transformer2d_matches_functional_code():
    spec, model = _model("tiny-unet")
    m, a = model.layers["down0_attn0"], _layer(spec, "down0_attn0").attrs
    g = _gen(2)
    h, ctx = torch.randn(2, 32, 16, 16, generator=g), torch.randn(2, 8, 32, generator=g)
    heads, eps = a["heads"], a["ln_eps"]
    x = F.group_norm(h, a["groups"], m.norm.weight, m.norm.bias, a["norm_eps"]).flatten(2).transpose(1, 2)
    x = _lin(m.proj_in, x)
    blk = m.transformer_blocks[0]

    def attn(mod, q_in, kv_in):
        q, k, v = (F.linear(t, w.weight) for t, w in ((q_in, mod.to_q), (kv_in, mod.to_k), (kv_in, mod.to_v)))
        return _lin(mod.to_out[0], _naive_attention(q, k, v, heads))
    x = x + attn(blk.attn1, _ln(blk.norm1, x, eps), _ln(blk.norm1, x, eps))
    x = x + attn(blk.attn2, _ln(blk.norm2, x, eps), ctx)
    hidden_gate = _lin(blk.ff.net[0].proj, _ln(blk.norm3, x, eps))
    inner = a["ff_inner"]
    x = x + _lin(blk.ff.net[2], hidden_gate[..., :inner] * F.gelu(hidden_gate[..., inner:]))
    want = _lin(m.proj_out, x).transpose(1, 2).reshape(2, 32, 16, 16) + h
    assert torch.allclose(m(h, {"context": ctx}, [])[0], want, atol=ATOL)


def test_unet_resampling_and_conv_out_match_functional_code():
    spec, model = _model("tiny-unet")
    x = torch.randn(2, 32, 16, 16, generator=_gen(3))
    down, up, out = model.layers["down0_down"], model.layers["up0_up"], model.layers["conv_out"]
    assert torch.allclose(down(x, {}, [])[0], F.conv2d(x, down.conv.weight, down.conv.bias, stride=2, padding=1))
    y = torch.randn(2, 64, 8, 8, generator=_gen(4))
    big = y.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    assert torch.allclose(up(y, {}, [])[0], F.conv2d(big, up.conv.weight, up.conv.bias, padding=1), atol=ATOL)
    norm = F.silu(F.group_norm(x, 8, out.conv_norm_out.weight, out.conv_norm_out.bias, 1e-5))
    assert torch.allclose(out(x, {}, [])[0], F.conv2d(norm, out.conv_out.weight, out.conv_out.bias, padding=1),
                          atol=ATOL)


def test_uvit_layers_match_functional_code():
    spec, model = _model("tiny-uvit")
    g = _gen(5)
    x, shared = make_inputs(spec, 2, g)
    emb = model.layers["embed"]
    patches = F.conv2d(x, emb.patch_embed.proj.weight, emb.patch_embed.proj.bias, stride=2).flatten(2).transpose(1, 2)
    time_tok = _dit_timestep_embedding(shared["timesteps"], 64)[:, None]
    label_tok = emb.label_emb.weight[shared["labels"]][:, None]
    tokens = torch.cat([label_tok, time_tok, patches], dim=1) + emb.pos_embed
    assert torch.allclose(emb(x, shared, [])[0], tokens, atol=ATOL)

    attn, mlp = model.layers["out1_attn"], model.layers["out1_mlp"]
    skip = torch.randn(*tokens.shape, generator=g)
    y = _lin(attn.skip_linear, torch.cat([tokens, skip], dim=-1))
    qkv = _lin(attn.attn.qkv, _ln(attn.norm1, y, 1e-5)).reshape(2, 18, 3, 4, 16).permute(2, 0, 1, 3, 4)
    q, k, v = (t.reshape(2, 18, 64) for t in qkv)  # 'B L (K H D) -> K B H L D', heads kept side by side
    y = y + _lin(attn.attn.proj, _naive_attention(q, k, v, 4))
    half = attn(tokens, shared, [skip])[0]
    assert torch.allclose(half, y, atol=ATOL)
    y = y + _lin(mlp.mlp.fc2, F.gelu(_lin(mlp.mlp.fc1, _ln(mlp.norm2, y, 1e-5))))
    assert torch.allclose(mlp(half, shared, [])[0], y, atol=ATOL)

    fin = model.layers["final"]
    pix = _lin(fin.decoder_pred, _ln(fin.norm, y, 1e-5))[:, 2:]
    img = F.conv2d(_unpatchify_loops(pix, 2, 4), fin.final_layer.weight, fin.final_layer.bias, padding=1)
    assert torch.allclose(fin(y, shared, [])[0], img, atol=ATOL)


def _reference_rope(grid, head_dim):
    """``get_2d_rotary_pos_embed(use_real=False)``: numpy meshgrid, complex (N, head_dim / 2)."""
    pos = np.linspace(0, 32, grid, endpoint=False, dtype=np.float32)  # 512 px base, patch 2
    mesh = np.stack(np.meshgrid(pos, pos), axis=0)  # [2, H, W]; plane 0 varies along the width

    def axis(p, dim):
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        angles = torch.outer(torch.from_numpy(p.reshape(-1)), freqs)
        return torch.polar(torch.ones_like(angles), angles)
    return torch.cat([axis(mesh[0], head_dim // 2), axis(mesh[1], head_dim // 2)], dim=1)


def _complex_rotate(x, freqs_cis):
    """The reference's complex path; x (B, N, H, D), freqs (N, D / 2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None]).flatten(3)


def test_hunyuan_rope_matches_the_reference_complex_form():
    from pulse_torch.layers.dit_parts import apply_rope, rope_2d
    cos, sin = rope_2d(4, 16)
    x = torch.randn(2, 3, 16, 16, generator=_gen(6))  # (B, H, N, D)
    want = _complex_rotate(x.transpose(1, 2), _reference_rope(4, 16)).transpose(1, 2)
    assert torch.allclose(apply_rope(x, cos, sin), want, atol=ATOL)
    # token 1 is one column right of token 0: only the column half rotates
    assert torch.equal(cos[0], torch.ones(16)) and not torch.equal(cos[1, :8], torch.ones(8))
    assert torch.equal(cos[1, 8:], torch.ones(8)) and not torch.equal(cos[4, 8:], torch.ones(8))


def test_hunyuan_cond_embed_matches_functional_code():
    spec, model = _model("tiny-dit")
    x, shared = make_inputs(spec, 2, _gen(7))
    m, a = model.layers["cond_embed"], _layer(spec, "cond_embed").attrs
    h, made = m(x, shared, [])
    assert h is x
    t5 = shared["text_t5"].permute(1, 0, 2)  # the pooler's NLC -> LNC
    t5 = torch.cat([t5.mean(dim=0, keepdim=True), t5], dim=0) + m.pooler.positional_embedding[:, None]
    p = m.pooler
    pooled, _ = F.multi_head_attention_forward(
        query=t5[:1], key=t5, value=t5, embed_dim_to_check=t5.shape[-1], num_heads=a["pooler_heads"],
        q_proj_weight=p.q_proj.weight, k_proj_weight=p.k_proj.weight, v_proj_weight=p.v_proj.weight,
        in_proj_weight=None, in_proj_bias=torch.cat([p.q_proj.bias, p.k_proj.bias, p.v_proj.bias]),
        bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=p.c_proj.weight,
        out_proj_bias=p.c_proj.bias, use_separate_proj_weight=True, training=False, need_weights=False)
    sizes = _dit_timestep_embedding(shared["image_meta_size"].view(-1), a["freq_dim"]).view(2, -1)
    extra = torch.cat([pooled[0], sizes, m.style_embedder.weight[shared["style"]]], dim=1)
    t_emb = m.t_embedder.mlp(_dit_timestep_embedding(shared["timesteps"], a["freq_dim"]))
    assert torch.allclose(made["c"], t_emb + m.extra_embedder(extra), atol=ATOL)
    text = torch.cat([shared["text_clip"], m.mlp_t5(shared["text_t5"])], dim=1)
    mask = torch.cat([shared["text_clip_mask"], shared["text_t5_mask"]], dim=1).bool()
    for b in range(2):
        for i in range(text.shape[1]):
            want = text[b, i] if mask[b, i] else m.text_embedding_padding[i]
            assert torch.allclose(made["context"][b, i], want, atol=ATOL)


def _hdit_block_reference(attn, mlp, a, x, c, ctx, skip):
    """The reference ``HunYuanDiTBlock.forward``: (after the attention part, after the MLP)."""
    heads, hd, eps = a["heads"], a["head_dim"], a["norm_eps"]
    b, n, d = x.shape
    freqs = _reference_rope(a["grid"], hd)
    if skip is not None:
        x = _lin(attn.skip_linear, _ln(attn.skip_norm, torch.cat([x, skip], dim=-1), eps))
    y = _ln(attn.norm1, x, eps) + _lin(attn.default_modulation[1], F.silu(c))[:, None]
    q, k, v = _lin(attn.attn1.Wqkv, y).reshape(b, n, 3, heads, hd).unbind(2)
    q = _complex_rotate(_ln(attn.attn1.q_norm, q, eps), freqs)
    k = _complex_rotate(_ln(attn.attn1.k_norm, k, eps), freqs)
    x = x + _lin(attn.attn1.out_proj, _naive_attention(q.flatten(2), k.flatten(2), v.flatten(2), heads))
    q = _complex_rotate(_ln(attn.attn2.q_norm, _lin(attn.attn2.q_proj, _ln(attn.norm3, x, eps)).view(b, n, heads, hd),
                            eps), freqs)
    k, v = _lin(attn.attn2.kv_proj, ctx).view(b, ctx.shape[1], 2, heads, hd).unbind(2)
    k = _ln(attn.attn2.k_norm, k, eps)
    x = x + _lin(attn.attn2.out_proj, _naive_attention(q.flatten(2), k.flatten(2), v.flatten(2), heads))
    mlp_out = _lin(mlp.mlp.fc2, F.gelu(_lin(mlp.mlp.fc1, _ln(mlp.norm2, x, eps)), approximate="tanh"))
    return x, x + mlp_out


def test_hunyuan_blocks_and_final_match_functional_code():
    spec, model = _model("tiny-dit")
    g = _gen(8)
    x, c, ctx = torch.randn(2, 16, 64, generator=g), torch.randn(2, 64, generator=g), torch.randn(2, 16, 32, generator=g)
    shared = {"c": c, "context": ctx}
    for bname in ("block2", "block6"):
        attn, mlp = model.layers[f"{bname}_attn"], model.layers[f"{bname}_mlp"]
        a = _layer(spec, f"{bname}_attn").attrs
        skip = torch.randn(2, 16, 64, generator=g) if a["skip"] else None
        want_attn, want = _hdit_block_reference(attn, mlp, a, x, c, ctx, skip)
        mid, made = attn(x, shared, [skip] if a["skip"] else [])
        assert made == {} and torch.allclose(mid, want_attn, atol=1e-4), bname
        out, made = mlp(mid, {}, [])  # the FFN half reads no shared input
        assert made == {} and torch.allclose(out, want, atol=1e-4), bname
    fin = model.layers["final"]
    shift, scale = _lin(fin.adaLN_modulation[1], F.silu(c)).chunk(2, dim=1)
    y = F.layer_norm(x, (64,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    want = _unpatchify_loops(_lin(fin.linear, y), 2, 8)
    assert torch.allclose(fin(x, shared, [])[0], want, atol=ATOL)
    patch = model.layers["patch_embed"]
    lat = torch.randn(2, 4, 8, 8, generator=g)
    tokens = F.conv2d(lat, patch.proj.weight, patch.proj.bias, stride=2).flatten(2).transpose(1, 2)
    assert torch.allclose(patch(lat, shared, [])[0], tokens, atol=ATOL)
