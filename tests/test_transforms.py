"""Function transforms and higher derivatives: forward-mode AD (torch.func.jvp, jacfwd,
torch.autograd.forward_ad), torch.func.grad and vmap(grad) (per-sample gradients), second
derivatives (create_graph=True), and torch.jit.script / torch.export of the modules.

Tangents and gradients are checked against the float64 reference (``reference.py``, plain torch
that torch differentiates itself) with the project's rule in float32, and to 1e-10 in float64.
Before, forward-mode AD gave zero tangents, torch.func.grad failed, and the second derivative
through a float mask's gradient treated the log-sum-exp as a constant."""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacfwd, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_fast as tf
from transformer_fast import reference

from helpers import assert_close_to_reference, max_error


def attention_inputs(dtype, B=2, H=4, Hk=2, Nq=7, Nk=9, D=8, Dv=5):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g, dtype=dtype) for s in ((B, H, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)))
    mask = torch.randn(1, H, Nq, Nk, generator=g, dtype=dtype)
    pad = torch.zeros(B, Nk, dtype=torch.bool)
    pad[1, 5:] = True
    return q, k, v, mask, pad


def ours_attention(q, k, v, mask, pad):
    return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_padding_mask=pad, enable_gqa=True)


def reference_attention(q, k, v, mask, pad):
    return reference.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_padding_mask=pad)


def ours_norm(x, r, w, b):
    return tf.layer_norm(x, (x.shape[-1],), w, b, residual=r)[0]


def reference_norm(x, r, w, b):
    return reference.layer_norm(x, (x.shape[-1],), w, b, residual=r)[0]


def ours_rms(x, r, w, b):
    return tf.rms_norm(x, (x.shape[-1],), w, eps=1e-6, residual=r)[0]


def reference_rms(x, r, w, b):
    return reference.rms_norm(x, (x.shape[-1],), w, eps=1e-6, residual=r)[0]


def norm_inputs(dtype):
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(*s, generator=g, dtype=dtype) for s in ((3, 5, 24), (3, 5, 24), (24,), (24,)))


def ours_linear(q, k, v, causal):
    return tf.linear_attention(q, k, v, is_causal=causal)


def reference_linear(q, k, v, causal):
    return reference.linear_attention(q, k, v, is_causal=causal)


def linear_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(2, 3, 9, 6, generator=g, dtype=dtype) for _ in range(3))


CASES = {
    # name: (ours, reference, inputs(dtype) -> tuple, number of leading differentiable inputs, extra args)
    "attention": (ours_attention, reference_attention, lambda dt: attention_inputs(dt)[:4],
                  lambda: (attention_inputs(torch.float64)[4],)),
    "layer_norm": (ours_norm, reference_norm, norm_inputs, lambda: ()),
    "rms_norm": (ours_rms, reference_rms, lambda dt: norm_inputs(dt)[:3], lambda: (None,)),
    "linear_attention": (ours_linear, reference_linear, linear_inputs, lambda: (False,)),
    "causal_linear_attention": (ours_linear, reference_linear, linear_inputs, lambda: (True,)),
}


def tangents_like(inputs, seed=4):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=g, dtype=x.dtype) for x in inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_jvp_gives_the_references_tangent(case, dtype):
    ours, ref, make, extra = CASES[case]
    inputs, more = make(dtype), extra()
    tangents = tangents_like(inputs)
    _, t_ours = jvp(lambda *a: ours(*a, *more), inputs, tangents)
    _, t64 = jvp(lambda *a: ref(*a, *more), tuple(x.double() for x in inputs), tuple(t.double() for t in tangents))
    assert t_ours.abs().max() > 0
    if dtype == torch.float64:
        assert max_error(t_ours, t64) < 1e-10
    else:
        _, t32 = jvp(lambda *a: ref(*a, *more), inputs, tangents)
        assert_close_to_reference(t_ours, t64, t32, what=f"{case} tangent")


@pytest.mark.parametrize("case", list(CASES))
def test_forward_ad_dual_tensors(case):
    ours, ref, make, extra = CASES[case]
    inputs, more = make(torch.float64), extra()
    tangents = tangents_like(inputs)
    with fwAD.dual_level():
        out = ours(*(fwAD.make_dual(x, t) for x, t in zip(inputs, tangents)), *more)
        tangent = fwAD.unpack_dual(out).tangent
    _, expected = jvp(lambda *a: ref(*a, *more), inputs, tangents)
    assert tangent is not None and max_error(tangent, expected) < 1e-10


def test_jacfwd_equals_jacrev_of_the_reference():
    x, r, w, b = norm_inputs(torch.float64)
    x = x[0, :2]
    jac = jacfwd(lambda x: ours_norm(x, None, w, b))(x)
    torch.testing.assert_close(jac, jacrev(lambda x: reference_norm(x, None, w, b))(x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_func_grad_and_per_sample_gradients(case):
    """torch.func.grad of a loss through the op, and vmap(grad) over a batch (per-sample
    gradients, as Opacus computes them), equal the reference's in float64."""
    ours, ref, make, extra = CASES[case]
    inputs, more = make(torch.float64), extra()
    first = inputs[0]

    def loss(fn, x0, rest):
        return fn(x0, *rest, *more).square().sum()
    g_ours = grad(lambda x0: loss(ours, x0, inputs[1:]))(first)
    g_ref = grad(lambda x0: loss(ref, x0, inputs[1:]))(first)
    assert max_error(g_ours, g_ref) < 1e-10
    batch = torch.stack([first, 0.5 * first + 0.1])
    per_ours = vmap(grad(lambda x0: loss(ours, x0, inputs[1:])))(batch)
    per_ref = vmap(grad(lambda x0: loss(ref, x0, inputs[1:])))(batch)
    assert max_error(per_ours, per_ref) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_second_derivatives(case, dtype):
    """d/d(inputs) of a function of the first derivatives (create_graph=True), for every
    differentiable input: the float mask's included (its first derivative is dS, whose own
    derivative needs the log-sum-exp's)."""
    ours, ref, make, extra = CASES[case]
    more = extra()

    def second(fn, inputs):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*leaves, *more)
        firsts = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
        total = sum((f * torch.linspace(0.5, 1.5, f.numel(), dtype=f.dtype).view(f.shape)).sum() for f in firsts)
        return torch.autograd.grad(total, leaves)
    inputs = make(dtype)
    got = second(ours, inputs)
    expected64 = second(ref, tuple(x.double() for x in inputs))
    if dtype == torch.float64:
        for g, e in zip(got, expected64):
            assert max_error(g, e) < 1e-9
    else:
        expected32 = second(ref, inputs)
        for i, (g, e, e32) in enumerate(zip(got, expected64, expected32)):
            assert_close_to_reference(g, e, e32, what=f"{case} second derivative {i}")


def test_second_derivative_with_dropout_is_refused():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = tf.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_converted_layer_jvp_and_per_sample_gradients():
    """A converted model under forward-mode AD and vmap(grad): the same as torch's layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    ours = tf.convert(copy.deepcopy(layer))
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    t = torch.randn_like(x)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[2, 4:] = True
    math_attention = sdpa_kernel(SDPBackend.MATH)  # torch's fused CPU kernel has no forward AD
    _, t_ours = jvp(lambda x: ours(x, src_key_padding_mask=pad), (x,), (t,))
    with math_attention:
        _, t_torch = jvp(lambda x: layer(x, src_key_padding_mask=pad), (x,), (t,))
    assert max_error(t_ours, t_torch) < 1e-10
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def loss(model, params, x):
        return torch.func.functional_call(model, params, (x[None],)).square().sum()
    per_ours = vmap(grad(lambda p, x: loss(ours, p, x)), in_dims=(None, 0))(params, x)
    with sdpa_kernel(SDPBackend.MATH):
        per_torch = vmap(grad(lambda p, x: loss(layer, p, x)), in_dims=(None, 0))(params, x)
    for name in params:
        assert max_error(per_ours[name], per_torch[name]) < 1e-10, name


def test_jit_script_refuses_clearly_and_export_works():
    layer = tf.convert(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True))
    with pytest.raises(RuntimeError, match="torch.jit.script.*torch.compile or torch.export"):
        torch.jit.script(layer)
    with pytest.raises(RuntimeError, match="torch.jit.script"):
        torch.jit.script(nn.Sequential(tf.LayerNorm(16)))
    x = torch.randn(2, 5, 16)
    exported = torch.export.export(layer, (x,))
    torch.testing.assert_close(exported.module()(x), layer(x), atol=0, rtol=0)


def test_export_with_a_dynamic_length_and_key_padding():
    """Exported at one length, the program serves others: the op's fake kernel is shape-generic."""
    layer = tf.convert(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)).eval()
    length = torch.export.Dim("length", min=2, max=64)
    x, pad = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    exported = torch.export.export(layer, (x,), {"src_key_padding_mask": pad},
                                   dynamic_shapes={"src": {1: length}, "src_key_padding_mask": {1: length}})
    x, pad = torch.randn(2, 23, 16), torch.arange(23)[None, :] >= torch.tensor([[23], [9]])
    with torch.no_grad():
        got = exported.module()(x, src_key_padding_mask=pad)
    torch.testing.assert_close(got, layer(x, src_key_padding_mask=pad), atol=0, rtol=0)
