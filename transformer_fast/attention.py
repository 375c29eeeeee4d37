"""Softmax attention: the public ``scaled_dot_product_attention`` and ``varlen_attn``, and the fake
kernels of their ops.

The kernels (``kernels/attention*.py`` for Triton; ``csrc/cpu/attention_forward.cpp`` and
``attention_backward.cpp`` for C++; ``_plain_torch.py``) share one contract, that of the kernel ops
``transformer_fast::attention_forward`` and ``attention_backward`` (``csrc/ops/schemas.cpp``). Each
kernel takes one call of its op as one object, the arguments by name: ``AttentionForwardCall`` and
``AttentionBackwardCall`` (``_attention_call.py``; in C++, ``csrc/ops/attention_call.h``):

    attention_forward(call) -> (out, lse)
    attention_backward(call) -> (dq, dk, dv, dmask, delta)

Layouts. Dense (cu_seq_q None): q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv); out
(B, H, Nq, Dv) in q's dtype, laid out in q's row order as torch's attention lays out its output
(``_result_layout.py``: (B, Nq, H, Dv) memory where q keeps a row's heads together, else
contiguous; dq, dk, dv likewise follow q, k, v); lse (B, H, Nq) float32 (float64 for float64 inputs, as the
ALiBi slopes and sinks then are; only the plain-torch backend takes float64). Packed (cu_seq_q given): q
(Tq, H, D), k (Tk, Hk, D), v (Tk, Hk, Dv); cu_seq_q and cu_seq_k (B + 1,) int32, nondecreasing from
0: sequence b is query rows cu_seq_q[b]:cu_seq_q[b + 1] and key rows cu_seq_k[b]:cu_seq_k[b + 1];
seqused_k (B,) int32 keeps the first seqused_k[b] keys of each; with block_table (B, pages) int32,
k and v are (num_pages, page_size, Hk, D) pools, key j of sequence b is row j % page_size of page
block_table[b, j // page_size], cu_seq_k is None and seqused_k gives the lengths. max_q and max_k
are at least the longest query and key sequence (the GPU kernels size their grid by them). out is
(Tq, H, Dv) contiguous, lse (H, Tq) float32. attn_mask and key_padding_mask are None and is_causal
False in packed mode. Any strides with a unit last-dim stride; Hk divides H (GQA).

Per sequence with Nq queries and Nk keys (dense: every batch entry), query i sits at key position
pos_i = i + Nk - Nq + query_offset: aligned to the bottom right (FlashAttention-2), moved by
query_offset (packed: the same offset for every sequence). Query i attends key j iff
  j < Nk; the key is not padded (key_padding_mask (B, Nk) bool, True = padded); a bool attn_mask
  ((B, H, Nq, Nk) view, stride 0 on broadcast dims) is True there, a float one (q's dtype or
  float32) not -inf;
  is_causal (dense only): j <= i (top-left aligned, as torch; query_offset does not move it);
  window (left, right), -1 = unbounded: pos_i - left <= j <= pos_i + right (so (-1, 0) is
  bottom-right causal).
The score of an allowed pair is s = scale * q_i . k_j, then s = softcap * tanh(s / softcap) where
softcap > 0, then s -= slope[b, h] * |pos_i - j| with ALiBi (alibi_slopes a (B, H) float32 view),
then s += attn_mask where it is float. out_i = sum_j p_ij v_j with p_ij = exp(s_ij - lse_i)
and lse_i = log(sum_j exp(s_ij) + exp(sinks[h])), the sink term only with sinks ((H,) float32:
one logit per head that joins every row's softmax with no value). A row with no allowed key gives
out 0 and lse = sinks[h], or +inf without sinks (so exp(s - lse) is 0 there). A +inf sink takes
every row of its head: out 0, lse +inf and P_sink = 1 (taken as 1 where lse = sinks[h], not
exp(inf - inf)), so the head's gradients are 0, the sink's own included; -inf is no sink.

Dropout keeps p_ij with probability 1 - dropout_p, scaled by 1 / (1 - dropout_p), as a function of
(seed, the row's lse index, j) that the backward regenerates. seed is None without dropout, else a
one-element int64 CPU tensor (csrc/ops/op_utils.h, dropout_seed, says why). num_splits: 0 lets the kernel split a
row's keys over several programs or threads (decoding: few queries, many keys) and merge the parts
by their log-sum-exp; n >= 1 splits into at most n parts (1: never).

query_offset (in [-2^30, 2^30]; 0 for the public functions, which do not take it) serves context
parallelism, which computes attention block by block: a block of queries that starts at global
position qo against a block of keys that starts at global position ko is query_offset = qo - ko
with Nq = Nk, and global causal masking is window (-1, 0) (or (W, 0) for a sliding window). The
offset may be negative or beyond the block: rows whose band holds no key then have no allowed
key (out 0, lse the sink or +inf).

dmask is empty unless compute_dmask (dense only); then it is dS (B, H, Nq, Nk) contiguous in the
float mask's dtype (q's, or float32), the gradient of the final scores (so of an additive float
mask), with the forward's dropout: 0 for disallowed pairs, padded keys and rows with no allowed
key. The backward's P follow from lse, which includes the sinks; the forward's sinks given to the
backward tell the C++ kernel what its rows' P sum to (1 - exp(sinks[h] - lse_i)), where it corrects
the rounding of lse in rows whose keys fit one tile. The sinks' gradient,
-sum_i exp(sinks[h] - lse_i) * delta_i, is formed by the autograd formula (csrc/ops/attention_op.cpp)
from delta, which is empty unless compute_delta: then delta_i = sum_j p_ij dP_ij (dP = dO V^T, with
the forward's dropout) in lse's shape and dtype, summed from the kernels' unrounded P and dP. (Its
value in exact arithmetic is dO_i . O_i, the delta of FlashAttention's dS; with O in bf16/fp16 that
product carries O's rounding, and the sum over every row of a head adds it up.) seqused_k and
block_table are inference-only, as in torch's varlen_attn.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import _backends, _build, _transforms
from ._fast_path import direct, dynamo_compiling
from ._attention_call import AttentionBackwardCall, AttentionForwardCall
from ._plain_torch import dmask_dtype
from ._result_layout import empty_in_rows_of
from ._validation import (check_bools, check_float32_range, check_int64, check_optional_tensors, check_tensors,
                          real_scalar)

_C, _ = _build.load()

# None unless a context_parallel block is open in some thread; then transformer_fast.distributed.context,
# whose functions serve that thread's calls on sequence shards and answer NotImplemented to other threads.
_context_parallel = None


# --------------------------------------------------------------------------------------------
# Fake implementations (shapes only: torch.compile, FakeTensorMode, the meta device)
# --------------------------------------------------------------------------------------------
@torch.library.register_fake("transformer_fast::attention_forward")
def _(*args, **kwargs):
    c = AttentionForwardCall(*args, **kwargs)
    q = c.q
    stats = torch.promote_types(q.dtype, torch.float32)
    if c.cu_seq_q is not None:
        Tq, H, _ = q.shape
        return q.new_empty(Tq, H, c.v.shape[-1]), q.new_empty(H, Tq, dtype=stats)
    B, H, Nq, _ = q.shape
    return empty_in_rows_of(q, c.v.shape[-1]), q.new_empty(B, H, Nq, dtype=stats)


@torch.library.register_fake("transformer_fast::attention_backward")
def _(*args, **kwargs):
    c = AttentionBackwardCall(*args, **kwargs)
    q, k = c.q, c.k
    dmask = (q.new_empty(*q.shape[:3], k.shape[2], dtype=dmask_dtype(c.attn_mask, q)) if c.compute_dmask
             else q.new_empty(0))
    delta = c.lse.new_empty(c.lse.shape) if c.compute_delta else q.new_empty(0)
    return (empty_in_rows_of(q, q.shape[-1]), empty_in_rows_of(k, k.shape[-1]), empty_in_rows_of(c.v, c.v.shape[-1]),
            dmask, delta)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_scale(scale):
    return real_scalar("scale", scale)


def _dropout_p(p):
    """dropout_p as a float (its range is checked with the other arguments)."""
    if not isinstance(p, (numbers.Real, torch.Tensor)):
        raise TypeError(f"dropout_p must be a real scalar in [0, 1), got {type(p).__name__}")
    return real_scalar("dropout_p", p)


def _window(window_size, allow_none=True):
    """(left, right) as a tuple of two ints (-1 = unbounded), or None."""
    if window_size is None and allow_none:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for an unbounded side, got "
                        f"{window_size!r}")
    for w in window_size:
        check_int64("window_size entries", w, tuple(window_size))
    return int(window_size[0]), int(window_size[1])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, key_padding_mask=None, window_size=None,
                                 softcap=None, alibi_slopes=None, sinks=None, backend="auto"):
    """Fused softmax attention, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(query @ key^T * scale + bias) @ value`` for (B, H, N, D) tensors (or (H, N, D),
    treated as B = 1), where bias combines:
      * ``is_causal``: query i attends to keys j <= i (top-left aligned, as in PyTorch);
      * ``attn_mask``: bool (True = may attend) or float (added to the scores), any shape that
        broadcasts to (B, H, Nq, Nk); read in place, never expanded in memory;
      * ``key_padding_mask``: (B, Nk) bool, True = padded key (``nn.MultiheadAttention``'s
        convention), read per tile;
      * ``window_size=(left, right)``: query i attends keys i + Nk - Nq - left .. i + Nk - Nq +
        right (-1: unbounded; aligned to the bottom right when Nq != Nk, as FlashAttention-2):
        key tiles outside the window are never visited, so cost and memory are O(N * window);
      * ``softcap``: the scaled scores become ``softcap * tanh(scores / softcap)`` first (Gemma 2);
      * ``alibi_slopes``: (H,) or (B, H); adds ``-slope * |i + Nk - Nq - j|`` (BLOOM, MPT); fixed
        (slopes that require grad are refused: no kernel computes their gradient);
      * ``sinks``: (H,) learned logits, one per head, that join each row's softmax denominator
        without a value (gpt-oss's ``s_aux``); they get their gradient.
    Query rows with no allowed key give 0 (and 0 gradient). Under ``torch.autocast`` the floating
    inputs are cast to the autocast dtype first, as torch's SDPA is. ``enable_gqa=True`` lets key/value
    have fewer heads than query (a divisor). ``backend``: "auto", "triton", "cpp" or "reference".
    A float ``attn_mask`` that requires grad gets its gradient (as in PyTorch, dropout included):
    the backward kernels write the score gradient, (B, H, Nq, Nk) in the mask's dtype, which
    autograd sums over the mask's broadcast dims. With few queries against many keys (decoding
    from a cache) the kernels split the keys over threads or GPU programs (Flash-Decoding).
    Inside ``transformer_fast.distributed.context_parallel`` the inputs are sequence shards.
    """
    if _context_parallel is not None:  # a context_parallel block is open (in some thread)
        out = _context_parallel.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, window_size,
            softcap, alibi_slopes, sinks, backend)
        if out is not NotImplemented:
            return out
    if scale is not None and type(scale) is not float:
        scale = _check_scale(scale)
    if window_size is not None:
        window_size = _window(window_size)
    if softcap is not None and type(softcap) is not float:
        softcap = real_scalar("softcap", softcap)
    if type(dropout_p) is not float:
        dropout_p = _dropout_p(dropout_p)
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        check_bools(is_causal=is_causal, enable_gqa=enable_gqa)
    if alibi_slopes is not None and not dynamo_compiling():
        check_float32_range("alibi_slopes", alibi_slopes, query)
    if (backend == "auto" and not dynamo_compiling()
            and direct(3, query, key, value, attn_mask, key_padding_mask, alibi_slopes, sinks)):
        return _C.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                               enable_gqa, key_padding_mask, None, window_size, softcap,
                                               alibi_slopes, sinks)
    check_tensors(query=query, key=key, value=value)
    check_optional_tensors(attn_mask=attn_mask, key_padding_mask=key_padding_mask, alibi_slopes=alibi_slopes,
                           sinks=sinks)
    if _transforms.active():
        return _transforms.scaled_dot_product_attention(query, key, value, attn_mask, float(dropout_p), is_causal,
                                                        scale, enable_gqa, key_padding_mask, window_size, softcap,
                                                        alibi_slopes, sinks)
    with _backends.named(_backends.explicit_backend(backend, query.device, query.dtype, "attention")):
        return torch.ops.transformer_fast.scaled_dot_product_attention(
            query, key, value, attn_mask, float(dropout_p), is_causal, scale=scale, enable_gqa=enable_gqa,
            key_padding_mask=key_padding_mask, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=sinks)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``varlen_attn`` returns (torch's ``AuxRequest`` works too)."""
    lse: bool = False


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, backend="auto"):
    """Attention over packed variable-length sequences, with the arguments and meaning of
    ``torch.nn.attention.varlen.varlen_attn`` (which runs on CUDA only), on CPU and CUDA.

    ``query`` (Tq, H, D), ``key``/``value`` (Tk, Hk, D): the sequences' tokens one after another;
    ``cu_seq_q``/``cu_seq_k`` (B + 1,) int32 cumulative lengths (sequence b is rows
    ``cu_seq_q[b]:cu_seq_q[b + 1]``); ``max_q``/``max_k`` at least the longest lengths.
    ``window_size=(left, right)``: (-1, -1) full, (-1, 0) causal, (W, 0) causal with a window of W
    earlier keys, aligned to the bottom right when a sequence has fewer queries than keys.
    ``seqused_k`` (B,) int32: only the first ``seqused_k[b]`` keys of each sequence are used (a
    KV-cache slot longer than what is filled). ``block_table`` (B, pages) int32 with ``key``/``value``
    (num_pages, page_size, Hk, D): a paged cache, pages in any order (needs ``seqused_k``;
    ``cu_seq_k`` is then not read and may be None). Both are inference-only, as in torch.
    ``num_splits``: how many parts a sequence's keys may be split into for decoding (None: chosen
    automatically; 1: never). Unlike torch's, ``num_splits=1`` does not make a sequence's result
    bitwise independent of the other sequences in the pack: the C++ kernel tiles by the pack's
    longest query sequence, so the last bits may change with the pack (docs/attention.md).
    ``softcap``, ``alibi_slopes`` ((H,) or (B, H)), ``sinks`` ((H,)) and ``dropout_p`` as in
    ``scaled_dot_product_attention``. Returns (Tq, H, Dv), and with ``return_aux.lse`` also the
    log-sum-exp, (H, Tq) float32 (the layout torch's kernel returns). Inside
    ``transformer_fast.distributed.context_parallel`` the inputs are ``shard_packed``'s rows and
    the cumulative lengths and maxima the whole batch's.
    """
    if _context_parallel is not None:  # a context_parallel block is open (in some thread)
        out = _context_parallel.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale,
                                            window_size, enable_gqa, seqused_k, block_table, num_splits, softcap,
                                            alibi_slopes, sinks, dropout_p, backend)
        if out is not NotImplemented:
            return out
    if scale is not None and type(scale) is not float:
        scale = _check_scale(scale)
    window_size = _window(window_size, allow_none=False)
    if softcap is not None and type(softcap) is not float:
        softcap = real_scalar("softcap", softcap)
    for name, n in (("max_q", max_q), ("max_k", max_k)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        check_int64(name, n)
    if num_splits is not None:
        if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        check_int64("num_splits", num_splits)
    if type(enable_gqa) is not bool:
        check_bools(enable_gqa=enable_gqa)
    return_lse = False
    if return_aux is not None:
        if not hasattr(return_aux, "lse"):  # torch's AuxRequest, ours, or anything with an `lse` flag
            raise TypeError(f"return_aux must be an AuxRequest or None, got {type(return_aux).__name__}")
        return_lse = bool(return_aux.lse)
    if type(dropout_p) is not float:
        dropout_p = _dropout_p(dropout_p)
    if alibi_slopes is not None and not dynamo_compiling():
        check_float32_range("alibi_slopes", alibi_slopes, query)
    check_tensors(query=query, key=key, value=value, cu_seq_q=cu_seq_q)
    try:
        out, lse = _varlen_attn(query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k), return_lse, scale,
                                window_size, enable_gqa, seqused_k, block_table, num_splits, softcap, alibi_slopes,
                                sinks, dropout_p, backend)
    except (TypeError, RuntimeError):  # the op's own error for a non-tensor names no argument: ours does
        check_optional_tensors(cu_seq_k=cu_seq_k, seqused_k=seqused_k, block_table=block_table,
                               alibi_slopes=alibi_slopes, sinks=sinks)
        raise
    return (out, lse) if return_lse else out


def _varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_lse, scale, window_size, enable_gqa,
                 seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, dropout_p, backend):
    args = (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_lse, scale, list(window_size), enable_gqa,
            seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, float(dropout_p), None)
    if _transforms.active():
        return _transforms.varlen_attn(*args[:-1])
    if backend == "auto" and not dynamo_compiling() and direct(3, query, key, value):
        return _C.varlen_attn(*args)
    with _backends.named(_backends.explicit_backend(backend, query.device, query.dtype, "attention")):
        return torch.ops.transformer_fast.varlen_attn(*args)
