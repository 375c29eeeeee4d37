"""Each kernel family in plain PyTorch, once: one forward per family, written in differentiable torch,
with the kernel-level signatures of the Triton and C++ kernels. It is the "reference" backend
(float64, devices with no compiled kernels, tests) and the form torch differentiates where the
kernels' first-order formulas cannot serve: forward-mode AD, the torch.func transforms, and second
derivatives (the ``*_backward_composite`` ops, registered here). Every backward is torch's gradient
of the forward (``torch.func.vjp``; attention's takes P from the forward's lse, as the kernels' do),
so the backend and the differentiable form cannot disagree. It materialises everything (attention's
score matrix), computes in float32 at least and returns the input dtype, as the kernels do; rows
with nothing to attend to give 0, never NaN, with 0 gradient. The float64 oracle the tests compare
with is ``reference.py``, written apart from this.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._attention_call import AttentionForwardCall
from ._result_layout import in_rows_of


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def dmask_dtype(attn_mask, q):
    """dS, the float mask's gradient, has the mask's dtype: the query's, or float32."""
    return torch.float32 if attn_mask is not None and attn_mask.dtype == torch.float32 else q.dtype


def seed_value(seed):
    """The kernel ops' dropout seed (None, or a one-element int64 CPU tensor) as an int."""
    return 0 if seed is None else int(seed)


def dropout_keep_mask(seed, shape, dropout_p, device):
    """The reference backend's dropout mask: True = kept, drawn from a generator seeded with `seed`
    so the backward regenerates exactly the forward's mask."""
    generator = torch.Generator(device=device).manual_seed(seed_value(seed))
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


# The query offset's range in every backend (csrc/ops/attention_extras.h, kMaxQueryOffset).
MAX_QUERY_OFFSET = 1 << 30


def check_query_offset(fn, query_offset):
    if not -MAX_QUERY_OFFSET <= query_offset <= MAX_QUERY_OFFSET:
        raise ValueError(f"{fn}: query_offset must be in [-2^30, 2^30], got {query_offset}")


def attention_scores(q, k, attn_mask, key_padding_mask, is_causal, scale, window=(-1, -1), softcap=0.0,
                     alibi_slopes=None, query_offset=0):
    """The final scores (B, H, Nq, Nk) of dense inputs in q's dtype, -inf where a key is not allowed:
    the contract in transformer_fast/attention.py, written with differentiable torch ops."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(Nq, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    shift = Nk - Nq + query_offset  # the window and ALiBi: aligned to the bottom right, moved by the offset
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(scores.dtype)[:, :, None, None] * (i + shift - j).abs().to(scores.dtype)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(scores.dtype)
    disallowed = torch.zeros(Nq, Nk, dtype=torch.bool, device=q.device)
    if is_causal:
        disallowed = disallowed | (j > i)
    if window[0] >= 0:
        disallowed = disallowed | (j < i + shift - window[0])
    if window[1] >= 0:
        disallowed = disallowed | (j > i + shift + window[1])
    disallowed = disallowed.expand(B, H, Nq, Nk)
    if key_padding_mask is not None:
        disallowed = disallowed | key_padding_mask[:, None, None, :]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        disallowed = disallowed | ~attn_mask
    return scores.masked_fill(disallowed, float("-inf"))


def softmax_with_sinks(scores, sinks=None):
    """(p, lse) of scores (B, H, Nq, Nk) with -inf where disallowed: p = 0 and lse = the sink (or
    +inf) on rows with no allowed key; sinks (H,) join each row's denominator. Differentiable (the
    shift that keeps exp in range is detached: the result does not depend on it)."""
    if scores.shape[-1] == 0:  # no keys at all (amax has nothing to reduce)
        shift = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        shift = scores.detach().amax(dim=-1, keepdim=True)
    swamped = None
    if sinks is not None:
        sink = sinks.to(scores.dtype)[None, :, None, None]
        # A +inf sink takes its rows (p 0, lse +inf, no gradient): computed with 0 in its place
        # and overwritten, as inf - inf would make the result and its gradients NaN.
        swamped = sink.detach() == float("inf")
        sink = torch.where(swamped, torch.zeros_like(sink), sink)
        shift = torch.maximum(shift, sink.detach())
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    terms = torch.exp(scores - shift)
    denominator = terms.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - shift)
    empty = denominator == 0
    probs = terms / torch.where(empty, torch.ones_like(denominator), denominator)
    lse = torch.where(empty, torch.full_like(denominator, float("inf")), shift + torch.log(denominator))
    if swamped is not None:
        probs = torch.where(swamped, torch.zeros_like(probs), probs)
        lse = torch.where(swamped, torch.full_like(lse, float("inf")), lse)
    return probs, lse.squeeze(-1)


def softmax_from_lse(scores, lse):
    """p of scores (B, H, Nq, Nk) given the forward's lse (B, H, Nq), which holds the sinks: each
    row's sink share 1 - sum_j exp(s_ij - lse_i) joins the denominator as a constant, so that autograd
    differentiates p as softmax_with_sinks' (0, with 0 gradient, where lse is +inf)."""
    terms = torch.exp(scores - lse[..., None])
    total = terms.sum(-1, keepdim=True)
    return terms / (total + (1 - total).detach())


def check_offsets(name, offsets, total):
    """Cumulative lengths: from 0, nondecreasing, within the packed tensor's `total` rows."""
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[-1] > total:
        raise ValueError(f"{name} must start at 0, be nondecreasing and end at most at {total} (the packed rows), "
                         f"got {offsets}")


def sequences(q, k, v, cu_seq_q, cu_seq_k, seqused_k, block_table, alibi_slopes, max_q=None, max_k=None):
    """Packed inputs as dense (1, H, n, D) problems, one per sequence: yields (b, query rows, key
    rows, q, k, v, alibi slopes (1, H)); the key rows are a slice of the packed keys, or None for
    a paged cache."""
    cu_q = cu_seq_q.tolist()
    cu_k = cu_seq_k.tolist() if cu_seq_k is not None else None
    used = seqused_k.tolist() if seqused_k is not None else None
    check_offsets("cu_seq_q", cu_q, q.shape[0])
    if cu_k is not None and block_table is None:  # a paged cache's lengths are seqused_k's; cu_seq_k is not read
        check_offsets("cu_seq_k", cu_k, k.shape[0])
    if block_table is not None:
        pages = block_table.shape[1] * k.shape[1]
        slots = [pages] * (len(cu_q) - 1)
        if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= k.shape[0]):
            raise ValueError(f"block_table entries must be page indices in [0, {k.shape[0]}), got values from "
                             f"{int(block_table.min())} to {int(block_table.max())}")
    else:
        slots = [cu_k[b + 1] - cu_k[b] for b in range(len(cu_k) - 1)]
    if used is not None:
        for b, (n, slot) in enumerate(zip(used, slots)):
            if not 0 <= n <= slot:
                raise ValueError(f"seqused_k[{b}] must be in [0, {slot}] (the keys its sequence holds), got {n}")
    lengths_k = used if used is not None else slots
    for name, bound, lengths in (("max_q", max_q, [b - a for a, b in zip(cu_q, cu_q[1:])]), ("max_k", max_k, lengths_k)):
        if bound is not None and lengths and max(lengths) > bound:
            raise ValueError(f"{name} must be at least the longest sequence, {max(lengths)}, got {bound}")
    for b in range(len(cu_q) - 1):
        rows_q = slice(cu_q[b], cu_q[b + 1])
        if block_table is not None:
            rows_k = None
            kb = k[block_table[b].long()].flatten(0, 1)[:used[b]]
            vb = v[block_table[b].long()].flatten(0, 1)[:used[b]]
        else:
            start = cu_k[b]
            stop = cu_k[b + 1] if used is None else min(cu_k[b + 1], start + used[b])
            rows_k = slice(start, stop)
            kb, vb = k[rows_k], v[rows_k]
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1]
        yield (b, rows_q, rows_k, q[rows_q].transpose(0, 1)[None], kb.transpose(0, 1)[None],
               vb.transpose(0, 1)[None], slopes)


def _attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window, softcap, alibi_slopes,
               sinks, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k, query_offset, lse=None,
               score_bias=None):
    """(out, lse) in the compute dtype, out differentiable. lse: the forward's, given to the backward
    (the contract's P follow from it; sinks are then not read). score_bias (dense): added to the final
    scores, so that its gradient is theirs (dmask)."""
    c = _compute_dtype(q)
    if cu_seq_q is not None:  # one dense problem per sequence, the packed rows concatenated back
        seed = seed_value(seed)  # sequence b drops with seed + b
        outs, lses = [], []
        for b, rows_q, _, qb, kb, vb, slopes in sequences(q, k, v, cu_seq_q, cu_seq_k, seqused_k, block_table,
                                                          alibi_slopes, max_q, max_k):
            ob, lb = _attention(qb, kb, vb, None, None, False, scale, dropout_p, seed + b, window, softcap, slopes,
                                sinks, None, None, None, None, None, None, query_offset,
                                None if lse is None else lse[:, rows_q][None])
            outs.append(ob[0].transpose(0, 1))
            lses.append(lb[0])
        # Rows after the last sequence belong to none: out 0, lse the sink or +inf (the contract's
        # row with no allowed key), as the kernels leave them.
        H, rest = q.shape[1], q.shape[0] - int(cu_seq_q[-1])
        outs.append(q.new_zeros(rest, H, v.shape[-1], dtype=c))
        if sinks is None:
            lses.append(q.new_full((H, rest), float("inf"), dtype=c))
        else:
            lses.append(sinks.detach().to(c)[:, None].expand(H, rest))
        return torch.cat(outs), torch.cat(lses, dim=1)
    scores = attention_scores(q.to(c), k.to(c), attn_mask, key_padding_mask, is_causal, scale, window, softcap,
                              alibi_slopes, query_offset)
    if score_bias is not None:
        scores = scores + score_bias
    if lse is None:
        probs, lse = softmax_with_sinks(scores, sinks)
    else:
        probs = softmax_from_lse(scores, lse.to(c))
    if dropout_p > 0:
        probs = probs * dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1 - dropout_p)
    group = q.shape[1] // v.shape[1]
    vc = v.to(c).repeat_interleave(group, dim=1) if group > 1 else v.to(c)
    return probs @ vc, lse


def attention_forward(c):
    """The attention_forward op on one call (_attention_call.AttentionForwardCall)."""
    check_query_offset("attention_forward", c.query_offset)
    q = c.q
    out, lse = _attention(q, c.k, c.v, c.attn_mask, c.key_padding_mask, c.is_causal, c.scale, c.dropout_p, c.seed,
                          c.window, c.softcap, c.alibi_slopes, c.sinks, c.cu_seq_q, c.cu_seq_k, c.seqused_k,
                          c.block_table, c.max_q, c.max_k, c.query_offset)
    out = out.to(q.dtype)
    return (out if c.cu_seq_q is not None else in_rows_of(q, out)), lse.detach()


def attention_backward(c):
    """The attention_backward op on one call (_attention_call.AttentionBackwardCall): the forward's
    gradients, the forward recomputed from q, k, v with its P taken from lse, which holds the sinks
    (sinks and out are not read), and differentiated. dmask is the gradient of a zero bias added to
    the final scores; delta is dO . O with the unrounded O, which is sum_j p_ij dP_ij (O = sum_j
    p_ij v_j, dropout included)."""
    check_query_offset("attention_backward", c.query_offset)
    q, k, v, lse, attn_mask = c.q, c.k, c.v, c.lse, c.attn_mask
    dtype = _compute_dtype(q)
    packed = c.cu_seq_q is not None
    # an expanded scalar: its gradient is full-sized, and nothing of that size is allocated for it
    bias = (q.new_zeros((), dtype=dtype).expand(*q.shape[:3], k.shape[2]),) if c.compute_dmask and not packed else ()

    def forward(q, k, v, *bias):
        return _attention(q, k, v, attn_mask, c.key_padding_mask, c.is_causal, c.scale, c.dropout_p, c.seed, c.window,
                          c.softcap, c.alibi_slopes, None, c.cu_seq_q, c.cu_seq_k, None, None, None, None,
                          c.query_offset, lse, *bias)[0]

    recomputed, pull = torch.func.vjp(forward, q, k, v, *bias)
    dout = c.dout.to(dtype)
    dq, dk, dv, *dmask = pull(dout)
    if packed:
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    else:
        dq, dk, dv = in_rows_of(q, dq), in_rows_of(k, dk), in_rows_of(v, dv)
    dmask = dmask[0].to(dmask_dtype(attn_mask, q)).contiguous() if dmask else None
    delta = None
    if c.compute_delta:
        delta = (dout * recomputed).sum(-1)
        delta = (delta.transpose(0, 1) if packed else delta).to(lse.dtype).contiguous()
    return dq, dk, dv, dmask, delta


def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
    h = x if residual is None else x + residual  # rounded to the input dtype, as torch's x + r is
    c = _compute_dtype(h)
    hc, shape = h.to(c), h.shape[-1:]
    weight = None if weight is None else weight.to(c)
    stats = hc.detach()  # mean and rstd are outputs the callers do not differentiate
    if is_rms:
        y = F.rms_norm(hc, shape, weight, eps)
        mean, rstd = None, torch.rsqrt(stats.square().mean(-1) + eps)
    else:
        y = F.layer_norm(hc, shape, weight, None if bias is None else bias.to(c), eps)
        var, mean = torch.var_mean(stats, dim=-1, correction=0)
        rstd = torch.rsqrt(var + eps)
    return y.to(h.dtype), (None if residual is None else h.contiguous()), mean, rstd


def layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    """Recomputed from h (mean and rstd are not read), differentiated in the compute dtype so that dx
    is rounded once, after dh joins it."""
    c = _compute_dtype(h)
    grads = _gradients(layer_norm_forward, (h.to(c), None, weight, bias, eps, is_rms), (0, 2, 3),
                       (dy.to(c), None, None, None))
    dx = grads[0] if dh is None else grads[0] + dh.to(c)
    return dx.to(h.dtype), grads[2], grads[3]


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S=None, initial_z=None,
                             output_final_state=False):
    """(out, S, z): the final state (S, z) is None unless output_final_state."""
    c = _compute_dtype(q)
    phi_q, phi_k, vc = F.elu(q.to(c)) + 1, F.elu(k.to(c)) + 1, v.to(c)
    if key_padding_mask is not None:  # padded keys are out of every sum
        padded = key_padding_mask[:, None, :, None]
        phi_k, vc = phi_k.masked_fill(padded, 0.0), vc.masked_fill(padded, 0.0)
    weights = phi_q @ phi_k.transpose(-2, -1)
    if is_causal:
        weights = weights.tril()
    numerator = weights @ vc
    denominator = weights.sum(dim=-1, keepdim=True)
    if initial_S is not None:
        numerator = numerator + phi_q @ initial_S.to(c)
        denominator = denominator + phi_q @ initial_z.to(c)[..., None]
    out = (numerator / (denominator + eps)).to(q.dtype)
    if not output_final_state:
        return out, None, None
    S, z = phi_k.transpose(-2, -1) @ vc, phi_k.sum(dim=-2)
    if initial_S is not None:
        S, z = S + initial_S.to(c), z + initial_z.to(c)
    return out, S, z


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                              grad_final_z):
    final_state = grad_final_S is not None or grad_final_z is not None
    grads = _gradients(linear_attention_forward,
                       (q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, final_state),
                       (0, 1, 2, 6, 7), (dout, grad_final_S, grad_final_z))
    return (*(g.contiguous() for g in grads[:3]), *grads[6:8])


def _gradients(forward, args, differentiable, grads):
    """The gradients of ``forward(*args)`` for ``grads`` (one per output, None where an output gets
    none) with respect to ``args[i]`` for i in ``differentiable`` (the absent ones skipped): one
    entry per arg, None where none was taken. By torch.func.vjp, which differentiates at any dispatch
    level (the dispatcher runs the backward kernels below autograd on devices with no kernels of
    their own) and whose results autograd differentiates again (second derivatives)."""
    wanted = [i for i in differentiable if args[i] is not None]
    result = [None] * len(args)
    if not wanted:
        return result

    def of_wanted(*primals):
        full = list(args)
        for i, primal in zip(wanted, primals):
            full[i] = primal
        return tuple(o for o, g in zip(forward(*full), grads) if g is not None)

    _, pull = torch.func.vjp(of_wanted, *(args[i] for i in wanted))
    for i, g in zip(wanted, pull(tuple(g for g in grads if g is not None))):
        result[i] = g
    return result


# The *_backward_composite ops: the first-order gradients as a graph torch can differentiate again,
# which the ops' autograd kernels call under create_graph=True. Only the inputs that require grad
# are differentiated; the others get zeros (an empty tensor where absent).
def _composite_gradients(forward, args, differentiable, grads):
    requiring = [i for i in differentiable if isinstance(args[i], torch.Tensor) and args[i].requires_grad]
    found = _gradients(forward, args, requiring, grads)
    return [found[i] if found[i] is not None else torch.zeros_like(args[i]) if args[i] is not None else torch.empty(0)
            for i in differentiable]


def attention_backward_composite(dout, q, k, v, attn_mask, key_padding_mask, is_causal, scale, window=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, sinks=None, cu_seq_q=None, cu_seq_k=None,
                                 query_offset=0):
    """(dq, dk, dv, dmask, dsinks)."""
    args = (q, k, v, attn_mask, key_padding_mask, is_causal, scale, 0.0, None, window, softcap, alibi_slopes, sinks,
            cu_seq_q, cu_seq_k, None, None, None, None, 0, query_offset)
    return tuple(_composite_gradients(lambda *a: attention_forward(AttentionForwardCall(*a)), args, (0, 1, 2, 3, 12),
                                      (dout, None)))


def layer_norm_backward_composite(dy, h, weight, bias, eps, is_rms):
    """(dx, dweight, dbias) through the saved normalised input h (x + residual, itself the op's
    output: torch differentiates through it back to x and the residual)."""
    return tuple(_composite_gradients(layer_norm_forward, (h, None, weight, bias, eps, is_rms), (0, 2, 3),
                                      (dy, None, None, None)))


def linear_attention_backward_composite(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                        grad_final_S, grad_final_z):
    """(dq, dk, dv, d initial_S, d initial_z); the last two empty without an initial state."""
    final_state = grad_final_S is not None or grad_final_z is not None
    args = (q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, final_state)
    dq, dk, dv, dS0, dz0 = _composite_gradients(linear_attention_forward, args, (0, 1, 2, 6, 7),
                                                (dout, grad_final_S, grad_final_z))
    if initial_S is None:
        dS0, dz0 = q.new_empty(0, dtype=_compute_dtype(q)), q.new_empty(0, dtype=_compute_dtype(q))
    return dq, dk, dv, dS0, dz0


_library = None


def register():
    """Registers the *_backward_composite functions as their ops' kernels (once)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("transformer_fast", "IMPL")
    for fn in (attention_backward_composite, layer_norm_backward_composite, linear_attention_backward_composite):
        _library.impl(fn.__name__, fn, "CompositeImplicitAutograd")
