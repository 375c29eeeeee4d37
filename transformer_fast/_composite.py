"""Each op written as differentiable plain-torch code, with the kernel-level signatures.

The fused kernels come with first-order backward formulas only. Where those cannot serve, the
ops run these instead, and torch differentiates them: forward-mode AD (``torch.func.jvp``,
``jacfwd``, ``torch.autograd.forward_ad``), the ``torch.func`` transforms (``grad``, ``vmap``,
``jacrev``, per-sample gradients) and second derivatives (``create_graph=True``). They
materialise what the kernels never do (attention's full score matrix), compute in float32 at
least, and give 0, never NaN, for rows with nothing to attend to, with 0 gradient there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._plain_torch import attention_scores, dropout_keep_mask, seed_value, sequences, softmax_with_sinks


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window=(-1, -1),
                      softcap=0.0, alibi_slopes=None, sinks=None, cu_seq_q=None, cu_seq_k=None, seqused_k=None,
                      block_table=None, max_q=0, max_k=0, num_splits=0, query_offset=0):
    c = _compute_dtype(q)
    if cu_seq_q is not None:  # one dense problem per sequence (the packed rows are concatenated back)
        seed = seed_value(seed)
        outs, lses = [], []
        for b, _, _, qb, kb, vb, slopes in sequences(q, k, v, cu_seq_q, cu_seq_k, seqused_k, block_table,
                                                     alibi_slopes):
            ob, lb = attention_forward(qb, kb, vb, None, None, False, scale, dropout_p, seed + b, window, softcap,
                                       slopes, sinks, query_offset=query_offset)
            outs.append(ob[0].transpose(0, 1))
            lses.append(lb[0])
        # Rows after the last sequence belong to none: out 0, lse the sink or +inf (the contract's
        # row with no allowed key), as the kernels leave them.
        H, rest = q.shape[1], q.shape[0] - int(cu_seq_q[-1])
        outs.append(q.new_zeros(rest, H, v.shape[-1]))
        if sinks is None:
            lses.append(q.new_full((H, rest), float("inf"), dtype=c))
        else:
            lses.append(sinks.detach().to(c)[:, None].expand(H, rest))
        return torch.cat(outs), torch.cat(lses, dim=1)
    group = q.shape[1] // k.shape[1]
    vc = v.to(c).repeat_interleave(group, dim=1) if group > 1 else v.to(c)
    scores, _ = attention_scores(q.to(c), k.to(c), attn_mask, key_padding_mask, is_causal, scale, window, softcap,
                                 alibi_slopes, query_offset)
    # softmax with a constant shift (its gradient does not depend on it, so it is detached);
    # rows with no allowed key have only zero terms and give p = 0, lse = the sink or +inf.
    probs, lse = softmax_with_sinks(scores, sinks)
    if dropout_p > 0:
        probs = probs * dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1.0 - dropout_p)
    out = torch.matmul(probs, vc)
    return out.to(q.dtype), lse.detach().to(c)


def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
    h = x if residual is None else x + residual
    c = _compute_dtype(h)
    N = h.shape[-1]
    w = None if weight is None else weight.to(c)
    if is_rms:
        y = F.rms_norm(h.to(c), (N,), w, eps)
    else:
        y = F.layer_norm(h.to(c), (N,), w, None if bias is None else bias.to(c), eps)
    # The statistics are outputs the callers drop; they are not differentiable.
    empty = h.new_empty(0, dtype=c)
    return y.to(h.dtype), (h if residual is not None else h.new_empty(0)), empty, empty


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S=None, initial_z=None,
                             output_final_state=False):
    """(out, S, z): the final state (S, z) is None unless output_final_state."""
    c = _compute_dtype(q)
    phi_q, phi_k, vc = F.elu(q.to(c)) + 1, F.elu(k.to(c)) + 1, v.to(c)
    if key_padding_mask is not None:  # padded keys are out of every sum
        padded = key_padding_mask[:, None, :, None]
        phi_k, vc = phi_k.masked_fill(padded, 0.0), vc.masked_fill(padded, 0.0)
    weights = torch.matmul(phi_q, phi_k.transpose(-2, -1))
    if is_causal:
        weights = weights.tril()
    numerator = torch.matmul(weights, vc)
    denominator = weights.sum(dim=-1, keepdim=True)
    if initial_S is not None:
        numerator = numerator + torch.matmul(phi_q, initial_S.to(c))
        denominator = denominator + torch.matmul(phi_q, initial_z.to(c)[..., None])
    out = (numerator / (denominator + eps)).to(q.dtype)
    if not output_final_state:
        return out, None, None
    S, z = torch.matmul(phi_k.transpose(-2, -1), vc), phi_k.sum(dim=-2)
    if initial_S is not None:
        S, z = S + initial_S.to(c), z + initial_z.to(c)
    return out, S, z


def backward(composite, args, differentiable, grads):
    """The gradients of ``composite(*args)`` with respect to ``args[i]`` for i in
    ``differentiable``, given ``grads`` for its outputs (None where an output gets none), as a graph
    that can itself be differentiated: second derivatives of the fused ops go through here.
    Returns one entry per arg, None where none is asked for or needed."""
    wanted = [i for i in differentiable if isinstance(args[i], torch.Tensor) and args[i].requires_grad]
    result = [None] * len(args)
    if not wanted:
        return result
    with torch.enable_grad():
        # Differentiated through fresh aliases: an arg may also lie behind another arg (the
        # normalised input h is the op's own output, computed from its weight), and torch must
        # not take the gradient through that path (it would re-enter this backward).
        args = [a.view_as(a) if i in wanted else a for i, a in enumerate(args)]
        outs = composite(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return result
        found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                    create_graph=True, allow_unused=True)
    for i, g in zip(wanted, found):
        result[i] = g
    return result


# The first-order gradients of each op as a differentiable graph: the implementations of the
# *_backward_composite ops, which the ops' autograd kernels call under create_graph=True.
def _or_zeros(grad, like):
    if grad is not None:
        return grad
    return torch.zeros_like(like) if like is not None else torch.empty(0)


def attention_backward(dout, q, k, v, attn_mask, key_padding_mask, is_causal, scale, window=(-1, -1), softcap=0.0,
                       alibi_slopes=None, sinks=None, cu_seq_q=None, cu_seq_k=None, query_offset=0):
    """(dq, dk, dv, dmask, dsinks) as a differentiable graph."""
    args = (q, k, v, attn_mask, key_padding_mask, is_causal, scale, 0.0, 0, window, softcap, alibi_slopes, sinks,
            cu_seq_q, cu_seq_k, None, None, 0, 0, 0, query_offset)
    grads = backward(attention_forward, args, (0, 1, 2, 3, 12), (dout, None))
    return tuple(_or_zeros(grads[i], args[i]) for i in (0, 1, 2, 3, 12))


def layer_norm_backward(dy, h, weight, bias, eps, is_rms):
    """(dx, dweight, dbias) through the saved normalised input h (x + residual, itself the op's
    output: torch differentiates through it back to x and the residual)."""
    args = (h, None, weight, bias, eps, is_rms)
    dx, _, dweight, dbias = backward(layer_norm_forward, args, (0, 2, 3), (dy, None, None, None))[:4]
    return _or_zeros(dx, h), _or_zeros(dweight, weight), _or_zeros(dbias, bias)


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                              grad_final_z):
    """(dq, dk, dv, d initial_S, d initial_z); the last two empty without an initial state."""
    final_state_grad = grad_final_S is not None or grad_final_z is not None
    args = (q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, final_state_grad)
    grads = backward(linear_attention_forward, args, (0, 1, 2, 6, 7), (dout, grad_final_S, grad_final_z))
    dq, dk, dv = (_or_zeros(g, a) for g, a in zip(grads[:3], args[:3]))
    if initial_S is None:
        empty = q.new_empty(0, dtype=_compute_dtype(q))
        return dq, dk, dv, empty, empty.clone()
    return dq, dk, dv, _or_zeros(grads[6], initial_S), _or_zeros(grads[7], initial_z)


def register():
    """Registers the functions above as the *_backward_composite ops' kernels (once)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("transformer_fast", "IMPL")
    for name, fn in (("attention_backward_composite", attention_backward),
                     ("layer_norm_backward_composite", layer_norm_backward),
                     ("linear_attention_backward_composite", linear_attention_backward)):
        _library.impl(name, fn, "CompositeImplicitAutograd")


_library = None
