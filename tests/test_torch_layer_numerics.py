"""The torch layer modules against independent functional re-statements of the reference code.

The references (diffusers, baofff/U-ViT, Tencent/HunyuanDiT) are re-stated
sharing the weights: F.* calls, per-head softmax loops, complex-number RoPE,
the reference's own ``F.multi_head_attention_forward`` pooling, index loops
for unpatchify. diffusers is not installed here, so nothing compares to it directly.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from pulse_torch.layers import make_inputs  # noqa: E402
from torch_layer_helpers import ATOL, _gen, _layer, _model, one_thread  # noqa: E402,F401


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
