"""The drop-in modules against torch.nn with copied weights: forward and backward, every mask form,
both layouts, train (dropout 0) and eval; state-dict round trips; bad inputs; linear attention
against the reference on the projected heads.

fp32 (the compiled kernels' dtype) but for one bf16 case: torch and transformer_fast each compute these
small problems to ~1e-6, so atol=1e-5, rtol=1e-4 is the kernels' fp32 error, not slack.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_fast as tf
import transformer_fast.nn.multihead_attention as tf_mha
from transformer_fast import reference

from helpers import assert_close_to_reference, max_error

TOL = dict(atol=1e-5, rtol=1e-4)
E, H = 24, 4  # head dim 6: not a power of two


def assert_close(actual, expected, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def mha_pair(*, train=False, **kwargs):
    """A torch MultiheadAttention and ours with the same weights (copied through the state dict)."""
    ref = nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():  # non-zero biases, so that a wrong bias slice shows
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = tf.MultiheadAttention(E, H, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref.train(train), ours.train(train)


def run_both(ref, ours, inputs, kwargs, *, backward=True):
    """Calls both modules on clones of `inputs` (a tensor passed twice stays one object, so
    self-attention stays self-attention) and compares outputs, weights and the gradients of the
    inputs and every parameter."""
    results = []
    for module in (ref, ours):
        clones = {}
        for x in inputs:
            clones.setdefault(id(x), x.detach().clone().requires_grad_(backward))
        out, weights = module(*[clones[id(x)] for x in inputs], **kwargs)
        results.append((out, weights, list(clones.values())))
    (out_r, w_r, in_r), (out_o, w_o, in_o) = results
    assert_close(out_o, out_r, "output")
    if w_r is None:
        assert w_o is None
    else:
        assert_close(w_o, w_r, "attention weights")
    if backward:
        dout = torch.randn_like(out_r)
        gr = torch.autograd.grad(out_r, in_r + list(ref.parameters()), dout, allow_unused=True)
        go = torch.autograd.grad(out_o, in_o + list(ours.parameters()), dout, allow_unused=True)
        names = [f"input {i}" for i in range(len(in_r))] + [n for n, _ in ref.named_parameters()]
        for name, a, b in zip(names, go, gr):
            if b is None:
                assert a is None or not a.any(), name
            else:
                assert a is not None, name
                assert_close(a, b, f"grad of {name}")
    return out_o


def seq(n, b, batch_first, dim=E):
    return torch.randn(b, n, dim) if batch_first else torch.randn(n, b, dim)


# --------------------------------------------------------------------------------------------
# MultiheadAttention
# --------------------------------------------------------------------------------------------
B, L, S = 3, 5, 7


def _masks(kind, L, S, device="cpu"):
    """(attn_mask, key_padding_mask, is_causal) in nn.MultiheadAttention's conventions."""
    g = torch.Generator().manual_seed(1)
    bool_ls = torch.rand(L, S, generator=g) < 0.3
    bool_ls[:, 0] = False  # every row keeps a key: torch's unfused path gives NaN on empty rows
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True
    kpm[2, 2] = True
    if kind == "none":
        return None, None, False
    if kind == "bool_ls":
        return bool_ls, None, False
    if kind == "float_ls":
        return torch.randn(L, S, generator=g), None, False
    if kind == "float_ls_inf":
        return torch.randn(L, S, generator=g).masked_fill(bool_ls, float("-inf")), None, False
    if kind == "bool_bhls":
        m = torch.rand(B * H, L, S, generator=g) < 0.3
        m[..., 1] = False
        return m, None, False
    if kind == "float_bhls":
        return torch.randn(B * H, L, S, generator=g), None, False
    if kind == "kpm_bool":
        return None, kpm, False
    if kind == "kpm_float":
        return None, torch.randn(B, S, generator=g).masked_fill(kpm, float("-inf")), False
    if kind == "kpm_bool_and_bool_ls":
        return bool_ls, kpm, False
    if kind == "kpm_float_and_float_bhls":
        return torch.randn(B * H, L, S, generator=g), torch.randn(B, S, generator=g), False
    if kind == "kpm_bool_and_float_ls":
        return torch.randn(L, S, generator=g), kpm, False
    if kind == "causal":  # torch wants the mask with the hint
        return nn.Transformer.generate_square_subsequent_mask(L), None, True
    if kind == "causal_bool_kpm":
        return torch.ones(L, S, dtype=torch.bool).triu(1), kpm, True
    raise AssertionError(kind)


MASK_KINDS = ["none", "bool_ls", "float_ls", "float_ls_inf", "bool_bhls", "float_bhls", "kpm_bool", "kpm_float",
              "kpm_bool_and_bool_ls", "kpm_float_and_float_bhls", "kpm_bool_and_float_ls", "causal",
              "causal_bool_kpm"]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_mha_self_attention_masks(mask_kind, batch_first):
    n = L if mask_kind.startswith("causal") else S  # causal: a square problem
    ref, ours = mha_pair(batch_first=batch_first, train=True)
    attn_mask, kpm, is_causal = _masks(mask_kind, n, n)
    if kpm is not None:
        kpm = kpm[:, :n]
    x = seq(n, B, batch_first)
    run_both(ref, ours, [x, x, x], dict(attn_mask=attn_mask, key_padding_mask=kpm, is_causal=is_causal,
                                        need_weights=False))


@pytest.mark.parametrize("mask_kind", ["none", "bool_ls", "float_bhls", "kpm_bool", "kpm_float",
                                       "kpm_bool_and_float_ls"])
@pytest.mark.parametrize("shared_kv", [True, False])
def test_mha_cross_attention(mask_kind, shared_kv):
    ref, ours = mha_pair(batch_first=True)
    attn_mask, kpm, is_causal = _masks(mask_kind, L, S)
    q, mem = seq(L, B, True), seq(S, B, True)
    v = mem if shared_kv else seq(S, B, True)
    run_both(ref, ours, [q, mem, v], dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False))


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("train", [False, True])
def test_mha_need_weights_and_modes(need_weights, average, train):
    ref, ours = mha_pair(train=train)
    attn_mask, kpm, _ = _masks("kpm_bool_and_bool_ls", L, S)
    q, kv = seq(L, B, False), seq(S, B, False)
    run_both(ref, ours, [q, kv, kv], dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=need_weights,
                                          average_attn_weights=average))


def test_mha_eval_no_grad_matches_torch_fast_path():
    ref, ours = mha_pair(batch_first=True)
    x = seq(S, B, True)
    kpm = _masks("kpm_bool", S, S)[1]
    with torch.no_grad():
        out_r = ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        out_o = ours(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    valid = ~kpm  # torch's fast path may zero padded positions
    assert_close(out_o[valid], out_r[valid], "eval output")


@pytest.mark.parametrize("kwargs", [
    dict(kdim=10, vdim=7),
    dict(kdim=10, vdim=7, add_bias_kv=True, add_zero_attn=True),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(bias=False),
    dict(bias=False, add_zero_attn=True),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("mask_kind", ["none", "float_ls", "kpm_bool_and_bool_ls", "bool_bhls"])
def test_mha_projection_variants(kwargs, mask_kind):
    ref, ours = mha_pair(**kwargs)
    attn_mask, kpm, _ = _masks(mask_kind, L, S)
    q = seq(L, B, False)
    k = seq(S, B, False, kwargs.get("kdim", E))
    v = seq(S, B, False, kwargs.get("vdim", E))
    if "kdim" not in kwargs:  # same embed dims: also the shared-memory and self-attention paths
        v = k
    run_both(ref, ours, [q, k, v], dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False))
    if "kdim" not in kwargs and mask_kind != "bool_bhls":
        am = attn_mask[:, :L] if attn_mask is not None else None  # (L, L) for self-attention
        run_both(ref, ours, [q, q, q], dict(attn_mask=am, key_padding_mask=None, need_weights=False))


@pytest.mark.parametrize("add_bias_kv", [False, True])
def test_mha_causal_with_extra_keys(add_bias_kv):
    """is_causal with appended keys means the causal mask, padded with allowed columns for the
    extra keys (what torch computes with need_weights=True, and without the hint; torch's
    need_weights=False path drops the mask for the hint and then hides the extra keys too)."""
    ref, ours = mha_pair(add_bias_kv=add_bias_kv, add_zero_attn=not add_bias_kv)
    x = seq(L, B, False)
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    expected = ref(x, x, x, attn_mask=mask, need_weights=False)[0]
    assert_close(ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], expected, "mask + hint")
    assert_close(ours(x, x, x, is_causal=True, need_weights=False)[0], expected, "is_causal alone")
    assert_close(ours(x, x, x, attn_mask=mask, is_causal=True)[0], expected, "need_weights=True")
    run_both(ref, ours, [x, x, x], dict(attn_mask=mask, need_weights=False))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "float_bhls", "kpm_bool", "kpm_float_and_float_bhls"])
def test_mha_unbatched(batch_first, mask_kind):
    ref, ours = mha_pair(batch_first=batch_first)
    attn_mask, kpm, _ = _masks(mask_kind, L, S)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask[:H]  # unbatched: (num_heads, L, S)
    if kpm is not None:
        kpm = kpm[1]
    q, kv = torch.randn(L, E), torch.randn(S, E)
    run_both(ref, ours, [q, kv, kv], dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False))
    x = torch.randn(S, E)
    run_both(ref, ours, [x, x, x], dict(key_padding_mask=kpm, need_weights=False))


def test_mha_keeps_a_float32_mask_with_a_bfloat16_module():
    """torch's MultiheadAttention passes a float32 attn_mask on unchanged to a bf16 attention (SDPA
    adds it in float32); ours too. Mask values near 2000, where bf16's spacing is 16: rounded to
    bf16 they would move every softmax by O(1). Against the same module in float64, within 2x the
    error of torch's own module in bf16."""
    ref, ours = mha_pair(batch_first=True, train=True)
    ref64 = copy.deepcopy(ref).double()
    ref, ours = ref.bfloat16(), ours.bfloat16()
    mask = 2000 + 3 * torch.rand(S, S)
    mask[:, 2] = float("-inf")
    x = torch.randn(B, S, E).bfloat16()
    expected = ref64(x.double(), x.double(), x.double(), attn_mask=mask.double(), need_weights=False)[0]
    torch_bf16 = ref(x, x, x, attn_mask=mask, need_weights=False)[0]
    out = ours(x, x, x, attn_mask=mask, need_weights=False)[0]
    assert_close_to_reference(out, expected, torch_bf16, what="bf16 MultiheadAttention, float32 mask")
    rounded = ours(x, x, x, attn_mask=mask.bfloat16(), need_weights=False)[0]
    assert max_error(rounded, expected) > 10 * max_error(out, expected)


def test_mha_non_contiguous_inputs():
    ref, ours = mha_pair(batch_first=True)
    big = torch.randn(S, B, 2 * E)
    q = big[:, :, ::2].transpose(0, 1)  # (B, S, E), strided everywhere
    kv = torch.randn(B, 2 * S, E)[:, ::2]
    run_both(ref, ours, [q, kv, kv], dict(need_weights=False))
    run_both(ref, ours, [q, q, q], dict(need_weights=False))


def test_mha_fully_masked_rows_give_zero_attention():
    """A query row with every key masked: torch's need_weights=False path gives 0 attention (the
    output is the out_proj bias), as the kernels do, with finite gradients."""
    ref, ours = mha_pair()
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[2] = True
    q, kv = seq(L, B, False), seq(S, B, False)
    out = run_both(ref, ours, [q, kv, kv], dict(attn_mask=mask, need_weights=False))
    assert_close(out[2], ours.out_proj.bias.expand(B, E).detach(), "fully masked row")


def test_mha_self_attention_passes_strided_views_without_copies(monkeypatch):
    """Self-attention: one fused in-projection, whose output Q, K, V views go to the kernel as
    they are; a (B*H, L, S) float mask arrives as a (B, H, L, S) view of the caller's tensor."""
    seen = {}

    def spy(q, k, v, **kwargs):
        seen.update(q=q, k=k, v=v, **kwargs)
        return tf.scaled_dot_product_attention(q, k, v, **kwargs)

    monkeypatch.setattr(tf_mha, "scaled_dot_product_attention", spy)
    ours = tf.MultiheadAttention(E, H, batch_first=True)
    x = seq(S, B, True)
    mask = torch.randn(B * H, S, S)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -1] = True
    calls = []
    linear = F.linear
    monkeypatch.setattr(tf_mha.F, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    ours(x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=False)
    q, k, v = seen["q"], seen["k"], seen["v"]
    assert calls[0] == (3 * E, E), "Q, K and V must come from one matmul"
    assert q.shape == (B, H, S, E // H) and not q.is_contiguous()
    storage = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == storage == v.untyped_storage().data_ptr()
    assert seen["attn_mask"].shape == (B, H, S, S) and seen["attn_mask"].data_ptr() == mask.data_ptr()
    assert seen["key_padding_mask"] is kpm


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------
def _projected_heads(mha, q_in, k_in, v_in):
    """The float64 per-head q, k, v (B, H, N, D) of a batch_first MHA."""
    w = mha.in_proj_weight.double()
    b = mha.in_proj_bias.double()
    heads = lambda t: t.view(t.shape[0], t.shape[1], H, E // H).transpose(1, 2)  # noqa: E731
    return (heads(F.linear(q_in.double(), w[:E], b[:E])), heads(F.linear(k_in.double(), w[E:2 * E], b[E:2 * E])),
            heads(F.linear(v_in.double(), w[2 * E:], b[2 * E:])))


def _linear_expected(mha, q_in, k_in, v_in, **kwargs):
    q, k, v = _projected_heads(mha, q_in, k_in, v_in)
    out = reference.linear_attention(q, k, v, **kwargs)
    out = out.transpose(1, 2).reshape(q_in.shape[0], q_in.shape[1], E)
    return F.linear(out, mha.out_proj.weight.double(), mha.out_proj.bias.double())


@pytest.mark.parametrize("case", ["none", "kpm_bool", "kpm_float", "is_causal", "causal_bool_mask",
                                  "causal_float_mask", "cross"])
def test_linear_attention_mha_matches_reference(case):
    mha = tf.MultiheadAttention(E, H, batch_first=True, attention="linear")
    x = seq(S, B, True)
    q_in = k_in = v_in = x
    kwargs, ref_kwargs = dict(need_weights=True), {}
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -2:] = True
    if case == "kpm_bool":
        kwargs["key_padding_mask"] = ref_kwargs["key_padding_mask"] = kpm
    elif case == "kpm_float":
        kwargs["key_padding_mask"] = torch.zeros(B, S).masked_fill(kpm, float("-inf"))
        ref_kwargs["key_padding_mask"] = kpm
    elif case == "is_causal":
        kwargs["is_causal"] = ref_kwargs["is_causal"] = True
    elif case == "causal_bool_mask":
        kwargs["attn_mask"] = torch.ones(S, S, dtype=torch.bool).triu(1)
        ref_kwargs["is_causal"] = True
    elif case == "causal_float_mask":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(S)
        ref_kwargs["is_causal"] = True
    elif case == "cross":
        q_in = seq(L, B, True)
        k_in = v_in = seq(S + 2, B, True)
    out, weights = mha(q_in, k_in, v_in, **kwargs)
    assert weights is None
    expected = _linear_expected(mha, q_in, k_in, v_in, **ref_kwargs)
    assert_close(out.double(), expected.detach(), f"linear attention ({case})")
    # gradients against the float64 reference
    params = list(mha.parameters())
    dout = torch.randn_like(out)
    g_ours = torch.autograd.grad(out, params, dout, allow_unused=True)
    g_ref = torch.autograd.grad(expected, params, dout.double(), allow_unused=True)
    for (name, _), a, b in zip(mha.named_parameters(), g_ours, g_ref):
        if b is not None:
            assert_close(a.double(), b.double(), f"grad of {name}")


def test_linear_attention_mha_rejects_what_it_cannot_express():
    mha = tf.MultiheadAttention(E, H, attention="linear")
    x = seq(S, B, False)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.rand(S, S) < 0.5)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.randn(B, S))
    with pytest.raises(ValueError, match="causal"):
        mha(seq(L, B, False), x, x, is_causal=True)
    with pytest.raises(ValueError, match="attention"):
        tf.MultiheadAttention(E, H, attention="cosine")


def test_linear_attention_layers_run_and_differ_from_softmax():
    torch.manual_seed(3)
    layer = tf.TransformerEncoderLayer(E, H, 32, dropout=0.0, attention="linear", batch_first=True)
    soft = tf.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    soft.load_state_dict(layer.state_dict())
    x = seq(S, B, True)
    mask = nn.Transformer.generate_square_subsequent_mask(S)
    out = layer(x, src_mask=mask, is_causal=True)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, soft(x, src_mask=mask, is_causal=True))
    model = tf.Transformer(E, H, 1, 1, 32, dropout=0.0, attention="linear")
    assert all(m.attention == "linear" for m in model.modules() if isinstance(m, tf.MultiheadAttention))


# --------------------------------------------------------------------------------------------
# Layers and stacks
# --------------------------------------------------------------------------------------------
def _copy_pair(torch_module, ours):
    ours.load_state_dict(torch_module.state_dict(), strict=True)
    with torch.no_grad():  # non-trivial norm weights and biases
        for (name, p), (_, q) in zip(torch_module.named_parameters(), ours.named_parameters()):
            if "norm" in name:
                p.normal_()
                q.copy_(p)
    return torch_module, ours


def _compare(ref, ours, inputs, kwargs, train):
    ref.train(train)
    ours.train(train)
    args_r = [x.detach().clone().requires_grad_() for x in inputs]
    args_o = [x.detach().clone().requires_grad_() for x in inputs]
    out_r, out_o = ref(*args_r, **kwargs), ours(*args_o, **kwargs)
    assert_close(out_o, out_r, "output")
    dout = torch.randn_like(out_r)
    gr = torch.autograd.grad(out_r, args_r + list(ref.parameters()), dout)
    go = torch.autograd.grad(out_o, args_o + list(ours.parameters()), dout)
    names = [f"input {i}" for i in range(len(inputs))] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, go, gr):
        assert_close(a, b, f"grad of {name}")


LAYER_CONFIGS = [
    dict(norm_first=False, activation="relu", batch_first=False),
    dict(norm_first=True, activation="gelu", batch_first=True),
    dict(norm_first=True, activation=torch.tanh, batch_first=False, bias=False),
    dict(norm_first=False, activation=nn.SiLU(), batch_first=True, layer_norm_eps=1e-3),
]
MASKS = ["none", "causal", "kpm", "float_mask_kpm"]


def _layer_masks(kind, n, b, prefix):
    kpm = torch.zeros(b, n, dtype=torch.bool)
    kpm[0, -2:] = True
    if kind == "none":
        return {}
    if kind == "causal":
        return {f"{prefix}mask": nn.Transformer.generate_square_subsequent_mask(n),
                ("is_causal" if prefix == "src_" else "tgt_is_causal"): True}
    if kind == "kpm":
        return {f"{prefix}key_padding_mask": kpm}
    return {f"{prefix}mask": torch.randn(n, n), f"{prefix}key_padding_mask": kpm}


def _cfg_id(cfg):
    return ",".join(f"{k}={getattr(v, '__name__', type(v).__name__ if not isinstance(v, (str, bool, float)) else v)}"
                    for k, v in cfg.items())


@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("train", [False, True])
def test_encoder_layer(cfg, mask, train):
    ref, ours = _copy_pair(nn.TransformerEncoderLayer(E, H, 40, dropout=0.0, **cfg),
                           tf.TransformerEncoderLayer(E, H, 40, dropout=0.0, **cfg))
    x = seq(S, B, cfg["batch_first"])
    _compare(ref, ours, [x], _layer_masks(mask, S, B, "src_"), train)


@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("mask", MASKS)
def test_decoder_layer(cfg, mask):
    ref, ours = _copy_pair(nn.TransformerDecoderLayer(E, H, 40, dropout=0.0, **cfg),
                           tf.TransformerDecoderLayer(E, H, 40, dropout=0.0, **cfg))
    tgt, mem = seq(L, B, cfg["batch_first"]), seq(S, B, cfg["batch_first"])
    kwargs = _layer_masks(mask, L, B, "tgt_")
    if mask != "none":
        mkpm = torch.zeros(B, S, dtype=torch.bool)
        mkpm[2, :3] = True
        kwargs["memory_key_padding_mask"] = mkpm
        kwargs["memory_mask"] = torch.randn(L, S)
    _compare(ref, ours, [tgt, mem], kwargs, train=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("final_norm", [False, True])
def test_encoder_and_decoder_stacks(norm_first, final_norm):
    """Pre-norm stacks hand (delta, residual) pairs from layer to layer: same result as torch."""
    enc_r = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 40, 0.0, norm_first=norm_first), 3,
                                  nn.LayerNorm(E) if final_norm else None, enable_nested_tensor=False)
    enc_o = tf.TransformerEncoder(tf.TransformerEncoderLayer(E, H, 40, 0.0, norm_first=norm_first), 3,
                                  tf.LayerNorm(E) if final_norm else None)
    _copy_pair(enc_r, enc_o)
    src = seq(S, B, False)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True
    _compare(enc_r, enc_o, [src], dict(src_key_padding_mask=kpm), train=True)
    _compare(enc_r, enc_o, [src], dict(mask=nn.Transformer.generate_square_subsequent_mask(S)), train=False)

    dec_r = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 40, 0.0, norm_first=norm_first), 2,
                                  nn.LayerNorm(E) if final_norm else None)
    dec_o = tf.TransformerDecoder(tf.TransformerDecoderLayer(E, H, 40, 0.0, norm_first=norm_first), 2,
                                  tf.LayerNorm(E) if final_norm else None)
    _copy_pair(dec_r, dec_o)
    tgt, mem = seq(L, B, False), seq(S, B, False)
    _compare(dec_r, dec_o, [tgt, mem], dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(L),
                                            memory_key_padding_mask=kpm), train=True)


def test_stack_of_torch_layers_is_converted():
    enc = tf.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 40, 0.0, norm_first=True), 2, nn.LayerNorm(E))
    assert all(type(layer) is tf.TransformerEncoderLayer for layer in enc.layers)
    assert type(enc.layers[0].self_attn) is tf.MultiheadAttention and type(enc.norm) is tf.LayerNorm


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer(norm_first, batch_first):
    torch.manual_seed(5)
    ref = nn.Transformer(E, H, 2, 2, 40, dropout=0.0, norm_first=norm_first, batch_first=batch_first)
    torch.manual_seed(5)
    ours = tf.Transformer(E, H, 2, 2, 40, dropout=0.0, norm_first=norm_first, batch_first=batch_first)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):  # same init as torch, same seed
        assert torch.equal(p, q), n
    _copy_pair(ref, ours)
    src, tgt = seq(S, B, batch_first), seq(L, B, batch_first)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -2:] = True
    tgt_mask = tf.Transformer.generate_square_subsequent_mask(L)
    assert torch.equal(tgt_mask, nn.Transformer.generate_square_subsequent_mask(L))
    _compare(ref, ours, [src, tgt], dict(tgt_mask=tgt_mask, src_key_padding_mask=kpm,
                                         memory_key_padding_mask=kpm, tgt_is_causal=True), train=True)
    # unbatched
    _compare(ref, ours, [src[:, 0] if not batch_first else src[0], tgt[:, 0] if not batch_first else tgt[0]],
             dict(tgt_mask=tgt_mask), train=False)


# --------------------------------------------------------------------------------------------
# State dicts and construction
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda m: m.MultiheadAttention(E, H, kdim=10, vdim=7, add_bias_kv=True),
    lambda m: m.MultiheadAttention(E, H, bias=False),
    lambda m: m.TransformerEncoderLayer(E, H, 40, norm_first=True, bias=False),
    lambda m: m.TransformerDecoderLayer(E, H, 40),
    lambda m: m.Transformer(E, H, 1, 2, 40),
], ids=["mha_kdim", "mha_nobias", "encoder_layer", "decoder_layer", "transformer"])
def test_state_dict_round_trips(make):
    ref, ours = make(nn), make(tf)
    assert list(ref.state_dict()) == list(ours.state_dict())
    ours.load_state_dict(ref.state_dict(), strict=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    again = make(nn)
    again.load_state_dict(ours.state_dict(), strict=True)
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_modules_are_torch_subclasses():
    assert isinstance(tf.MultiheadAttention(E, H), nn.MultiheadAttention)
    layer = tf.TransformerDecoderLayer(E, H, 40)
    assert isinstance(layer, nn.TransformerDecoderLayer)
    assert type(layer.self_attn) is tf.MultiheadAttention and type(layer.multihead_attn) is tf.MultiheadAttention
    assert all(type(getattr(layer, f"norm{i}")) is tf.LayerNorm for i in (1, 2, 3))
    assert type(layer.self_attn.out_proj) is type(nn.MultiheadAttention(E, H).out_proj)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="embed_dim"):
        tf.MultiheadAttention(10, 3)
    with pytest.raises((AssertionError, ValueError)):  # torch raises too
        nn.MultiheadAttention(10, 3)
    mha = tf.MultiheadAttention(E, H)
    x = seq(S, B, False)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(S, S + 1, dtype=torch.bool), need_weights=False)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(B, S, S), need_weights=False)  # (B, ...) instead of (B*H, ...)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.zeros(S, B, dtype=torch.bool), need_weights=False)
    with pytest.raises(ValueError, match="embed_dim"):
        y = torch.randn(S, B, E + 1)
        mha(y, y, y, need_weights=False)
    with pytest.raises(ValueError, match="batch"):
        mha(x, seq(S, B + 1, False), seq(S, B + 1, False), need_weights=False)
    with pytest.raises(ValueError, match="dimensions"):
        mha(x, x[0], x[0], need_weights=False)
    with pytest.raises(TypeError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(S, S, dtype=torch.int64), need_weights=False)
    with pytest.raises(ValueError, match="attention"):
        tf.TransformerEncoderLayer(E, H, attention="relu")


@pytest.mark.parametrize("norm_first", [False, True])
def test_residual_adds_are_fused_into_the_norms(monkeypatch, norm_first):
    """Every residual add goes into a LayerNorm kernel call (pre-norm: across layers too, the last
    one into the final norm), and a causal hint reaches the kernel as is_causal, without a mask."""
    import sys

    ln_module = sys.modules["transformer_fast.nn.normalization"]  # where the LayerNorm module finds layer_norm
    norm_calls, attention_calls = [], []
    layer_norm = ln_module.layer_norm

    def spy_norm(*args, residual=None, **kwargs):
        norm_calls.append(residual is not None)
        return layer_norm(*args, residual=residual, **kwargs)

    def spy_attention(q, k, v, **kwargs):
        attention_calls.append(kwargs)
        return tf.scaled_dot_product_attention(q, k, v, **kwargs)

    monkeypatch.setattr(ln_module, "layer_norm", spy_norm)
    monkeypatch.setattr(tf_mha, "scaled_dot_product_attention", spy_attention)
    enc = tf.TransformerEncoder(tf.TransformerEncoderLayer(E, H, 40, 0.0, norm_first=norm_first), 3, tf.LayerNorm(E))
    x = seq(S, B, False)
    enc(x, mask=nn.Transformer.generate_square_subsequent_mask(S))
    assert len(norm_calls) == 7
    assert norm_calls == ([False] + [True] * 6 if norm_first else [True] * 6 + [False])
    assert all(c["is_causal"] and c["attn_mask"] is None for c in attention_calls) and len(attention_calls) == 3
