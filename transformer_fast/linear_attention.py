"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") with the feature map
phi(x) = elu(x) + 1: the public functions, the fake kernels of its ops, and the recurrent step for decoding.

The kernels (``kernels/linear_attention.py``, ``csrc/linear_attention.cpp``) share one signature:

    linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps) -> out
    linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps) -> (dq, dk, dv)

q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv), any strides with a unit last-dim stride
(Nq == Nk when causal); key_padding_mask None or (B, Nk) bool (True = padded, left out of the
sums). out is (B, H, Nq, Dv) contiguous in q's dtype; the state S, z is kept in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _backends, _build, _explicit
from ._backends import KERNEL_DTYPES
from ._calls import TENSOR_OR_NONE, TENSORS, check_tensors, direct
from ._validation import check_same, check_tensor

_C, _ = _build.load()


@torch.library.register_fake("transformer_fast::linear_attention_forward")
def _(q, k, v, key_padding_mask, is_causal, eps):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1])


@torch.library.register_fake("transformer_fast::linear_attention_backward")
def _(dout, q, k, v, key_padding_mask, is_causal, eps):
    # The kernels return contiguous gradients (whatever the inputs' strides).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def linear_attention(query, key, value, *, is_causal=False, key_padding_mask=None, eps=1e-6, backend="auto"):
    """Linear attention with phi(x) = elu(x) + 1, computed in O(N) time and memory:

        out_i = phi(q_i) S / (phi(q_i) . z + eps),  S = sum_j phi(k_j)^T v_j,  z = sum_j phi(k_j)

    with the sums over unpadded keys (``key_padding_mask`` (B, Nk) bool, True = padded), and over
    j <= i when ``is_causal`` (which needs equal query and key lengths). Layout (B, H, N, D).
    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as for softmax attention.
    """
    if (backend == "auto" and type(query) in TENSORS and type(key) in TENSORS and type(value) in TENSORS
            and type(key_padding_mask) in TENSOR_OR_NONE and query.dtype in KERNEL_DTYPES and direct()):
        return _C.linear_attention(query, key, value, bool(is_causal), key_padding_mask, eps)
    check_tensors(query=query, key=key, value=value)
    transformed = _explicit.differentiable_forms_needed()
    explicit = None if transformed else _backends.explicit_backend(backend, query.device, query.dtype,
                                                                   "linear_attention")
    if explicit is None and not transformed:
        return torch.ops.transformer_fast.linear_attention(query, key, value, bool(is_causal), key_padding_mask,
                                                           float(eps))
    q, k, v, key_padding_mask = _C.linear_attention_args(query, key, value, bool(is_causal), key_padding_mask,
                                                         float(eps))
    return _explicit.linear_attention(explicit, q, k, v, key_padding_mask, bool(is_causal), float(eps))


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
    device = query.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):  # as linear_attention is cast
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) if t.dtype in KERNEL_DTYPES else t for t in (query, key, value))
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
    with _explicit.autocast_off():  # the state's precision, as in the kernels
        numerator = torch.einsum("bhd,bhde->bhe", phi_q, S)
    denominator = (phi_q * z).sum(-1, keepdim=True) + eps
    return (numerator / denominator).to(query.dtype), LinearAttentionState(S, z)
