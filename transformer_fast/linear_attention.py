"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") with the feature map
phi(x) = elu(x) + 1: the public functions, the custom op, and the recurrent step for decoding.

The kernels (``kernels/linear_attention.py``, ``csrc/linear_attention.cpp``) share one signature:

    linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps) -> out
    linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps) -> (dq, dk, dv)

q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv), any strides with a unit last-dim stride
(Nq == Nk when causal); key_padding_mask None or (B, Nk) bool (True = padded, left out of the
sums). out is (B, H, Nq, Dv) contiguous in q's dtype; the state S, z is kept in float32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _composite, _dispatch
from ._validation import check_dim, check_head_dim, check_key_padding_mask, check_same, check_tensor


def _linear_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              key_padding_mask: Optional[torch.Tensor], is_causal: bool, eps: float,
                              backend: str) -> torch.Tensor:
    B, H, Nq, _ = q.shape
    if Nq == 0 or k.shape[2] == 0:  # empty sums: out = 0 / eps = 0
        return q.new_zeros(B, H, Nq, v.shape[-1])
    return _dispatch.kernel("linear_attention_forward", backend)(q, k, v, key_padding_mask, is_causal, eps)


_linear_attention_forward_op = torch.library.custom_op(
    "transformer_fast::linear_attention_forward", _linear_attention_forward, mutates_args=())


@_linear_attention_forward_op.register_fake
def _(q, k, v, key_padding_mask, is_causal, eps, backend):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1])


def _linear_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               key_padding_mask: Optional[torch.Tensor], is_causal: bool, eps: float,
                               backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _dispatch.kernel("linear_attention_backward", backend)(dout, q, k, v, key_padding_mask, is_causal, eps)


_linear_attention_backward_op = torch.library.custom_op(
    "transformer_fast::linear_attention_backward", _linear_attention_backward, mutates_args=())


@_linear_attention_backward_op.register_fake
def _(dout, q, k, v, key_padding_mask, is_causal, eps, backend):
    # The kernels return contiguous gradients (whatever the inputs' strides).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, is_causal, eps, backend = inputs
    ctx.save_for_backward(q, k, v, key_padding_mask)  # the backward recomputes the state
    ctx.args = (is_causal, eps, backend)


def _backward(ctx, dout):
    q, k, v, key_padding_mask = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a second derivative will be taken
        args = (q, k, v, key_padding_mask, *ctx.args)
        dq, dk, dv = _composite.backward(_composite.linear_attention_forward, args, (0, 1, 2), (dout,))[:3]
        return dq, dk, dv, None, None, None, None
    dq, dk, dv = _dispatch.run_op(_linear_attention_backward_op, _linear_attention_backward, dout, q, k, v,
                                  key_padding_mask, *ctx.args)
    return dq, dk, dv, None, None, None, None


_linear_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
_linear_attention_forward_eager = _dispatch.eager_autograd(_linear_attention_forward, _setup_context, _backward)
_dispatch.register_autocast(_linear_attention_forward_op, "linear_attention_forward", "lower", cast_args=(0, 1, 2))
_dispatch.register_autocast(_linear_attention_backward_op, "linear_attention_backward", "lower")


def linear_attention(query, key, value, *, is_causal=False, key_padding_mask=None, eps=1e-6, backend="auto"):
    """Linear attention with phi(x) = elu(x) + 1, computed in O(N) time and memory:

        out_i = phi(q_i) S / (phi(q_i) . z + eps),  S = sum_j phi(k_j)^T v_j,  z = sum_j phi(k_j)

    with the sums over unpadded keys (``key_padding_mask`` (B, Nk) bool, True = padded), and over
    j <= i when ``is_causal`` (which needs equal query and key lengths). Layout (B, H, N, D).
    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as for softmax attention.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=4)
    query, key, value = _dispatch.autocast_inputs("lower", query, key, value)
    check_same("key", key, "query", query)
    check_same("value", value, "query", query)
    B, H, Nq, D = query.shape
    Nk = key.shape[2]
    check_dim("key", key, 0, B, "batch")
    check_dim("key", key, 1, H, "heads")
    check_dim("key", key, 3, D, "head dim, as query")
    check_dim("value", value, 0, B, "batch")
    check_dim("value", value, 1, H, "heads")
    check_dim("value", value, 2, Nk, "key length, as key")
    check_head_dim("query", D)
    check_head_dim("value", value.shape[3])
    if is_causal and Nq != Nk:
        raise ValueError(f"causal linear attention needs equal query and key lengths, got {Nq} and {Nk}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps the normaliser away from zero), got {eps}")
    key_padding_mask = check_key_padding_mask(key_padding_mask, B, Nk, query)
    query, key, value = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                         for t in (query, key, value))
    backend = _dispatch.select_backend(query.device, query.dtype, backend, "linear_attention")
    return _dispatch.run_op(_linear_attention_forward_op, _linear_attention_forward, query, key, value,
                            key_padding_mask, bool(is_causal), float(eps), backend,
                            autograd=_linear_attention_forward_eager,
                            composite=_composite.linear_attention_forward)


class LinearAttentionState(NamedTuple):
    """The recurrent state of causal linear attention: S = sum phi(k)^T v (B, H, D, Dv) and
    z = sum phi(k) (B, H, D), float32 (float64 for float64 inputs), summed over the tokens seen
    so far."""
    S: torch.Tensor
    z: torch.Tensor


def linear_attention_step(query, key, value, state=None, *, eps=1e-6):
    """One decoding step of causal linear attention, O(D * Dv) whatever the position.

    ``query``/``key`` (B, H, D) and ``value`` (B, H, Dv) are the new token's; ``state`` is the
    previous ``LinearAttentionState`` (None starts from zeros). Returns ``(out (B, H, Dv), state)``.
    Running it over a sequence equals ``linear_attention(..., is_causal=True)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=3)
    query, key, value = _dispatch.autocast_inputs("lower", query, key, value)
    check_same("key", key, "query", query)
    check_same("value", value, "query", query)
    B, H, D = query.shape
    if tuple(key.shape) != (B, H, D):
        raise ValueError(f"key must have the query's shape (B, H, D) = {(B, H, D)}, got {tuple(key.shape)}")
    if tuple(value.shape[:2]) != (B, H):
        raise ValueError(f"value must have shape (B, H, Dv) with (B, H) = {(B, H)}, got {tuple(value.shape)}")
    Dv = value.shape[2]
    c = torch.promote_types(query.dtype, torch.float32)
    if state is None:
        state = LinearAttentionState(query.new_zeros(B, H, D, Dv, dtype=c), query.new_zeros(B, H, D, dtype=c))
    elif tuple(state.S.shape) != (B, H, D, Dv) or tuple(state.z.shape) != (B, H, D):
        raise ValueError(f"state must hold S of shape {(B, H, D, Dv)} and z of shape {(B, H, D)}, got "
                         f"{tuple(state.S.shape)} and {tuple(state.z.shape)}")
    phi_q = F.elu(query.to(c)) + 1
    phi_k = F.elu(key.to(c)) + 1
    S = state.S + phi_k[..., :, None] * value.to(c)[..., None, :]
    z = state.z + phi_k
    with _dispatch.autocast_off():  # the state's precision, as in the kernels
        numerator = torch.einsum("bhd,bhde->bhe", phi_q, S)
    denominator = (phi_q * z).sum(-1, keepdim=True) + eps
    return (numerator / denominator).to(query.dtype), LinearAttentionState(S, z)
