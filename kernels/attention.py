"""Softmax attention in Triton: the launchers `attention_forward` and `attention_backward`, with the
kernel-level contract of transformer_fast/attention.py (dense and packed layouts, paged caches,
windows, soft-capping, ALiBi, sinks, dropout, num_splits).

The kernels, by role:
  * kernels/attention_common.py   - the jit helpers they share (loads, the score function, tile ranges)
  * kernels/attention_forward.py  - the forward (FlashAttention-2, optionally writing split partials)
  * kernels/attention_backward.py - the backward (delta, dK/dV, dQ and dS)
  * kernels/attention_decode.py   - Flash-Decoding's merge of the splits and the host's choices
  * kernels/attention_tiles.py    - tile tables, autotune configs and keys

Masking: scores of disallowed (causal, window, padded, attn_mask False or -inf, out of range)
pairs are set to -inf before the row max, and every exponent is taken against a finite base, so P
is exactly 0 there; padded and out-of-range key/value rows are loaded as zeros, so whatever they
hold (NaN, inf) never reaches a result. Key tiles outside every row's causal or window band of a
block, and those before the first or after the last unpadded key, are skipped: each forward and
dQ program finds that key range itself (scanning its sequence's padding row within the band), so
the launchers pass the masks as they are and run no torch op for them.

Packed layouts: a program reads its sequence's offsets (cu_seq_q, cu_seq_k), key count (seqused_k)
and pages (block_table) itself, clamped into the tensors, so index values the host never reads
(reading them would wait for the GPU) cannot send a load or store outside them. Host work per call
is the outputs, the split scratch and the launches.

fp32 inputs use input_precision="ieee" for tl.dot (exact fp32 products; a GPU's default tf32
would miss the tests' 2x-reference-error policy); fp16/bf16 use tensor cores with fp32
accumulation.
"""

import functools
import os
import types

import torch

from ._grid_math import cdiv
from ._launch import CompiledLaunch, LaunchPlan, Plans, TunedLaunch, seed_class
from ._new_tensors import (contiguous, new_output, new_output_in_rows_of, new_scratch, new_scratch_in_rows_of,
                           row_strides, strides_in_rows_of)
from ._triton_options import LAUNCH_OPTIONS
from .attention_backward import (attention_bwd_dkdv_kernel, attention_bwd_dq_convert_kernel,  # noqa: F401
                                 attention_bwd_dq_kernel, attention_bwd_preprocess_kernel)
from .attention_common import LOG2E
from .attention_decode import attention_combine_kernel, combine_launch_shape, pack_gqa, plan_splits
from .attention_forward import attention_fwd_kernel  # noqa: F401
from .attention_tiles import block_dims, length_bucket

# The query offset's range (as every backend's, csrc/ops/attention_extras.h): with the window sides
# that _window leaves bounded, the kernels' position arithmetic stays within int32.
_MAX_QUERY_OFFSET = 1 << 30
# CUDA's limit on a grid's third dimension (the batch, or the sequences of a pack + 1).
_MAX_GRID_Z = 65535


def _check_batch(batch):
    if batch > _MAX_GRID_Z:
        raise ValueError(f"the Triton attention kernels take at most {_MAX_GRID_Z} batch entries (or "
                         f"{_MAX_GRID_Z - 1} packed sequences) per call, got {batch}")


def _mask_kind(attn_mask):
    """MASK_KIND: 0 none, 1 bool (read as bytes), 2 float."""
    if attn_mask is None:
        return 0
    return 1 if attn_mask.dtype == torch.bool else 2


def _mask_bytes(attn_mask, q):
    """The mask as the kernels read it (a bool mask as bytes); q stands in for none (never read)."""
    if attn_mask is None:
        return q
    return attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask


def _mask_strides(attn_mask):
    return (0, 0, 0, 0) if attn_mask is None else attn_mask.stride()


def _dmask_dtype(attn_mask, q):
    """dS is written in the float mask's dtype: the query's, or float32."""
    return torch.float32 if attn_mask is not None and attn_mask.dtype == torch.float32 else q.dtype


def _padding_bytes(key_padding_mask, q):
    """The padding mask as bytes; q stands in for none (never read). The kernels find each
    sequence's unpadded key range themselves."""
    return q if key_padding_mask is None else key_padding_mask.view(torch.uint8)


def _padding_strides(key_padding_mask):
    return (0, 0) if key_padding_mask is None else key_padding_mask.stride()


def _alibi_strides(alibi_slopes):
    """The (B, H) float32 slopes' strides; (0, 0) for none."""
    return (0, 0) if alibi_slopes is None else alibi_slopes.stride()


_NO_WINDOW = (-1, -1)


def _check_query_offset(fn, query_offset):
    if not -_MAX_QUERY_OFFSET <= query_offset <= _MAX_QUERY_OFFSET:
        raise ValueError(f"{fn}: query_offset must be in [-2^30, 2^30], got {query_offset}")


def _window(window, rows, keys, query_offset):
    """(left, right) with -1 for an unbounded side. A side that reaches past every key of every row
    is unbounded (one kernel fewer; rows, keys: the longest sequences' lengths): query i of a
    sequence sits at key position i + n_k - n_q + query_offset, so the left side reaches key 0 from
    every row where left >= keys - 1 + query_offset, the right side the last key where right >=
    rows - 1 - query_offset. The sides left bounded are then below keys + |query_offset| and rows +
    |query_offset|, so the kernels' position sums stay within int32."""
    if window == _NO_WINDOW:
        return _NO_WINDOW
    left, right = (int(w) for w in window)
    if left >= keys - 1 + query_offset:
        left = -1
    if right >= rows - 1 - query_offset:
        right = -1
    return (-1 if left < 0 else left), (-1 if right < 0 else right)


def _scales(scale, softcap):
    """(qk_scale, softcap2) of the kernels: q.k * qk_scale is the score in base 2, or with
    soft-capping the tanh argument, then times softcap2 = softcap * log2(e)."""
    if softcap:
        return float(scale) / float(softcap), float(softcap) * LOG2E
    return float(scale) * LOG2E, 0.0


# The launches (kernels/_launch.py): the autotuned ones launch each tuned choice, once made, without
# the autotuner; all launch the compiled kernel directly once Triton has made it for a call's pattern.
launch_fwd, launch_dkdv, launch_dq = (TunedLaunch(k) for k in (attention_fwd_kernel, attention_bwd_dkdv_kernel,
                                                               attention_bwd_dq_kernel))
launch_combine, launch_preprocess, launch_dq_convert = (CompiledLaunch(k) for k in (
    attention_combine_kernel, attention_bwd_preprocess_kernel, attention_bwd_dq_convert_kernel))


def forget_tuned_choices():
    """Drops every tuned tile choice (after changing TRANSFORMER_FAST_TILE)."""
    for launch in (launch_fwd, launch_dkdv, launch_dq):
        launch.forget()


def _dtype(t):
    return None if t is None else t.dtype


@functools.lru_cache(maxsize=1024)
def _meta(D, Dv, fp32, is_causal, mask_kind, has_pad, has_dropout, window_left, window_right, has_softcap, has_alibi,
          layout):
    """The constexprs every kernel takes (one dict per combination: launchers only read it)."""
    if max(D, Dv) > 256:  # the public API checks this; the tile tables stop at 256
        raise ValueError(f"the Triton attention kernels take head dims up to 256, got query {D}, value {Dv}")
    block_d, block_dv = block_dims(D, Dv)
    return dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=is_causal, MASK_KIND=mask_kind,
                HAS_PAD=has_pad, HAS_DROPOUT=has_dropout, DOT_PRECISION="ieee" if fp32 else "tf32",
                WINDOW_LEFT=window_left, WINDOW_RIGHT=window_right, HAS_SOFTCAP=has_softcap, HAS_ALIBI=has_alibi,
                LAYOUT=layout)


def _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p, window=_NO_WINDOW, softcap=0.0,
                 alibi_slopes=None, layout=0):
    """The constexprs every kernel takes. `window`: as returned by _window."""
    return _meta(q.shape[-1], v.shape[-1], q.dtype == torch.float32, bool(is_causal), _mask_kind(attn_mask),
                 key_padding_mask is not None, dropout_p > 0.0, window[0] >= 0, window[1] >= 0, bool(softcap),
                 alibi_slopes is not None, layout)


def _window_keys(window, rows, keys):
    """About how many keys a query row may see: all, or the window's width."""
    left, right = window
    if left < 0:
        return keys
    return min(keys, left + 1 + rows + max(right, 0))


def _copies(*tensors):
    """Which of the tensors the kernels would misread: they read the sinks and the index tensors
    (cu_seq_q, cu_seq_k, seqused_k, block_table's rows) at unit stride. None where all are readable;
    the others are copied (a few elements per sequence), as dout or lse in the backward."""
    copies = tuple(t is not None and t.shape[-1] > 1 and t.stride(-1) != 1 for t in tensors)
    return copies if any(copies) else None


def _copied(copies, *tensors):
    return tuple(contiguous(t) if copy else t for t, copy in zip(tensors, copies))


def _forward_plan(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window, softcap,
                  alibi_slopes, sinks, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k, num_splits,
                  query_offset):
    """attention_forward's launches for one call signature (kernels/_launch.py), from the call's
    arguments (the seed's value is the launch's, not the plan's): the outputs' shapes and the
    forward's (and the split combine's) LaunchPlan."""
    query_offset = int(query_offset)
    _check_query_offset("attention_forward", query_offset)
    copies = _copies(sinks, cu_seq_q, cu_seq_k, seqused_k, block_table)
    packed = cu_seq_q is not None
    if packed:
        layout = 2 if block_table is not None else 1
        Tq, H, D = q.shape
        Dv = v.shape[-1]
        B = cu_seq_q.shape[0] - 1
        q_strides = (0, q.stride(1), q.stride(0))
        if layout == 2:
            num_pages, page_size, Hk = k.shape[0], k.shape[1], k.shape[2]
            k_strides = (k.stride(0), k.stride(2), k.stride(1))  # page, head, row in page
            v_strides = (v.stride(0), v.stride(2), v.stride(1))
            n_k = block_table.shape[1] * page_size if num_pages > 0 else 0  # keys a table row can hold
            page_size = max(page_size, 1)
        else:
            num_pages, page_size, Hk = 0, 1, k.shape[1]
            k_strides = (0, k.stride(1), k.stride(0))
            v_strides = (0, v.stride(1), v.stride(0))
            n_k = k.shape[0]
        # No sequence holds more than the pack's rows (a paged table row: its pages): max_q and
        # max_k beyond that would only grow the grid and overflow its int32 sizes.
        n_q, rows, keys = Tq, min(int(max_q), Tq), min(int(max_k), n_k)
        out_shape, lse_shape = (Tq, H, Dv), (H, Tq)
        out_strides, lse_strides = (0, 1, H), (0, Tq)  # out's in rows of Dv elements
        n_lse, drop_stride = H * Tq, keys
    else:
        layout = 0
        B, H, n_q, D = q.shape
        Hk, n_k, Dv = k.shape[1], k.shape[2], v.shape[3]
        num_pages, page_size = 0, 1
        q_strides, k_strides, v_strides = q.stride()[:3], k.stride()[:3], v.stride()[:3]
        rows, keys = n_q, n_k
        out_shape, out_strides = None, strides_in_rows_of(q)[1]  # out's strides in rows of Dv elements
        lse_shape, lse_strides = (B, H, n_q), (H * n_q, n_q)
        n_lse, drop_stride = B * H * n_q, n_k
    window = _window(window, rows, keys, query_offset)
    group = H // Hk
    packs = pack_gqa(group, rows, dropout_p)
    heads = Hk if packs else H
    rows_per_program = rows * group if packs else rows
    splits = plan_splits(int(num_splits), B * heads * max(1, cdiv(rows_per_program, 64)),
                         _window_keys(window, rows, keys), q.device, dropout_p)
    _check_batch(B + (1 if packed else 0))
    qk_scale, softcap2 = _scales(scale, softcap)
    meta = _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p, window, softcap, alibi_slopes,
                        layout)
    grid = lambda META: (max(1, cdiv(rows_per_program, META["BLOCK_M"])) * splits, heads,  # noqa: E731
                         B + (1 if packed else 0))
    bucket = length_bucket(rows_per_program, keys)
    key = (q.dtype, _dtype(attn_mask), _dtype(alibi_slopes), _dtype(sinks), bucket, seqused_k is not None,
           splits > 1, packs, *meta.values())
    before_seed = (*q_strides, *k_strides, *v_strides, *out_strides, *lse_strides, *_mask_strides(attn_mask),
                   *_padding_strides(key_padding_mask), *_alibi_strides(alibi_slopes),
                   0 if block_table is None else block_table.shape[1] if copies and copies[4] else block_table.stride(0),
                   H, group, n_q, n_k, B, page_size, num_pages, window[0], window[1], query_offset, splits, n_lse,
                   qk_scale, softcap2, float(dropout_p))
    forward = LaunchPlan(grid, (*before_seed, 0, drop_stride, bucket),
                         dict(**meta, HAS_SINKS=sinks is not None, HAS_SEQUSED=seqused_k is not None,
                              SPLIT=splits > 1, PACK_GQA=packs, **LAUNCH_OPTIONS),
                         key=key, seed_at=len(before_seed))
    combine = None
    if splits > 1:
        block_r, warps = combine_launch_shape(meta["BLOCK_DV"])
        combine = LaunchPlan((cdiv(n_lse, block_r),), (n_lse, splits, H, n_q, *out_strides),
                             dict(HEAD_DV=Dv, BLOCK_DV=meta["BLOCK_DV"], BLOCK_R=block_r, HAS_SINKS=sinks is not None,
                                  num_warps=warps, **LAUNCH_OPTIONS))
    return types.SimpleNamespace(Dv=Dv, out_shape=out_shape, lse_shape=lse_shape, splits=splits, n_lse=n_lse,
                                 copies=copies, forward=forward, combine=combine)


_forward_plans = Plans(_forward_plan)


def attention_forward(c):
    """The attention_forward op on one call ``c`` (transformer_fast._attention_call.AttentionForwardCall:
    the op's arguments by name): (out, lse)."""
    seed = 0 if c.seed is None else int(c.seed)  # None, or the op's one-element int64 tensor
    plan = _forward_plans.get(c, seed_class(seed))
    q, k, v, attn_mask, key_padding_mask, alibi_slopes = c.q, c.k, c.v, c.attn_mask, c.key_padding_mask, c.alibi_slopes
    sinks, cu_seq_q, cu_seq_k, seqused_k, block_table = c.sinks, c.cu_seq_q, c.cu_seq_k, c.seqused_k, c.block_table
    if plan.copies is not None:
        sinks, cu_seq_q, cu_seq_k, seqused_k, block_table = _copied(plan.copies, sinks, cu_seq_q, cu_seq_k, seqused_k,
                                                                    block_table)
    if plan.out_shape is None:
        out = new_output_in_rows_of(q, plan.Dv)
    else:
        out = new_output(plan.out_shape, q.dtype, q.device)
    lse = new_output(plan.lse_shape, torch.float32, q.device)
    if plan.splits > 1:
        out_part = new_scratch((plan.splits, plan.n_lse, plan.Dv), torch.float32, q.device)
        lse_part = new_scratch((plan.splits, plan.n_lse), torch.float32, q.device)
    else:
        out_part, lse_part = out, lse
    sinks_or_q = q if sinks is None else sinks
    launch_fwd.run(plan.forward, (
        q, k, v, out, lse, _mask_bytes(attn_mask, q), _padding_bytes(key_padding_mask, q),
        q if alibi_slopes is None else alibi_slopes, sinks_or_q, q if cu_seq_q is None else cu_seq_q,
        q if cu_seq_k is None else cu_seq_k, q if seqused_k is None else seqused_k,
        q if block_table is None else block_table, out_part, lse_part), seed)
    if plan.combine is not None:
        launch_combine.run(plan.combine, (out_part, lse_part, out, lse, sinks_or_q))
    return out, lse


def backward_launch_args(dout, q, k, v, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                         window=(-1, -1), softcap=0.0, alibi_slopes=None, cu_seq_q=None, cu_seq_k=None, max_q=0,
                         max_k=0, query_offset=0):
    """What the dK/dV and dQ kernels share: the arguments after their tensors, as a dict of named
    pieces, and the constexprs (`seed` at scalars[seed_at]). See _backward_plan for their use."""
    query_offset = int(query_offset)
    _check_query_offset("attention_backward", query_offset)
    packed = cu_seq_q is not None
    if packed:
        Tq, H, D = q.shape
        Tk, Hk, _ = k.shape
        B = cu_seq_q.shape[0] - 1
        n_q, n_k, rows, keys = Tq, Tk, min(int(max_q), Tq), min(int(max_k), Tk)  # bounded as the forward's
        strides = ((0, q.stride(1), q.stride(0)), (0, k.stride(1), k.stride(0)), (0, v.stride(1), v.stride(0)),
                   (0, dout.stride(1), dout.stride(0)), (0, Tq))
    else:
        B, H, n_q, D = q.shape
        Hk, n_k = k.shape[1], k.shape[2]
        rows, keys = n_q, n_k
        strides = (q.stride()[:3], k.stride()[:3], v.stride()[:3], dout.stride()[:3], (H * n_q, n_q))
    window = _window(window, rows, keys, query_offset)
    qk_scale, softcap2 = _scales(scale, softcap)
    meta = _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p, window, softcap, alibi_slopes,
                        1 if packed else 0)
    bucket = length_bucket(rows, keys)
    before_seed = (H, H // Hk, n_q, n_k, B, window[0], window[1], query_offset, qk_scale, softcap2, float(scale),
                   float(dropout_p))
    return dict(packed=packed, B=B, H=H, Hk=Hk, n_q=n_q, n_k=n_k, rows=rows, keys=keys, bucket=bucket, strides=strides,
                mask_strides=(*_mask_strides(attn_mask), *_padding_strides(key_padding_mask),
                              *_alibi_strides(alibi_slopes)),
                scalars=(*before_seed, int(seed), keys if packed else n_k, bucket), seed_at=len(before_seed),
                meta=meta)


def _atomic_dq_requested():
    """TRANSFORMER_FAST_ATOMIC_DQ=1: the dK/dV kernel also accumulates dQ, atomically, and the dQ
    kernel is not launched (kernels/attention_backward.py); read when a call signature's plan is
    made. Off by default until it is measured faster on a GPU."""
    return os.environ.get("TRANSFORMER_FAST_ATOMIC_DQ", "").strip() == "1"


def _backward_plan(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                   compute_dmask, window, softcap, alibi_slopes, cu_seq_q, cu_seq_k, max_q, max_k, compute_delta, sinks,
                   query_offset):
    """attention_backward's launches for one call signature: which inputs need a contiguous copy,
    the outputs' shapes, and the LaunchPlans of the preprocess, dK/dV and dQ kernels, and of the
    dK/dV kernel accumulating dQ too (`dkdv_dq`: where requested and neither dS nor sum P dP is
    wanted, which only the dQ kernel writes)."""
    Dv = v.shape[-1]
    dout_copy = Dv > 1 and dout.stride(-1) != 1
    if dout_copy:
        dout = dout.contiguous()
    a = backward_launch_args(dout, q, k, v, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, 0,
                             window, softcap, alibi_slopes, cu_seq_q, cu_seq_k, max_q, max_k, query_offset)
    packed, B, H, Hk, n_q, n_k = a["packed"], a["B"], a["H"], a["Hk"], a["n_q"], a["n_k"]
    _check_batch(B + (1 if packed else 0))
    meta = a["meta"]
    q_s, k_s, v_s, do_s, lse_s = a["strides"]
    # the strides of out and the gradients count rows of their head dims
    if packed:
        out_copy, out_strides = True, (0, 1, H)
        delta_shape = (H, n_q)
        grad_strides = (0, 1, H), (0, 1, Hk), (0, 1, Hk)
    else:
        out_strides = row_strides(out)  # out as the forward laid it out, or a copy that is whole rows
        out_copy = out_strides is None
        if out_copy:
            out_strides = row_strides(out.contiguous())
        delta_shape = (B, H, n_q)
        grad_strides = tuple(strides_in_rows_of(t)[1] for t in (q, k, v))
    dq_s, dk_s, dv_s = grad_strides
    pre_block = 64 if meta["BLOCK_DV"] <= 128 else 32
    preprocess = LaunchPlan((cdiv(n_q, pre_block), H, 1 if packed else B), (*out_strides, *do_s, *lse_s, n_q),
                            dict(HEAD_DV=Dv, BLOCK_DV=meta["BLOCK_DV"], BLOCK_M=pre_block, **LAUNCH_OPTIONS))
    batch = B + (1 if packed else 0)
    key = (q.dtype, _dtype(attn_mask), _dtype(alibi_slopes), a["bucket"], *meta.values())
    seed_at = a["seed_at"]
    keys, rows = a["keys"], a["rows"]
    dkdv_scalars = (*q_s, *k_s, *v_s, *do_s, *lse_s, *dk_s, *dv_s, *dq_s, *a["mask_strides"])

    def dkdv_plan(atomic_dq):
        return LaunchPlan(lambda META: (max(1, cdiv(keys, META["BLOCK_N"])), Hk, batch),
                          (*dkdv_scalars, *a["scalars"]), dict(**meta, ATOMIC_DQ=atomic_dq, **LAUNCH_OPTIONS),
                          key=(*key, atomic_dq), seed_at=len(dkdv_scalars) + seed_at)
    atomic_dq = (_atomic_dq_requested() and not compute_dmask and not compute_delta
                 and not torch.are_deterministic_algorithms_enabled())
    dq_convert = (LaunchPlan((max(1, cdiv(q.numel(), 1024)),), (q.numel(),), dict(BLOCK=1024, **LAUNCH_OPTIONS))
                  if atomic_dq else None)
    dq_scalars = (*q_s, *k_s, *v_s, *do_s, *lse_s, *dq_s, *a["mask_strides"])
    dq = LaunchPlan(lambda META: (max(1, cdiv(rows, META["BLOCK_M"])), H, batch),
                    (*dq_scalars, *a["scalars"]),
                    dict(**meta, STORE_DS=compute_dmask, STORE_PDP=compute_delta, **LAUNCH_OPTIONS),
                    key=(*key, compute_dmask, compute_delta), seed_at=len(dq_scalars) + seed_at)
    return types.SimpleNamespace(packed=packed, dout_copy=dout_copy, lse_copy=not lse.is_contiguous(),
                                 out_copy=out_copy, index_copies=_copies(cu_seq_q, cu_seq_k), delta_shape=delta_shape,
                                 dmask_shape=(B, H, n_q, n_k) if compute_dmask else None,
                                 dmask_dtype=_dmask_dtype(attn_mask, q),
                                 preprocess=preprocess, dkdv=dkdv_plan(False), dq=dq,
                                 dkdv_dq=dkdv_plan(True) if atomic_dq else None, dq_convert=dq_convert)


_backward_plans = Plans(_backward_plan)


def attention_backward(c):
    """The attention_backward op on one call ``c`` (transformer_fast._attention_call.AttentionBackwardCall):
    (dq, dk, dv, dmask or None, delta or None). Its sinks are not read: P follows from lse, which
    includes them, and no row is rescaled here."""
    seed = 0 if c.seed is None else int(c.seed)  # None, or the op's one-element int64 tensor
    plan = _backward_plans.get(c, seed_class(seed))
    dout, q, k, v, out, lse = c.dout, c.q, c.k, c.v, c.out, c.lse
    attn_mask, key_padding_mask, alibi_slopes, cu_seq_q, cu_seq_k = (c.attn_mask, c.key_padding_mask, c.alibi_slopes,
                                                                     c.cu_seq_q, c.cu_seq_k)
    if plan.dout_copy:
        dout = contiguous(dout)
    if plan.lse_copy:
        lse = contiguous(lse)
    if plan.out_copy:
        out = contiguous(out)
    if plan.index_copies is not None:
        cu_seq_q, cu_seq_k = _copied(plan.index_copies, cu_seq_q, cu_seq_k)
    delta = new_scratch(plan.delta_shape, torch.float32, q.device)
    if plan.packed:
        dq, dk, dv = (new_output(t.shape, t.dtype, t.device) for t in (q, k, v))
    else:
        dq, dk, dv = (new_output_in_rows_of(t, t.shape[-1]) for t in (q, k, v))
    launch_preprocess.run(plan.preprocess, (out, dout, delta))

    # dS: zero-filled, as the dQ kernel skips key tiles outside the causal/window band or all padded
    dmask = None
    if plan.dmask_shape is not None:
        dmask = new_scratch(plan.dmask_shape, plan.dmask_dtype, q.device, zero=True)
    # sum_j P_ij dP_ij per row (packed rows after the last sequence get no program: zeros)
    pdp = None
    if c.compute_delta:
        pdp = new_scratch(plan.delta_shape, torch.float32, q.device, zero=True) if plan.packed else \
            new_output(plan.delta_shape, torch.float32, q.device)
    masks = (_mask_bytes(attn_mask, q), _padding_bytes(key_padding_mask, q),
             q if alibi_slopes is None else alibi_slopes, q if cu_seq_q is None else cu_seq_q,
             q if cu_seq_k is None else cu_seq_k)
    if plan.dkdv_dq is not None:
        # dQ summed in float32 in dq's layout (the plan's strides), then rounded once into dq
        dq_sum = (new_scratch(dq.shape, torch.float32, q.device, zero=True) if plan.packed else
                  new_scratch_in_rows_of(q, q.shape[-1], torch.float32, zero=True))
        launch_dkdv.run(plan.dkdv_dq, (q, k, v, dout, lse, delta, dk, dv, dq_sum, *masks), seed)
        launch_dq_convert.run(plan.dq_convert, (dq_sum, dq))
        return dq, dk, dv, dmask, pdp
    launch_dkdv.run(plan.dkdv, (q, k, v, dout, lse, delta, dk, dv, dq, *masks), seed)
    launch_dq.run(plan.dq, (q, k, v, dout, lse, delta, dq, dq if dmask is None else dmask,
                            delta if pdp is None else pdp, *masks), seed)
    return dq, dk, dv, dmask, pdp
