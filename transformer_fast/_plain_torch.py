"""The plain-torch backend ("reference"): the kernel-level functions (same signatures as the
Triton and C++ kernels) in plain PyTorch, materialising everything. It serves float64, devices
with no compiled kernels, and tests. Backward passes are the textbook formulas (they run inside
an op's backward, where autograd does not record). Computes in float32 at least and returns the
input dtype, as the kernels do."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
    """The final scores (B, H, Nq, Nk) of dense inputs in q's dtype, -inf where a key is not allowed,
    and the raw scaled scores the soft-capping was applied to (None without it): the contract in
    transformer_fast/attention.py, written with differentiable torch ops."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    raw = q @ k.transpose(-2, -1) * scale
    scores = softcap * torch.tanh(raw / softcap) if softcap else raw
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
    return scores.masked_fill(disallowed, float("-inf")), (raw if softcap else None)


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


def attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window=(-1, -1),
                      softcap=0.0, alibi_slopes=None, sinks=None, cu_seq_q=None, cu_seq_k=None, seqused_k=None,
                      block_table=None, max_q=0, max_k=0, num_splits=0, query_offset=0):
    check_query_offset("attention_forward", query_offset)
    c = _compute_dtype(q)
    if cu_seq_q is not None:  # sequence b drops with seed + b
        seed = seed_value(seed)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        # rows of no sequence (after the last) have no allowed key: lse the sink or +inf
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=c, device=q.device)
        if sinks is not None:
            lse[:] = sinks.to(c)[:, None]
        for b, rows_q, _, qb, kb, vb, slopes in sequences(q, k, v, cu_seq_q, cu_seq_k, seqused_k, block_table,
                                                          alibi_slopes, max_q, max_k):
            ob, lb = attention_forward(qb, kb, vb, None, None, False, scale, dropout_p, seed + b, window, softcap,
                                       slopes, sinks, query_offset=query_offset)
            out[rows_q] = ob[0].transpose(0, 1)
            lse[:, rows_q] = lb[0]
        return out, lse
    scores, _ = attention_scores(q.to(c), k.to(c), attn_mask, key_padding_mask, is_causal, scale, window, softcap,
                                 alibi_slopes, query_offset)
    probs, lse = softmax_with_sinks(scores, sinks)
    if dropout_p > 0:
        probs = probs * dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1 - dropout_p)
    v = v.to(c).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return in_rows_of(q, (probs @ v).to(q.dtype)), lse.to(c)


def _sum_groups(t, heads):
    """(B, H, ...) -> (B, heads, ...): sums each group of H // heads query heads (GQA)."""
    B, H = t.shape[:2]
    return t.reshape(B, heads, H // heads, *t.shape[2:]).sum(2)


def attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                       compute_dmask, window=(-1, -1), softcap=0.0, alibi_slopes=None, cu_seq_q=None, cu_seq_k=None,
                       max_q=0, max_k=0, compute_delta=False, sinks=None, query_offset=0):
    """sinks: unused (the gradients follow from lse, which includes them)."""
    check_query_offset("attention_backward", query_offset)
    if cu_seq_q is not None:
        seed = seed_value(seed)
        dq, dk, dv = (t.new_zeros(t.shape) for t in (q, k, v))  # contiguous, as packed results are
        delta = lse.new_zeros(lse.shape) if compute_delta else None  # rows after the last sequence: 0
        for b, rows_q, rows_k, qb, kb, vb, slopes in sequences(q, k, v, cu_seq_q, cu_seq_k, None, None,
                                                               alibi_slopes):
            dob = dout[rows_q].transpose(0, 1)[None]
            lb = lse[:, rows_q][None]
            g = attention_backward(dob, qb, kb, vb, None, lb, None, None, False, scale, dropout_p, seed + b, False,
                                   window, softcap, slopes, compute_delta=compute_delta, query_offset=query_offset)
            dq[rows_q] = g[0][0].transpose(0, 1)
            dk[rows_k] = g[1][0].transpose(0, 1)
            dv[rows_k] = g[2][0].transpose(0, 1)
            if compute_delta:
                delta[:, rows_q] = g[4][0]
        return dq, dk, dv, None, delta
    c = _compute_dtype(q)
    qc, kc, vc, doutc = q.to(c), k.to(c), v.to(c), dout.to(c)
    H, Hk = q.shape[1], k.shape[1]
    scores, raw = attention_scores(qc, kc, attn_mask, key_padding_mask, is_causal, scale, window, softcap,
                                   alibi_slopes, query_offset)
    # P from the forward's lse (sinks included), 0 where disallowed or on rows with no allowed key
    probs = torch.exp(scores - lse.to(c)[..., None])
    keep = 1.0
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1 - dropout_p)
    k_full, v_full = kc.repeat_interleave(H // Hk, dim=1), vc.repeat_interleave(H // Hk, dim=1)
    dv = _sum_groups((probs * keep).transpose(-2, -1) @ doutc, Hk)
    dprobs = (doutc @ v_full.transpose(-2, -1)) * keep
    delta = (dprobs * probs).sum(-1)
    dscores = probs * (dprobs - delta[..., None])
    dmask = dscores.to(dmask_dtype(attn_mask, q)) if compute_dmask else None
    if raw is not None:  # through softcap * tanh(raw / softcap)
        dscores = dscores * (1 - torch.tanh(raw / softcap) ** 2)
    dq = dscores @ k_full * scale
    dk = _sum_groups(dscores.transpose(-2, -1) @ qc * scale, Hk)
    return (in_rows_of(q, dq.to(q.dtype)), in_rows_of(k, dk.to(k.dtype)), in_rows_of(v, dv.to(v.dtype)), dmask,
            delta.to(lse.dtype) if compute_delta else None)


def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
    h = x if residual is None else x + residual  # rounded to the input dtype, as torch's x + r is
    hc = h.to(_compute_dtype(x))
    mean = None if is_rms else hc.mean(dim=-1)
    centered = hc if is_rms else hc - mean[:, None]
    rstd = torch.rsqrt((centered * centered).mean(dim=-1) + eps)
    y = centered * rstd[:, None]
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    stats = torch.promote_types(x.dtype, torch.float32)
    return (y.to(x.dtype), None if residual is None else h.contiguous(),
            None if mean is None else mean.to(stats), rstd.to(stats))


def layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    c = _compute_dtype(h)
    hc, dyc, rstd = h.to(c), dy.to(c), rstd.to(c)[:, None]
    xhat = (hc if is_rms else hc - mean.to(c)[:, None]) * rstd
    g = dyc if weight is None else dyc * weight.to(c)
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - g.mean(-1, keepdim=True)
    dx = dx * rstd
    if dh is not None:
        dx = dx + dh.to(c)
    dweight = None if weight is None else (dyc * xhat).sum(0).to(weight.dtype)
    dbias = None if bias is None else dyc.sum(0).to(bias.dtype)
    return dx.to(h.dtype), dweight, dbias


def _elu_feature_map(x):
    return F.elu(x) + 1


def _elu_derivative(x):
    """d phi(x)/dx = elu'(x): 1 for x > 0, exp(x) otherwise."""
    return torch.where(x > 0, 1.0, torch.exp(x))


def _linear_attention_weights(q, k, key_padding_mask, is_causal):
    """phi(q_i).phi(k_j), zeroed where key j is padded or (causal) j > i."""
    weights = _elu_feature_map(q) @ _elu_feature_map(k).transpose(-2, -1)
    if is_causal:
        weights = weights.tril()
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return weights


def _unpadded(x, key_padding_mask):
    """x (B, H, Nk, .) with the rows of padded keys set to 0 (whatever they held)."""
    return x if key_padding_mask is None else x.masked_fill(key_padding_mask[:, None, :, None], 0.0)


def _linear_attention_terms(q, k, v, key_padding_mask, is_causal, initial_S, initial_z):
    """(weights, numerator, denominator without eps) in the compute dtype: the keys' sums plus the
    initial state's terms phi(q) S0 and phi(q) . z0."""
    weights = _linear_attention_weights(q, k, key_padding_mask, is_causal)
    numerator = weights @ _unpadded(v, key_padding_mask)
    denominator = weights.sum(-1, keepdim=True)
    if initial_S is not None:
        phi_q = _elu_feature_map(q)
        numerator = numerator + phi_q @ initial_S.to(q.dtype)
        denominator = denominator + phi_q @ initial_z.to(q.dtype)[..., None]
    return weights, numerator, denominator


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    c = _compute_dtype(q)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    _, numerator, denominator = _linear_attention_terms(qc, kc, vc, key_padding_mask, is_causal, initial_S,
                                                        initial_z)
    out = (numerator / (denominator + eps)).to(q.dtype)
    if not output_final_state:
        return out, None, None
    phi_k = _unpadded(_elu_feature_map(kc), key_padding_mask)
    S = phi_k.transpose(-2, -1) @ _unpadded(vc, key_padding_mask)
    z = phi_k.sum(-2)
    if initial_S is not None:
        S, z = S + initial_S, z + initial_z
    return out, S, z


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                              grad_final_z):
    """With W_ij = phi(q_i).phi(k_j) (allowed pairs), out_i = n_i / d_i, G_i = dout_i / d_i and
    g_i = -(dout_i . out_i) / d_i: dW_ij = G_i . v_j + g_i; d phi(q_i) = sum_j dW_ij phi(k_j) +
    S0 G_i + g_i z0; d phi(k_j) = sum_i dW_ij phi(q_i) + dS_F v_j + dz_F; dv_j = sum_i W_ij G_i +
    phi(k_j) dS_F (unpadded j); dS0 = sum_i phi(q_i)^T G_i + dS_F, dz0 = sum_i g_i phi(q_i) + dz_F."""
    c = _compute_dtype(q)
    qc, kc, vc, doutc = q.to(c), k.to(c), _unpadded(v.to(c), key_padding_mask), dout.to(c)
    weights, numerator, denominator = _linear_attention_terms(qc, kc, vc, key_padding_mask, is_causal, initial_S,
                                                              initial_z)
    denominator = denominator + eps
    out = numerator / denominator
    G = doutc / denominator
    g = -(doutc * out).sum(-1, keepdim=True) / denominator
    dweights = G @ vc.transpose(-2, -1) + g
    if is_causal:
        dweights = dweights.tril()
    if key_padding_mask is not None:
        dweights = dweights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    phi_q, phi_k = _elu_feature_map(qc), _unpadded(_elu_feature_map(kc), key_padding_mask)
    dphi_q = dweights @ phi_k
    dphi_k = dweights.transpose(-2, -1) @ phi_q
    dv = weights.transpose(-2, -1) @ G
    if initial_S is not None:
        dphi_q = dphi_q + G @ initial_S.to(c).transpose(-2, -1) + g * initial_z.to(c)[..., None, :]
    if grad_final_S is not None:
        dphi_k = dphi_k + vc @ grad_final_S.to(c).transpose(-2, -1)
        dv = dv + phi_k @ grad_final_S.to(c)
    if grad_final_z is not None:
        dphi_k = dphi_k + grad_final_z.to(c)[..., None, :]
    dq = dphi_q * _elu_derivative(qc)
    dk = _unpadded(dphi_k * _elu_derivative(kc), key_padding_mask)
    dv = _unpadded(dv, key_padding_mask)
    dS0 = dz0 = None
    if initial_S is not None:
        dS0 = phi_q.transpose(-2, -1) @ G
        dz0 = (g * phi_q).sum(-2)
        if grad_final_S is not None:
            dS0 = dS0 + grad_final_S.to(c)
        if grad_final_z is not None:
            dz0 = dz0 + grad_final_z.to(c)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dz0
