"""The public functions under a torch.func transform (``grad``, ``vmap``, ``jvp``, ...) or forward-mode
AD, which the ops' C++ autograd formulas cannot serve: the same argument checks (the C++
``*_args`` the ops run), then the op written in differentiable torch (``_plain_torch.py``), which
torch differentiates and batches itself. Every other call reaches its op (``torch.ops``).
"""
from __future__ import annotations

import contextlib

import torch

from . import _build, _plain_torch
from ._attention_call import AttentionForwardCall

_C, _ = _build.load()
_AUTOCAST_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def active() -> bool:
    """A torch.func transform or forward-mode AD is active (outside torch.compile, which handles
    them itself): the differentiable forms must run."""
    return not torch.compiler.is_compiling() and (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0)


def _autocast_off():
    """A context in which torch ops are not autocast (the checks cast the inputs as the ops do)."""
    if torch._C._is_any_autocast_enabled():
        return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)
    return contextlib.nullcontext()


def _dropout_seed(dropout_p):
    """A dropout seed drawn as the public ops draw theirs (csrc/ops/attention_args.cpp, call_seed)."""
    return None if dropout_p == 0.0 else torch.randint(2**62, (), dtype=torch.int64)


def _attention(q, k, v, attn_mask, key_padding_mask, scale, extras, is_causal, dropout_p):
    with _autocast_off():
        return _plain_torch.attention_forward(AttentionForwardCall(
            q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, _dropout_seed(dropout_p), **extras))


def scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 key_padding_mask, window_size, softcap, alibi_slopes, sinks):
    q, k, v, attn_mask, key_padding_mask, scale, unbatched, extras = _C.attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, window_size,
        softcap, alibi_slopes, sinks)
    out = _attention(q, k, v, attn_mask, key_padding_mask, scale, extras, is_causal, dropout_p)[0]
    return out[0] if unbatched else out


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_lse, scale, window_size, enable_gqa,
                seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, dropout_p):
    q, k, v, _, _, scale, _, extras = _C.varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                                     window_size, enable_gqa, seqused_k, block_table, num_splits,
                                                     softcap, alibi_slopes, sinks, dropout_p)
    return _attention(q, k, v, None, None, scale, extras, False, dropout_p)


def layer_norm(x, normalized_shape, weight, bias, eps, residual, is_rms):
    """y, or (y, h) with a residual."""
    x_last, residual_last, weight, bias, eps, rows_empty = _C.layer_norm_args(x, normalized_shape, weight, bias, eps,
                                                                              residual, is_rms)
    if rows_empty:  # rows of no elements: empty outputs, as torch.nn.functional.layer_norm gives
        h = x_last if residual_last is None else x_last + residual_last
        return h.clone() if residual is None else (h.clone(), h)
    with _autocast_off():
        y, h, _, _ = _plain_torch.layer_norm_forward(x_last, residual_last, weight, bias, eps, is_rms)
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))


def linear_attention(query, key, value, is_causal, key_padding_mask, eps, initial_S, initial_z, output_final_state):
    """(out, final S, final z); the final state is None unless asked for."""
    q, k, v, key_padding_mask, S0, z0 = _C.linear_attention_args(query, key, value, is_causal, key_padding_mask, eps,
                                                                 initial_S, initial_z)
    with _autocast_off():
        return _plain_torch.linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, S0, z0,
                                                     output_final_state)
