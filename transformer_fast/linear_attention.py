"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") with the feature map
phi(x) = elu(x) + 1: the public functions, the fake kernels of its ops, and the recurrent step for decoding.

The kernels (``kernels/linear_attention.py``, ``csrc/cpu/linear_attention.cpp``) share one signature:

    linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                             output_final_state) -> (out, S, z)
    linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                              grad_final_S, grad_final_z) -> (dq, dk, dv, d initial_S, d initial_z)

q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv), any strides with a unit last-dim stride
(Nq == Nk when causal); key_padding_mask None or (B, Nk) bool (True = padded, left out of the
sums). out is (B, H, Nq, Dv) contiguous in q's dtype. The state S (B, H, D, Dv), z (B, H, D) is
kept in float32 (float64 for float64 inputs): initial_S/initial_z (both or neither, any strides)
are the sums of keys that came before the call, which every output row's sums start from; the
final state (contiguous; None or empty unless output_final_state) is the initial one plus every
unpadded key. grad_final_S/grad_final_z (each None where no gradient reaches it) are the
gradients of the final state; the initial state's gradients are None or empty without an initial state.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _backends, _build, _transforms
from ._fast_path import direct, dynamo_compiling
from ._validation import check_bools, check_tensor, check_tensors, real_scalar

_C, _ = _build.load()

# None unless a context_parallel block is open in some thread; then transformer_fast.distributed.context,
# whose functions serve that thread's calls on sequence shards and answer NotImplemented to other threads.
_context_parallel = None


def _state_dtype(q):
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.register_fake("transformer_fast::linear_attention_forward")
def _(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    B, H, Nq, D = q.shape
    Dv = v.shape[-1]
    dtype = _state_dtype(q)
    if output_final_state:
        S, z = q.new_empty(B, H, D, Dv, dtype=dtype), q.new_empty(B, H, D, dtype=dtype)
    else:
        S, z = q.new_empty(0, dtype=dtype), q.new_empty(0, dtype=dtype)
    return q.new_empty(B, H, Nq, Dv), S, z


@torch.library.register_fake("transformer_fast::linear_attention_backward")
def _(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S, grad_final_z):
    # The kernels return contiguous gradients (whatever the inputs' strides).
    dtype = _state_dtype(q)
    has_initial = initial_S is not None
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(initial_S.shape if has_initial else 0, dtype=dtype),
            q.new_empty(initial_z.shape if has_initial else 0, dtype=dtype))


class LinearAttentionState(NamedTuple):
    """The state of linear attention: S = sum phi(k)^T v (B, H, D, Dv) and z = sum phi(k) (B, H, D),
    float32 (float64 for float64 inputs), summed over the unpadded keys seen so far."""
    S: torch.Tensor
    z: torch.Tensor


def _state_pair(name, state):
    """(S, z) of a LinearAttentionState (or any (S, z) pair), (None, None) for None."""
    if state is None:
        return None, None
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{name} must be a LinearAttentionState (S, z) or None, got {type(state).__name__}")
    return state


def linear_attention(query, key, value, *, is_causal=False, key_padding_mask=None, eps=1e-6, initial_state=None,
                     output_final_state=False, backend="auto"):
    """Linear attention with phi(x) = elu(x) + 1, computed in O(N) time and memory:

        out_i = phi(q_i) S / (phi(q_i) . z + eps),  S = S0 + sum_j phi(k_j)^T v_j,  z = z0 + sum_j phi(k_j)

    with the sums over unpadded keys (``key_padding_mask`` (B, Nk) bool, True = padded), and over
    j <= i when ``is_causal`` (which needs equal query and key lengths). Layout (B, H, N, D).
    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as for softmax attention.

    ``initial_state`` (a ``LinearAttentionState`` (S0, z0), float32, float64 for float64 inputs):
    the sums of keys that came before this call (0 without it), so a causal prefill can be split
    into calls that carry the state, and a non-causal call with no keys queries a stored memory.
    ``output_final_state=True`` returns ``(out, LinearAttentionState)``, the state after the last
    unpadded key. Gradients flow into the initial state and from the final state. Inside
    ``transformer_fast.distributed.context_parallel`` the inputs are sequence shards.
    """
    if _context_parallel is not None:  # a context_parallel block is open (in some thread)
        out = _context_parallel.linear_attention(query, key, value, is_causal, key_padding_mask, eps, initial_state,
                                                 output_final_state, backend)
        if out is not NotImplemented:
            return out
    S0, z0 = _state_pair("initial_state", initial_state)
    if type(is_causal) is not bool or type(output_final_state) is not bool:
        check_bools(is_causal=is_causal, output_final_state=output_final_state)
    if type(eps) is not float:
        eps = real_scalar("eps", eps, optional=False)
    if (backend == "auto" and not dynamo_compiling()
            and direct(3, query, key, value, key_padding_mask, S0, z0)):
        out, S, z = _C.linear_attention(query, key, value, is_causal, key_padding_mask, eps, S0, z0,
                                        output_final_state)
    else:
        out, S, z = _linear_attention(query, key, value, is_causal, key_padding_mask, eps, S0, z0,
                                      output_final_state, backend)
    return (out, LinearAttentionState(S, z)) if output_final_state else out


def _linear_attention(query, key, value, is_causal, key_padding_mask, eps, S0, z0, output_final_state, backend):
    """Every call but the eager one on plain tensors of a kernel dtype (see linear_attention)."""
    check_tensors(query=query, key=key, value=value)
    for name, t in (("key_padding_mask", key_padding_mask), ("initial_state.S", S0), ("initial_state.z", z0)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if _transforms.active():
        return _transforms.linear_attention(query, key, value, is_causal, key_padding_mask, float(eps), S0, z0,
                                            output_final_state)
    with _backends.named(_backends.explicit_backend(backend, query.device, query.dtype, "linear_attention")):
        return torch.ops.transformer_fast.linear_attention(query, key, value, is_causal, key_padding_mask,
                                                           float(eps), S0, z0, output_final_state)


def linear_attention_step(query, key, value, state=None, *, eps=1e-6):
    """One decoding step of causal linear attention, O(D * Dv) whatever the position.

    ``query``/``key`` (B, H, D) and ``value`` (B, H, Dv) are the new token's; ``state`` is the
    previous ``LinearAttentionState`` (None starts from zeros). Returns ``(out (B, H, Dv), state)``.
    It is ``linear_attention`` on one token (causal, ``state`` in, the final state out), so it runs
    on the same kernels, and running it over a sequence equals ``linear_attention(..., is_causal=True)``.
    """
    if _context_parallel is not None:
        _context_parallel.linear_attention_step()  # refused inside a context_parallel block
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, floating=False)  # the op checks the rest, dtypes included
    B, H, D = query.shape
    if key.shape != query.shape:
        raise ValueError(f"key must have the query's shape (B, H, D) = {(B, H, D)}, got {tuple(key.shape)}")
    if value.shape[:2] != query.shape[:2]:
        raise ValueError(f"value must have shape (B, H, Dv) with (B, H) = {(B, H)}, got {tuple(value.shape)}")
    if state is not None:
        S0, z0 = _state_pair("state", state)
        for name, t in (("state.S", S0), ("state.z", z0)):
            check_tensor(name, t, floating=False)
        Dv = value.shape[2]
        if S0.shape != (B, H, D, Dv) or z0.shape != (B, H, D):
            raise ValueError(f"state must hold S of shape {(B, H, D, Dv)} and z of shape {(B, H, D)}, got "
                             f"{tuple(S0.shape)} and {tuple(z0.shape)}")
    try:
        out, final = linear_attention(query.unsqueeze(2), key.unsqueeze(2), value.unsqueeze(2), is_causal=True,
                                      eps=eps, initial_state=state, output_final_state=True)
    except (TypeError, ValueError) as exc:  # the op names the state by its own argument
        if "initial_state" not in str(exc):
            raise
        raise type(exc)(str(exc).replace("initial_state", "state")) from None
    return out.squeeze(2), final
