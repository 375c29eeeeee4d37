"""Calls that do not go through the dispatcher's kernels: a backend asked for by name
(``backend=``, ``TRANSFORMER_FAST_BACKEND``; float64, which only plain torch serves), and the
torch.func transforms and forward-mode AD, which the ops' autograd formulas cannot serve.

The first run the named backend's kernels under a ``torch.autograd.Function`` with the same
formulas as the ops' C++ autograd kernels (csrc/ops/<family>_op.cpp); the second run the op written
in differentiable torch (``_plain_torch.py``). Both take the arguments the C++ checks return, so
the checks and their messages are the same on every path.
"""
from __future__ import annotations

import contextlib

import torch

from . import _plain_torch
from ._device_kernels import op_kernel

_AUTOCAST_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def autocast_off():
    """A context in which torch ops are not autocast (the inputs were cast by the checks)."""
    if torch._C._is_any_autocast_enabled():
        return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)
    return contextlib.nullcontext()


def differentiable_forms_needed() -> bool:
    """A torch.func transform or forward-mode AD is active (outside torch.compile, which handles
    them itself): the composite forms must run."""
    return not torch.compiler.is_compiling() and (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0)


def _kernel(name, backend, t):
    return op_kernel(name, backend, t.device.type)


_NO_EXTRAS = {}


class Attention(torch.autograd.Function):
    """``backend``'s attention kernels with the formula of csrc/ops/attention_op.cpp. ``extras``: the
    kernel ops' arguments beyond the dense masks, by name (sinks, which get a gradient, apart)."""

    @staticmethod
    def forward(ctx, backend, q, k, v, attn_mask, key_padding_mask, sinks, is_causal, scale, dropout_p, seed, extras):
        if extras.get("seqused_k") is not None or extras.get("block_table") is not None:
            if any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
                raise NotImplementedError("varlen_attn: seqused_k and block_table are inference-only (no backward); "
                                          "call it under torch.no_grad() or with inputs that do not require grad")
        with autocast_off():
            out, lse = _kernel("attention_forward", backend, q)(q, k, v, attn_mask, key_padding_mask, is_causal,
                                                                 scale, dropout_p, seed, sinks=sinks, **extras)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, sinks)
        ctx.args = (backend, is_causal, scale, dropout_p, seed, extras)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse, attn_mask, key_padding_mask, sinks = ctx.saved_tensors
        backend, is_causal, scale, dropout_p, seed, extras = ctx.args
        mask_grad, sinks_grad = ctx.needs_input_grad[4], ctx.needs_input_grad[6]
        packed = {name: extras.get(name) for name in ("cu_seq_q", "cu_seq_k")}
        shape = {name: extras[name] for name in ("window", "softcap", "alibi_slopes", "query_offset")
                 if name in extras}
        dsinks = None
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will be taken
            if dropout_p > 0:
                raise NotImplementedError("transformer_fast attention: second derivatives (create_graph=True) are "
                                          "not supported with dropout_p > 0")
            dq, dk, dv, dmask, dsinks = _plain_torch.attention_backward_composite(
                dout, q, k, v, attn_mask, key_padding_mask, is_causal, scale, sinks=sinks, **shape, **packed)
        else:
            with autocast_off():
                dq, dk, dv, dmask, delta = _kernel("attention_backward", backend, q)(
                    dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                    mask_grad, max_q=extras.get("max_q", 0), max_k=extras.get("max_k", 0), compute_delta=sinks_grad,
                    sinks=sinks, **shape, **packed)
                if sinks_grad:
                    dsinks = sinks_gradient(delta, lse, sinks, packed["cu_seq_q"] is not None)
        return (None, dq, dk, dv, dmask if mask_grad else None, None, dsinks if sinks_grad else None, None, None,
                None, None, None)


def sinks_gradient(delta, lse, sinks, packed):
    """d loss / d sinks (csrc/ops/attention_op.cpp): -sum over each head's rows of exp(sink - lse) * delta,
    delta = sum_j P_ij dP_ij from the backward kernel (lse-shaped: (B, H, Nq), packed (H, Tq))."""
    sink = sinks[:, None] if packed else sinks[None, :, None]
    weighted = torch.where(sink == lse, delta, torch.exp(sink - lse) * delta)  # P_sink = 1 where lse = sink (+inf)
    return -weighted.sum(1) if packed else -weighted.sum((0, 2))


class LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, x, residual, weight, bias, eps, is_rms):
        with autocast_off():
            y, h, mean, rstd = _kernel("layer_norm_forward", backend, x)(x, residual, weight, bias, eps, is_rms)
        ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd)
        ctx.args = (backend, eps, is_rms, residual is not None)
        ctx.mark_non_differentiable(mean, rstd)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        backend, eps, is_rms, has_residual = ctx.args
        dy = dy if dy.shape[-1] <= 1 or dy.stride(-1) == 1 else dy.contiguous()
        if torch.is_grad_enabled():  # create_graph=True
            dx, dweight, dbias = _plain_torch.layer_norm_backward_composite(dy, h, weight, bias, eps, is_rms)
            if has_residual and dh is not None:
                dx = dx + dh
        else:
            if has_residual and dh is not None and dh.shape[-1] > 1 and dh.stride(-1) != 1:
                dh = dh.contiguous()
            with autocast_off():
                dx, dweight, dbias = _kernel("layer_norm_backward", backend, h)(
                    dy, dh if has_residual else None, h, weight, bias, mean, rstd, eps, is_rms)
        return (None, dx, dx if has_residual else None, dweight if weight is not None else None,
                dbias if bias is not None else None, None, None)


class LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
        with autocast_off():
            out, S, z = _kernel("linear_attention_forward", backend, q)(q, k, v, key_padding_mask, is_causal, eps,
                                                                        initial_S, initial_z, output_final_state)
        ctx.save_for_backward(q, k, v, key_padding_mask, initial_S, initial_z)  # the backward recomputes the state
        ctx.args = (backend, is_causal, eps)
        if not output_final_state:
            ctx.mark_non_differentiable(S, z)
        ctx.set_materialize_grads(False)  # no zero tensors for outputs that get no gradient
        return out, S, z

    @staticmethod
    def backward(ctx, dout, grad_final_S, grad_final_z):
        q, k, v, key_padding_mask, initial_S, initial_z = ctx.saved_tensors
        backend, is_causal, eps = ctx.args
        if dout is None:  # a loss on the final state alone
            dout = q.new_zeros(*q.shape[:3], v.shape[3])
        if torch.is_grad_enabled():  # create_graph=True
            dq, dk, dv, dS0, dz0 = _plain_torch.linear_attention_backward_composite(
                dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S, grad_final_z)
        else:
            with autocast_off():
                dq, dk, dv, dS0, dz0 = _kernel("linear_attention_backward", backend, q)(
                    dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S, grad_final_z)
        has_initial = initial_S is not None
        return (None, dq, dk, dv, None, None, None, dS0 if has_initial else None, dz0 if has_initial else None,
                None)


def attention(backend, q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, extras=_NO_EXTRAS):
    """(out, lse) of attention on checked arguments (attention_args, varlen_args): ``backend``'s
    kernels, or the composite form under a torch.func transform or forward AD (backend None)."""
    extras = dict(extras)
    sinks = extras.pop("sinks", None)
    if backend is None:
        with autocast_off():
            return _plain_torch.attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                                                  seed, sinks=sinks, **extras)
    return Attention.apply(backend, q, k, v, attn_mask, key_padding_mask, sinks, is_causal, scale, dropout_p, seed,
                           extras)


def layer_norm(backend, x, residual, weight, bias, eps, is_rms):
    """(y, h) on checked arguments (layer_norm_args: the normalised dims as the last); backend None: the
    composite form."""
    if backend is None:
        with autocast_off():
            y, h, _, _ = _plain_torch.layer_norm_forward(x, residual, weight, bias, eps, is_rms)
        return y, h
    return LayerNorm.apply(backend, x, residual, weight, bias, eps, is_rms)


def linear_attention(backend, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    """(out, final S, final z) on checked arguments (linear_attention_args); backend None: the
    composite form (whose final state is None unless asked for)."""
    if backend is None:
        with autocast_off():
            return _plain_torch.linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S,
                                                         initial_z, output_final_state)
    return LinearAttention.apply(backend, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                 output_final_state)
