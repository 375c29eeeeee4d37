"""Context-parallel softmax attention: each rank holds a shard of the sequence (``sequence.py``),
and together the ranks compute exactly what one device computes for the whole sequence.

Three modes, all over ``torch.distributed`` (gloo on CPU, NCCL on CUDA; no device branch):

* ``"ring"``: key/value blocks travel around the ring (``batch_isend_irecv``), the next block's
  transfer started before this block's compute; each block's partial (out, lse) from the kernel
  op is merged by log-sum-exp in float32 (float64 for float64), the sinks added once at the end.
  With the head-tail layout and a causal mask every step computes the same number of
  (query, key) pairs on every rank: step 0 the local causal block, then either both query
  chunks against the received head chunk or the tail query chunk against both received chunks.
  The backward passes key/value around again; each rank adds its dK/dV to an accumulator that
  travels with the block and reaches the block's owner after w sends. It is written in torch
  ops (row tiles of the block pair, P from the merged lse, delta = dO . O): the C++ backward
  kernel takes a row's delta from its own tile when the row's keys fit one tile (the rounding
  of O kept out of dS), which is exact for a whole row and wrong for a block of it.
* ``"all_gather"``: key/value all-gathered once (as Llama 3), then one kernel call per local
  query chunk against the keys up to the chunk's end (causal) or all keys; each call sees its
  rows' whole key set, so the kernel ops' forward and backward run as on one device. The
  backward reduce-scatters dK/dV (an all-to-all of the per-owner pieces, which gloo also has).
* ``"ulysses"``: all-to-all from sequence shards to head shards (H and Hk divisible by w), one
  single-device call with every feature (window, ALiBi, sinks, dropout: the heads' slopes and
  sinks go with them), all-to-all back.

Windows and ALiBi need each block's query positions: the kernel ops' ``query_offset`` gives a
block of queries its global position relative to the block of keys.

Sinks join each row's softmax once (added to the merged lse, not per block). Their gradient on
each rank is its own rows' part, summed over the group by the same gradient reduction as every
other replicated parameter (so the ranks' sum is the one-device gradient).

Dropout: the kernels draw a key's keep bit from (seed, the row's lse index in the call, j). A
block's rows have other lse indices than in the whole-sequence call, so context-parallel dropout
draws a different mask with the same distribution, regenerated exactly by the backward (each
call keeps its seed; seeds are derived from rank 0's draw and the chunk, so no two chunks or
head groups share a mask). The ring refuses dropout (its backward is not the kernel's); the
all-gather mode and Ulysses serve it.

Every call first all-gathers one small metadata tensor (bounded by the group's timeout) and
checks that every rank has the same B, H, Hk, D, Dv, dtype, shard lengths, mode and flags
(varlen: the same cu_seqlens): a mismatch raises ValueError on every rank, naming the field and
the ranks' values, instead of a hang or a wrong answer in a later collective.

Communication per rank is counted in ``communication_counters()`` (messages and bytes by mode
and pass); ``plan.bytes_sent_per_rank`` gives the same numbers from the shapes.

The modes live in ``ring.py``, ``gather.py`` (all-gather and Ulysses) and ``varlen.py`` (packed
batches); ``plan.py`` holds what they share.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .gather import AllGatherAttention, ulysses
from .plan import (_DTYPES, MODES, Plan, _agree, _check_local, _group, _slopes, _stats_dtype,  # noqa: F401
                   communication_counters, reset_communication_counters)
from .ring import RingAttention
from .sequence import LAYOUTS, check_divisible, check_layout


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------
def context_parallel_attention(query, key, value, group=None, *, mode="ring", layout="head_tail", is_causal=False,
                               scale=None, enable_gqa=False, window_size=None, softcap=None, alibi_slopes=None,
                               sinks=None, dropout_p=0.0, attn_mask=None, key_padding_mask=None, return_lse=False):
    """Softmax attention over the whole sequence from this rank's shards.

    ``query`` (B, H, N_local, D), ``key``/``value`` (B, Hk, N_local, D/Dv): this rank's shard as
    ``shard_sequence(x, group, dim=2, layout=layout)`` makes it, on every rank of ``group``.
    The arguments mean what they mean for ``transformer_fast.scaled_dot_product_attention`` on
    the whole sequence (positions are global: causal, window and ALiBi as there). Returns this
    rank's shard of the output (B, H, N_local, Dv), differentiable; with ``return_lse`` also
    its rows' log-sum-exp (B, H, N_local) in float32 (float64 for float64). ``mode``: "ring",
    "all_gather" or "ulysses" (module docstring). attn_mask and key_padding_mask are not
    supported (a mask of the whole sequence would have to be sharded by key blocks).
    """
    if attn_mask is not None or key_padding_mask is not None:
        raise NotImplementedError("context_parallel_attention: attn_mask and key_padding_mask are not supported; "
                                  "express the mask as is_causal/window_size, or pack the sequences "
                                  "(context_parallel_varlen_attn)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_layout(layout)
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        raise TypeError(f"is_causal and enable_gqa must be bools, got {is_causal!r} and {enable_gqa!r}")
    scale, window, softcap_value, dropout_p = _check_local(query, key, value, enable_gqa, scale, window_size, softcap,
                                                           alibi_slopes, sinks, dropout_p)
    group = _group(group)
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, n, D = query.shape
    Hk, Dv = key.shape[1], value.shape[-1]
    fields = {"batch size B": B, "query heads H": H, "key/value heads Hk": Hk, "head dim D": D,
              "value head dim Dv": Dv, "dtype": _DTYPES.index(query.dtype), "query shard length": n,
              "key/value shard length": key.shape[2], "mode": MODES.index(mode), "layout": LAYOUTS.index(layout),
              "is_causal": is_causal, "dropout": dropout_p > 0, "sinks": sinks is not None,
              "alibi_slopes": alibi_slopes is not None, "window left": window[0], "window right": window[1]}
    local_seed = torch.randint(2**62, (), dtype=torch.int64).item() if dropout_p > 0 else 0
    seed = _agree(group, fields, local_seed)
    seed = seed if dropout_p > 0 else None
    if key.shape[2] != n:
        raise ValueError(f"context_parallel_attention: query and key/value shards must have one length, got {n} and "
                         f"{key.shape[2]}")
    check_divisible(n * w, w, layout)
    if mode == "ulysses":
        if H % w or Hk % w:
            raise ValueError(f"ulysses mode shards heads: the query heads ({H}) and key/value heads ({Hk}) must be "
                             f"multiples of the group size ({w})")
        out, lse = ulysses(query, key, value, group, layout, is_causal, scale, window, softcap_value, alibi_slopes,
                            sinks, dropout_p, seed, return_lse)
    else:
        plan = Plan(group, w, rank, layout, n, is_causal, scale, window, softcap_value,
                     _slopes(alibi_slopes, B, H, _stats_dtype(query)), dropout_p, seed)
        if mode == "ring":
            if dropout_p > 0:
                raise NotImplementedError("ring mode does not support dropout_p > 0 (its backward cannot regenerate "
                                          "the kernels' dropout mask); use mode='all_gather' or 'ulysses'")
            out, lse = RingAttention.apply(query, key, value, sinks, plan)
        else:
            out, lse = AllGatherAttention.apply(query, key, value, sinks, plan)
    return (out, lse) if return_lse else out
