"""Naive, obviously-correct PyTorch implementations: the oracle every kernel is tested against.

They work in any dtype (float64 included), materialise everything (the full score matrix, the
causal mask), and favour readability over speed. Do not optimise them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_bias(nq, nk, *, batch=1, heads=1, attn_mask=None, key_padding_mask=None,
                   is_causal=False, window_size=None, alibi_slopes=None, dtype=torch.float32, device=None):
    """The additive bias (0 = allowed, -inf = masked, or a float mask's values), shape
    (B, H, Nq, Nk), combining:
      * a causal mask (top-left aligned: query i sees keys j <= i);
      * a sliding window ``(left, right)`` (-1 = unbounded), aligned to the bottom right: query i
        sees keys j with i + Nk - Nq - left <= j <= i + Nk - Nq + right;
      * ALiBi: ``alibi_slopes`` (H,) or (B, H) adds -slope * |i + Nk - Nq - j|;
      * a key-padding mask (B, Nk; True = padded) and a bool (True = allowed) or float attn_mask."""
    bias = torch.zeros(batch, heads, nq, nk, dtype=dtype, device=device)
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    if is_causal:
        bias = bias.masked_fill(j > i, float("-inf"))
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            bias = bias.masked_fill(j < i + (nk - nq) - left, float("-inf"))
        if right >= 0:
            bias = bias.masked_fill(j > i + (nk - nq) + right, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, heads)
        distance = (i + (nk - nq) - j).abs().to(dtype)
        bias = bias - slopes[:, :, None, None] * distance
    if key_padding_mask is not None:
        bias = bias.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = bias + attn_mask.to(dtype)
    return bias


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None,
                                 *, key_padding_mask=None, dropout_mask=None, dropout_p=0.0, window_size=None,
                                 softcap=None, alibi_slopes=None, sinks=None, return_lse=False):
    """softmax(Q K^T * scale + bias) V for (B, H, N, D) tensors.

    With ``softcap``, the scaled scores s become softcap * tanh(s / softcap) before the bias
    (``attention_bias``: masks, window, ALiBi) is added. ``sinks`` (H,) are one extra logit per
    head in every row's softmax, with no value: they take probability away from the keys.
    Query rows with no allowed key return 0 (PyTorch >= 2.5 convention), not NaN.
    `key`/`value` may have fewer heads than `query` (grouped-query attention).
    `dropout_mask` (bool, True = kept, broadcastable to (B, H, Nq, Nk)) applies dropout with
    probability `dropout_p` to the attention probabilities, scaling the kept ones by 1/(1-p).
    ``return_lse``: also each row's log-sum-exp (sinks included; +inf for a row with no allowed
    key and no sink).
    """
    B, H, Nq, D = query.shape
    Nk = key.shape[-2]
    if key.shape[1] != H:  # grouped-query attention: each key/value head serves H // Hk queries
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    scale = D ** -0.5 if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + attention_bias(Nq, Nk, batch=B, heads=H, attn_mask=attn_mask,
                                     key_padding_mask=key_padding_mask, is_causal=is_causal,
                                     window_size=window_size, alibi_slopes=alibi_slopes,
                                     dtype=scores.dtype, device=scores.device)
    # Rows with every key masked give 0 (and 0 gradient), not the NaN of softmax over all -inf.
    no_key = torch.isneginf(scores).all(dim=-1, keepdim=True)
    if sinks is not None:  # the sink as one more column, dropped after the softmax
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(B, H, Nq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :Nk].masked_fill(no_key, 0.0)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        probs = torch.softmax(scores.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0)
        lse = torch.logsumexp(scores, dim=-1).masked_fill(no_key[..., 0], float("inf"))
    if dropout_mask is not None:
        probs = probs * dropout_mask / (1.0 - dropout_p)
    out = probs @ value
    return (out, lse) if return_lse else out


def sequence_keys(key, b, cu_seq_k=None, seqused_k=None, block_table=None):
    """The keys (or values) of sequence b as (Nk_b, Hk, D): rows cu_seq_k[b]:cu_seq_k[b + 1] of a
    packed (T, Hk, D) tensor, or, with ``block_table`` (B, pages per sequence), the pages it lists
    of a (pages, page_size, Hk, D) pool, in order; ``seqused_k[b]`` keeps the first that many."""
    if block_table is not None:
        rows = key[block_table[b].long()].flatten(0, 1)
    else:
        rows = key[int(cu_seq_k[b]):int(cu_seq_k[b + 1])]
    return rows if seqused_k is None else rows[:int(seqused_k[b])]


def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, *, scale=None, window_size=None, softcap=None,
                     alibi_slopes=None, sinks=None, seqused_k=None, block_table=None, return_lse=False):
    """Attention over a pack of sequences, one dense ``scaled_dot_product_attention`` per
    sequence: query (Tq, H, D) rows cu_seq_q[b]:cu_seq_q[b + 1] attend the keys of sequence b
    (``sequence_keys``). ``window_size`` (-1, 0) is causal, aligned to the bottom right as every
    window is. ``alibi_slopes`` (H,) or (B, H). Returns (Tq, H, Dv), and with ``return_lse`` the
    log-sum-exp (H, Tq)."""
    outs, lses = [], []
    for b in range(len(cu_seq_q) - 1):
        q = query[int(cu_seq_q[b]):int(cu_seq_q[b + 1])].transpose(0, 1)[None]
        k = sequence_keys(key, b, cu_seq_k, seqused_k, block_table).transpose(0, 1)[None]
        v = sequence_keys(value, b, cu_seq_k, seqused_k, block_table).transpose(0, 1)[None]
        slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        out, lse = scaled_dot_product_attention(q, k, v, scale=scale, window_size=window_size, softcap=softcap,
                                                alibi_slopes=slopes, sinks=sinks, return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else query.new_empty(0, query.shape[1], value.shape[-1])
    if not return_lse:
        return out
    return out, torch.cat(lses, dim=1) if lses else query.new_empty(query.shape[1], 0)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, residual=None):
    """y = (h - mean) / sqrt(var + eps) * weight + bias over the last len(normalized_shape) dims,
    with h = x (+ residual) and the biased variance. Returns y, or (y, h) with a residual."""
    h = x if residual is None else x + residual
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mean = h.mean(dim=dims, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (h - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y if residual is None else (y, h)


def rms_norm(x, normalized_shape, weight=None, eps=1e-6, residual=None):
    """y = h / sqrt(mean(h^2) + eps) * weight, h = x (+ residual). Returns y, or (y, h)."""
    h = x if residual is None else x + residual
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    y = h / torch.sqrt((h * h).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y if residual is None else (y, h)


def elu_feature_map(x):
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020)."""
    return F.elu(x) + 1


def linear_attention(query, key, value, is_causal=False, key_padding_mask=None, eps=1e-6, initial_state=None,
                     output_final_state=False):
    """out_i = (sum_j phi(q_i).phi(k_j) v_j + phi(q_i) S0) / (sum_j phi(q_i).phi(k_j) + phi(q_i).z0 + eps),
    the sums over all unpadded keys j, or over j <= i when causal; (S0, z0) = ``initial_state``
    (the sums of earlier keys), or no such terms. Written as the plain O(N^2) masked product so
    that it does not share the cumulative-sum trick with the kernels it checks.

    With ``output_final_state``, returns ``(out, (S, z))``: S = S0 + sum_j phi(k_j)^T v_j and
    z = z0 + sum_j phi(k_j) over every unpadded key."""
    Nq, Nk = query.shape[-2], key.shape[-2]
    similarity = elu_feature_map(query) @ elu_feature_map(key).transpose(-2, -1)  # (B, H, Nq, Nk)
    if is_causal:
        similarity = similarity * torch.ones(Nq, Nk, dtype=similarity.dtype, device=similarity.device).tril()
    kept = torch.ones(key.shape[0], Nk, dtype=similarity.dtype, device=similarity.device)
    if key_padding_mask is not None:
        kept = (~key_padding_mask).to(similarity.dtype)
    similarity = similarity * kept[:, None, None, :]
    numerator = similarity @ value
    denominator = similarity.sum(dim=-1, keepdim=True)
    if initial_state is not None:
        S0, z0 = initial_state
        numerator = numerator + elu_feature_map(query) @ S0
        denominator = denominator + (elu_feature_map(query) * z0[:, :, None, :]).sum(dim=-1, keepdim=True)
    out = numerator / (denominator + eps)
    if not output_final_state:
        return out
    kept_keys = elu_feature_map(key) * kept[:, None, :, None]  # (B, H, Nk, D)
    S = torch.einsum("bhjd,bhje->bhde", kept_keys, value)
    z = kept_keys.sum(dim=-2)
    if initial_state is not None:
        S, z = S + S0, z + z0
    return out, (S, z)
