"""Float64 inputs get float64-accurate results and gradients on every function (statistics
and recurrent state are not kept in float32), and ``scale`` takes any real scalar, as torch's
SDPA does (a NumPy number or a one-element tensor included)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from helpers import max_error

F64 = torch.float64


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_float64_norm_gradients_are_float64_accurate(is_rms, residual):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 33, generator=g, dtype=F64) * 3 + 1 for _ in range(2))
    w, b = (torch.randn(33, generator=g, dtype=F64) for _ in range(2))
    dy = torch.randn(5, 33, generator=g, dtype=F64)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        res = leaves[1] if residual else None
        y = fn(leaves[0], (33,), leaves[2], eps=1e-5, residual=res) if is_rms else \
            fn(leaves[0], (33,), leaves[2], leaves[3], eps=1e-5, residual=res)
        y = y[0] if residual else y
        used = [l for i, l in enumerate(leaves) if (i != 1 or residual) and (i != 3 or not is_rms)]
        return torch.autograd.grad(y, used, dy)
    ref = reference.rms_norm if is_rms else reference.layer_norm
    for a, e in zip(grads(tf.rms_norm if is_rms else tf.layer_norm), grads(ref)):
        assert max_error(a, e) < 1e-12


def test_float64_linear_attention_step_is_float64_accurate():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 7, 5, generator=g, dtype=F64) for _ in range(3))
    expected = reference.linear_attention(q, k, v, is_causal=True)
    state = None
    for t in range(7):
        out, state = tf.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        assert out.dtype == F64 and state.S.dtype == F64
        assert max_error(out, expected[:, :, t]) < 1e-13


def test_float64_float_mask_gradient_is_float64_accurate():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=F64) for _ in range(3))
    bias = torch.randn(2, 6, 6, generator=g, dtype=F64, requires_grad=True)
    got = torch.autograd.grad(tf.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum(), bias)[0]
    expected = torch.autograd.grad(reference.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum(), bias)[0]
    assert max_error(got, expected) < 1e-12


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), torch.tensor([0.3]), 1])
def test_scale_takes_any_real_scalar(scale):
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, scale=float(scale))
    torch.testing.assert_close(tf.scaled_dot_product_attention(q, k, v, scale=scale), expected,
                               atol=1e-6, rtol=1e-5)


def test_bad_scale_is_refused_clearly():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match="scale must be a real scalar"):
        tf.scaled_dot_product_attention(q, q, q, scale="0.3")
    with pytest.raises(TypeError, match="scale must be a real scalar"):
        tf.scaled_dot_product_attention(q, q, q, scale=torch.ones(2))
    with pytest.raises(ValueError, match="scale must be finite"):
        tf.scaled_dot_product_attention(q, q, q, scale=float("nan"))
