"""Softmax attention: the public ``scaled_dot_product_attention`` and its custom op.

The kernels (``kernels/attention.py`` for Triton, ``csrc/attention.cpp`` for C++) share one
signature:

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
from typing import Optional

import torch

from . import _composite, _dispatch
from ._validation import (broadcast_attn_mask, check_dim, check_head_dim, check_key_padding_mask,
                          check_same, check_tensor)


# --------------------------------------------------------------------------------------------
# Custom ops: the backend is resolved by the caller and passed in, so the backward runs the
# same backend as the forward.
# --------------------------------------------------------------------------------------------
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                       is_causal: bool, scale: float, dropout_p: float, seed: int,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Nq, _ = q.shape
    if Nq == 0 or k.shape[2] == 0:  # no queries, or no keys: every row is empty -> 0
        out = q.new_zeros(B, H, Nq, v.shape[-1])
        return out, torch.full((B, H, Nq), float("inf"), dtype=torch.float32, device=q.device)
    return _dispatch.kernel("attention_forward", backend)(
        q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed)


_attention_forward_op = torch.library.custom_op(
    "transformer_fast::attention_forward", _attention_forward, mutates_args=())


@_attention_forward_op.register_fake
def _(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, attn_mask: Optional[torch.Tensor],
                        key_padding_mask: Optional[torch.Tensor], is_causal: bool, scale: float,
                        dropout_p: float, seed: int, backend: str, compute_dmask: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask); dmask is the score gradient dS (B, H, Nq, Nk) when compute_dmask,
    else an empty tensor (custom ops cannot return None)."""
    B, H, Nq, _ = q.shape
    if Nq == 0 or k.shape[2] == 0:
        dmask = q.new_zeros(B, H, Nq, k.shape[2]) if compute_dmask else q.new_empty(0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    dq, dk, dv, dmask = _dispatch.kernel("attention_backward", backend)(
        dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, compute_dmask)
    return dq, dk, dv, q.new_empty(0) if dmask is None else dmask


_attention_backward_op = torch.library.custom_op(
    "transformer_fast::attention_backward", _attention_backward, mutates_args=())


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend,
      compute_dmask=False):
    # The kernels return contiguous gradients (whatever the inputs' strides).
    B, H, Nq, _ = q.shape
    dmask = q.new_empty(B, H, Nq, k.shape[2]) if compute_dmask else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask)
    ctx.args = (is_causal, scale, dropout_p, seed, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, key_padding_mask = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a second derivative will be taken
        return _differentiable_backward(ctx, dout, q, k, v, attn_mask, key_padding_mask)
    # A float attn_mask that requires grad (e.g. a learned position bias): its gradient is the
    # score gradient dS, which the backward kernels form anyway (with the forward's dropout).
    # Autograd sums it over the mask's broadcast dims.
    compute_dmask = bool(ctx.needs_input_grad[3])
    dq, dk, dv, dmask = _dispatch.run_op(_attention_backward_op, _attention_backward, dout, q, k, v, out, lse,
                                         attn_mask, key_padding_mask, *ctx.args, compute_dmask)
    # No gradient for key_padding_mask, the flags or the seed.
    return dq, dk, dv, dmask if compute_dmask else None, None, None, None, None, None, None


def _differentiable_backward(ctx, dout, q, k, v, attn_mask, key_padding_mask):
    """The gradients as a graph torch can differentiate again, from the composite form; the
    kernels' dropout pattern cannot be reproduced there, so dropout is refused."""
    is_causal, scale, dropout_p, seed, backend = ctx.args
    if dropout_p > 0:
        raise NotImplementedError("transformer_fast.scaled_dot_product_attention: second derivatives "
                                  "(create_graph=True) are not supported with dropout_p > 0")
    args = (q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend)
    grads = _composite.backward(_composite.attention_forward, args, (0, 1, 2, 3), (dout, None))
    return (*grads[:4], None, None, None, None, None, None)


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
_attention_forward_eager = _dispatch.eager_autograd(_attention_forward, _setup_context, _backward)
_dispatch.register_autocast(_attention_forward_op, "attention_forward", "lower", cast_args=(0, 1, 2, 3))
_dispatch.register_autocast(_attention_backward_op, "attention_backward", "lower")


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
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=(3, 4))
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key and value must have the same number of dimensions, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.dim() == 3:  # (H, N, D): one unbatched sequence
        if key_padding_mask is not None and key_padding_mask.dim() == 1:
            key_padding_mask = key_padding_mask[None]
        return scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask, backend=backend)[0]
    query, key, value, attn_mask = _dispatch.autocast_inputs("lower", query, key, value, attn_mask)
    check_same("key", key, "query", query)
    check_same("value", value, "query", query)
    B, H, Nq, D = query.shape
    Hk, Nk = key.shape[1], key.shape[2]
    check_dim("key", key, 0, B, "batch")
    check_dim("value", value, 0, B, "batch")
    check_dim("value", value, 1, Hk, "heads, as key")
    check_dim("value", value, 2, Nk, "key length, as key")
    check_dim("key", key, 3, D, "head dim, as query")
    if Hk != H and not (enable_gqa and Hk > 0 and H % Hk == 0):
        raise ValueError(f"key has {Hk} heads and query {H}: they must be equal, or pass enable_gqa=True "
                         f"with key heads dividing query heads")
    check_head_dim("query", D)
    check_head_dim("value", value.shape[3])
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = _check_scale(scale)
    attn_mask = broadcast_attn_mask(attn_mask, (B, H, Nq, Nk), query)
    key_padding_mask = check_key_padding_mask(key_padding_mask, B, Nk, query)

    # The kernels need a unit stride along the head dim; any other stride is passed through as is.
    query, key, value = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                         for t in (query, key, value))
    backend = _dispatch.select_backend(query.device, query.dtype, backend, "attention")
    scale = float(D ** -0.5 if scale is None else scale)
    out, _ = _dispatch.run_op(_attention_forward_op, _attention_forward, query, key, value, attn_mask,
                              key_padding_mask, bool(is_causal), scale, float(dropout_p),
                              _dropout_seed(dropout_p), backend, autograd=_attention_forward_eager,
                              composite=_composite.attention_forward)
    return out
