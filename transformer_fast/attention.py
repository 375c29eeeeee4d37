"""Softmax attention: the public ``scaled_dot_product_attention`` and the fake kernels of its ops.

The kernels (``kernels/attention.py`` for Triton; ``csrc/attention_forward.cpp`` and
``attention_backward.cpp`` for C++) share one signature:

    attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed)
        -> (out, lse)
    attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                       dropout_p, seed, compute_dmask) -> (dq, dk, dv, dmask)

q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv) with any strides but a unit last-dim
stride, Hk dividing H; attn_mask None or a (B, H, Nq, Nk) view (stride 0 on broadcast dims),
bool (True = allowed) or float (added); key_padding_mask None or (B, Nk) bool (True = padded).
out is (B, H, Nq, Dv) contiguous in q's dtype; lse (B, H, Nq) float32 is each row's log-sum-exp
of the scaled, masked scores, +inf for rows with no allowed key (so exp(s - lse) is 0 there).
dmask is None unless compute_dmask; then it is dS (B, H, Nq, Nk) contiguous in q's dtype, the
gradient of the scaled, masked scores (so of an additive float mask), with the forward's dropout:
0 for disallowed pairs, padded keys and rows with no allowed key.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import _backends, _build, _explicit
from ._backends import KERNEL_DTYPES
from ._calls import TENSOR_OR_NONE, TENSORS, check_tensors, direct

_C, _ = _build.load()


# --------------------------------------------------------------------------------------------
# Fake implementations (shapes only: torch.compile, FakeTensorMode, the meta device)
# --------------------------------------------------------------------------------------------
@torch.library.register_fake("transformer_fast::attention_forward")
def _(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


@torch.library.register_fake("transformer_fast::attention_backward")
def _(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, compute_dmask):
    # The kernels return contiguous gradients (whatever the inputs' strides).
    B, H, Nq, _ = q.shape
    dmask = q.new_empty(B, H, Nq, k.shape[2]) if compute_dmask else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _dropout_seed(dropout_p):
    """A seed for in-kernel dropout, drawn from torch's default generator (so torch.manual_seed
    makes runs repeatable); 0 when there is no dropout."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _check_scale(scale):
    """Any real scalar (a Python or NumPy number, a one-element tensor), as torch takes it."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.is_complex():
            raise TypeError(f"scale must be a real scalar or None, got a tensor of shape {tuple(scale.shape)} "
                            f"and dtype {scale.dtype}")
        scale = scale.item()
    elif not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real scalar or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, key_padding_mask=None, backend="auto"):
    """Fused softmax attention, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(query @ key^T * scale + bias) @ value`` for (B, H, N, D) tensors (or (H, N, D),
    treated as B = 1), where bias combines:
      * ``is_causal``: query i attends to keys j <= i (top-left aligned, as in PyTorch);
      * ``attn_mask``: bool (True = may attend) or float (added to the scores), any shape that
        broadcasts to (B, H, Nq, Nk); read in place, never expanded in memory;
      * ``key_padding_mask``: (B, Nk) bool, True = padded key (``nn.MultiheadAttention``'s
        convention), read per tile.
    Query rows with no allowed key give 0 (and 0 gradient). Under ``torch.autocast`` the floating
    inputs are cast to the autocast dtype first, as torch's SDPA is. ``enable_gqa=True`` lets key/value
    have fewer heads than query (a divisor). ``backend``: "auto", "triton", "cpp" or "reference".
    A float ``attn_mask`` that requires grad gets its gradient (as in PyTorch, dropout included):
    the backward kernels write the score gradient, (B, H, Nq, Nk) in the mask's dtype, which
    autograd sums over the mask's broadcast dims.
    """
    if scale is not None and type(scale) is not float:
        scale = _check_scale(scale)
    seed = _dropout_seed(dropout_p) if dropout_p else 0
    if (backend == "auto" and type(query) in TENSORS and type(key) in TENSORS and type(value) in TENSORS
            and type(attn_mask) in TENSOR_OR_NONE and type(key_padding_mask) in TENSOR_OR_NONE
            and query.dtype in KERNEL_DTYPES and direct()):
        return _C.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, bool(is_causal), scale,
                                               bool(enable_gqa), key_padding_mask, seed)
    check_tensors(query=query, key=key, value=value)
    transformed = _explicit.differentiable_forms_needed()
    explicit = None if transformed else _backends.explicit_backend(backend, query.device, query.dtype, "attention")
    if explicit is None and not transformed:
        return torch.ops.transformer_fast.scaled_dot_product_attention(
            query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale=scale, enable_gqa=bool(enable_gqa),
            key_padding_mask=key_padding_mask, seed=seed)
    q, k, v, attn_mask, key_padding_mask, scale, unbatched = _C.attention_args(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), key_padding_mask)
    out = _explicit.attention(explicit, q, k, v, attn_mask, key_padding_mask, bool(is_causal), scale,
                              float(dropout_p), seed)
    return out[0] if unbatched else out
