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

Windows and ALiBi need each block's query positions: the kernel ops' ``query_offset`` where the
ops have it. Without it, the all-gather mode still serves them under a causal mask (the keys end
at the query chunk's end, where the bottom-right alignment puts every query at its global
position) and Ulysses serves them always; the ring refuses them.

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
and pass); ``_bytes_sent_per_rank`` gives the same numbers from the shapes.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from .. import _backends, _named_backend
from .._device_kernels import op_kernel
from .sequence import LAYOUTS, check_divisible, check_layout, chunk_count, global_order, packed_rows, rank_chunks

MODES = ("ring", "all_gather", "ulysses")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ROW_TILE = 256  # query rows per tile of the ring's torch backward, at most
_TILE_ELEMENTS = 1 << 22  # and at most this many scores per tile (16 MiB in float32)

_COUNTERS: dict = {}


def communication_counters():
    """{(mode, pass, what): [messages, bytes]} sent by this process since the last reset."""
    return {key: list(value) for key, value in _COUNTERS.items()}


def reset_communication_counters():
    _COUNTERS.clear()


def _count(key, tensor_bytes):
    entry = _COUNTERS.setdefault(key, [0, 0])
    entry[0] += 1
    entry[1] += tensor_bytes


def _bytes_sent_per_rank(mode, B, H, Hk, seq_len, D, Dv, world_size, dtype=torch.float32, backward=False,
                         layout="head_tail"):
    """Bytes one rank sends for one call (forward; with ``backward``, the backward's too), as
    ``communication_counters`` counts them (the metadata check excluded)."""
    w = world_size
    n = seq_len // w
    item = torch.empty((), dtype=dtype).element_size()
    grad_item = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    kv = B * Hk * n * (D + Dv)
    if w == 1:
        return 0
    if mode == "ring":
        sent = (w - 1) * kv * item
        if backward:
            sent += (w - 1) * kv * item + w * kv * grad_item
    elif mode == "all_gather":
        sent = (w - 1) * kv * item  # the shard, to every peer
        if backward:  # gathered again, and the dK/dV pieces of the others' rows sent to their owners
            sent += (w - 1) * kv * item + (w - 1) * kv * grad_item
    elif mode == "ulysses":
        per = lambda heads, width: B * heads * n * width * (w - 1) // w  # noqa: E731
        sent = (per(H, D) + per(Hk, D) + per(Hk, Dv) + per(H, Dv)) * item
        if backward:
            sent *= 2
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return sent


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def _group(group):
    return dist.group.WORLD if group is None else group


def _peer(group, rank):
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _agree(group, fields, seed=0):
    """All-gathers ``fields`` ({name: int}) and ``seed``; raises ValueError on every rank where
    the ranks disagree. Returns rank 0's seed."""
    w = dist.get_world_size(group)
    names = list(fields)
    mine = torch.tensor([int(fields[k]) for k in names] + [int(seed)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(w)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone)
    for i, name in enumerate(names):
        column = table[:, i]
        if (column != column[0]).any():
            values = ", ".join(f"rank {r}: {_show(name, int(v))}" for r, v in enumerate(column))
            raise ValueError(f"context-parallel attention: the ranks disagree on {name} ({values}); every rank must "
                             f"call with the same {name}")
    return int(table[0, -1])


def _show(name, value):
    if name == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else str(value)
    if name == "mode":
        return MODES[value]
    if name == "layout":
        return LAYOUTS[value]
    return str(value)


def _check_local(query, key, value, enable_gqa, scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                 packed=False):
    dims = 3 if packed else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dims:
            shape = "(tokens, heads, dim)" if packed else "(B, H, N_local, D)"
            raise ValueError(f"{name} must be {dims}-D {shape}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    H, Hk = query.shape[1], key.shape[1]
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(f"key and value must agree in every dim but the last, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if not packed and query.shape[0] != key.shape[0]:
        raise ValueError(f"query and key must have one batch size, got {query.shape[0]} and {key.shape[0]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have one head dim, got {query.shape[-1]} and {key.shape[-1]}")
    if Hk == 0 or H % Hk or (H != Hk and not enable_gqa):
        raise ValueError(f"key/value heads ({Hk}) must equal the query heads ({H}), or divide them with "
                         f"enable_gqa=True")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    window = (-1, -1) if window_size is None else _explicit_window(window_size)
    if softcap is not None and (not isinstance(softcap, numbers.Real) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape not in ((H,), (query.shape[0], H)) \
                or not alibi_slopes.is_floating_point():
            raise ValueError(f"alibi_slopes must be a float tensor of shape ({H},) or (B, {H}), got "
                             f"{getattr(alibi_slopes, 'shape', alibi_slopes)}")
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes that require grad are not supported (no kernel computes their gradient)")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (H,)
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float tensor of shape ({H},), got {getattr(sinks, 'shape', sinks)}")
    return float(scale), window, (0.0 if softcap is None else float(softcap)), float(dropout_p)


def _explicit_window(window_size):
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= -1 for x in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right) >= -1 (-1: unbounded), got "
                         f"{window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _stats_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _kernels(t):
    """The kernel ops' forward and backward for t's device and dtype (float64: plain torch's)."""
    backend = _backends.explicit_backend("auto", t.device, t.dtype, "attention")
    if backend is None:
        return torch.ops.transformer_fast.attention_forward, torch.ops.transformer_fast.attention_backward
    return op_kernel("attention_forward", backend, t.device.type), op_kernel("attention_backward", backend,
                                                                              t.device.type)


def has_query_offset():
    """Whether the kernel ops take ``query_offset`` (the block's queries' position shift)."""
    schema = torch.ops.transformer_fast.attention_forward.default._schema
    return any(a.name == "query_offset" for a in schema.arguments)


def _offset_kw(offset):
    return {"query_offset": int(offset)} if offset else {}


def _slopes(alibi_slopes, B, H, dtype):
    """ALiBi slopes as the kernels take them: a (B, H) view in the stats dtype."""
    if alibi_slopes is None:
        return None
    s = alibi_slopes.detach().to(dtype)
    return s.expand(B, H) if s.dim() == 1 else s


def _chunk_seed(seed, index):
    """A one-element int64 CPU seed for chunk ``index`` (None without dropout)."""
    if seed is None:
        return None
    return torch.tensor([(seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % 2**62], dtype=torch.int64)


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
    positional = alibi_slopes is not None or window != (-1, -1)
    if mode == "ulysses":
        if H % w or Hk % w:
            raise ValueError(f"ulysses mode shards heads: the query heads ({H}) and key/value heads ({Hk}) must be "
                             f"multiples of the group size ({w})")
        out, lse = _ulysses(query, key, value, group, layout, is_causal, scale, window, softcap_value, alibi_slopes,
                            sinks, dropout_p, seed, return_lse)
    else:
        if positional and not has_query_offset() and not (mode == "all_gather" and is_causal):
            raise NotImplementedError(f"{mode} mode needs the kernel ops' query_offset for window_size/alibi_slopes"
                                      + (" without a causal mask" if mode == "all_gather" else "")
                                      + "; use mode='ulysses'" + (" or is_causal=True" if mode == "all_gather" else ""))
        plan = _Plan(group, w, rank, layout, n, is_causal, scale, window, softcap_value,
                     _slopes(alibi_slopes, B, H, _stats_dtype(query)), dropout_p, seed)
        if mode == "ring":
            if dropout_p > 0:
                raise NotImplementedError("ring mode does not support dropout_p > 0 (its backward cannot regenerate "
                                          "the kernels' dropout mask); use mode='all_gather' or 'ulysses'")
            out, lse = _RingAttention.apply(query, key, value, sinks, plan)
        else:
            out, lse = _AllGatherAttention.apply(query, key, value, sinks, plan)
    return (out, lse) if return_lse else out


class _Plan:
    """What a call's blocks need to know: the group, the layout and the attention's arguments."""

    def __init__(self, group, w, rank, layout, n, is_causal, scale, window, softcap, slopes, dropout_p, seed):
        self.group, self.w, self.rank, self.layout, self.n = group, w, rank, layout, n
        self.is_causal, self.scale, self.window, self.softcap, self.slopes = is_causal, scale, window, softcap, slopes
        self.dropout_p, self.seed = dropout_p, seed
        self.chunks = chunk_count(w, layout)
        self.c = n * w // self.chunks  # chunk length
        self.seq_len = n * w
        self.positional = slopes is not None or window != (-1, -1)

    def local_chunks(self, rank):
        """(row offset in the shard, global start) of each of rank's chunks."""
        return [(i * self.c, k * self.c) for i, k in enumerate(rank_chunks(rank, self.w, self.layout))]

    def pair_kind(self, q0, k0, nq, nk):
        """'skip', 'full' or 'causal' for global query rows [q0, q0+nq) against keys [k0, k0+nk)."""
        left, right = self.window
        if left >= 0 and k0 + nk - 1 < q0 - left:
            return "skip"
        if self.is_causal:
            if k0 > q0 + nq - 1:
                return "skip"
            return "full" if k0 + nk - 1 <= q0 else "causal"
        if right >= 0 and k0 > q0 + nq - 1 + right:
            return "skip"
        return "full"


# --------------------------------------------------------------------------------------------
# Log-sum-exp merging
# --------------------------------------------------------------------------------------------
def _as_mass(lse):
    """The kernels' lse with empty rows (+inf) as -inf (no probability mass)."""
    return torch.where(lse == math.inf, -math.inf, lse)


def _merge(acc_out, acc_lse, out, lse, rows):
    """Merges a block's (out, lse) for local rows ``rows`` (a slice) into the float accumulators."""
    a_out, a_lse = acc_out[:, :, rows], acc_lse[:, :, rows]
    lse = _as_mass(lse.to(a_lse.dtype))
    new = torch.logaddexp(a_lse, lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    a_out.mul_(torch.exp(a_lse - safe).unsqueeze(-1)).add_(out.to(a_out.dtype) * torch.exp(lse - safe).unsqueeze(-1))
    a_lse.copy_(new)


def _finish(acc_out, acc_lse, sinks, dtype):
    """The merged rows with the sinks joined once; empty rows' lse +inf (the kernels' convention)."""
    if sinks is not None:
        final = torch.logaddexp(acc_lse, sinks.detach().to(acc_lse.dtype)[None, :, None])
        acc_out.mul_(torch.exp(acc_lse - final).unsqueeze(-1))
        acc_lse = final
    else:
        acc_lse = torch.where(acc_lse == -math.inf, math.inf, acc_lse)
    return acc_out.to(dtype), acc_lse


# --------------------------------------------------------------------------------------------
# Ring
# --------------------------------------------------------------------------------------------
def _step_calls(plan, src):
    """The kernel calls of one ring step with the key/value block of rank ``src``: tuples
    (query rows of the shard, key rows of the block, query global start, key global start, kind).
    Where no position matters (no window, no ALiBi), pairs merge into fewer, larger calls."""
    qs, ks, c = plan.local_chunks(plan.rank), plan.local_chunks(src), plan.c
    pairs = [(qr, kr, qg, kg, plan.pair_kind(qg, kg, c, c)) for qr, qg in qs for kr, kg in ks]
    pairs = [p for p in pairs if p[4] != "skip"]
    if plan.positional or not pairs:
        return [(slice(qr, qr + c), slice(kr, kr + c), qg, kg, kind) for qr, kr, qg, kg, kind in pairs]
    if src == plan.rank and plan.is_causal:  # own block: one causal call (chunks in increasing order)
        return [(slice(0, plan.n), slice(0, plan.n), None, None, "causal")]
    if any(kind != "full" for *_, kind in pairs):
        return [(slice(qr, qr + c), slice(kr, kr + c), qg, kg, kind) for qr, kr, qg, kg, kind in pairs]
    calls = []  # per query chunk, its key chunks (adjacent in the block); query chunks with equal sets merge
    for qr, _ in qs:
        krows = sorted(kr for q, kr, *_ in pairs if q == qr)
        if not krows:
            continue
        span = slice(krows[0], krows[-1] + c) if krows == list(range(krows[0], krows[-1] + c, c)) else None
        if span is None:
            calls += [(slice(qr, qr + c), slice(kr, kr + c), None, None, "full") for kr in krows]
        elif calls and calls[-1][1] == span and calls[-1][0].stop == qr:
            calls[-1] = (slice(calls[-1][0].start, qr + c), span, None, None, "full")
        else:
            calls.append((slice(qr, qr + c), span, None, None, "full"))
    return calls


def _block_forward(plan, forward, q, k, v, call):
    rows, keys, qg, kg, kind = call
    qb, kb, vb = q[:, :, rows], k[:, :, keys], v[:, :, keys]
    offset = (qg - kg) - (kb.shape[2] - qb.shape[2]) if plan.positional else 0
    return forward(qb, kb, vb, None, None, kind == "causal", plan.scale, 0.0, None, window=plan.window,
                   softcap=plan.softcap, alibi_slopes=plan.slopes, **_offset_kw(offset))


def _ring_exchange(plan, sends, recvs, tag, key):
    """Sends ``sends`` to the next rank while receiving ``recvs`` from the previous one (one
    message per tensor, tags from ``tag``); counted as one block."""
    nxt, prv = _peer(plan.group, (plan.rank + 1) % plan.w), _peer(plan.group, (plan.rank - 1) % plan.w)
    ops = []
    for i, (send, recv) in enumerate(zip(sends, recvs)):
        ops += [dist.P2POp(dist.isend, send, nxt, plan.group, tag + i),
                dist.P2POp(dist.irecv, recv, prv, plan.group, tag + i)]
    _count(key, sum(t.numel() * t.element_size() for t in sends))
    return dist.batch_isend_irecv(ops)


def _wait(works):
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan):
        forward, _ = _kernels(q)
        stats = _stats_dtype(q)
        B, H, n, _ = q.shape
        acc_out = acc_lse = None
        kv = (k.contiguous(), v.contiguous())  # the block computed on; the next one arrives meanwhile
        for step in range(plan.w):
            works = []
            if step < plan.w - 1:
                incoming = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in kv)
                works = _ring_exchange(plan, kv, incoming, 0, ("ring", "forward", "key/value"))
            src = (plan.rank - step) % plan.w
            for call in _step_calls(plan, src):
                out, lse = _block_forward(plan, forward, q, *kv, call)
                if acc_out is None and call[0] == slice(0, n):  # the first partial of every row: kept as is
                    acc_out, acc_lse = out.to(stats), _as_mass(lse.to(stats))
                    continue
                if acc_out is None:
                    acc_out = q.new_zeros(B, H, n, v.shape[-1], dtype=stats)
                    acc_lse = q.new_full((B, H, n), -math.inf, dtype=stats)
                _merge(acc_out, acc_lse, out, lse, call[0])
            if works:
                _wait(works)
                kv = incoming
        if acc_out is None:  # no key for any row (an empty shard)
            acc_out = q.new_zeros(B, H, n, v.shape[-1], dtype=stats)
            acc_lse = q.new_full((B, H, n), -math.inf, dtype=stats)
        out, lse = _finish(acc_out, acc_lse, sinks, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan = ctx.plan
        stats = lse.dtype
        D = k.shape[-1]
        delta = (dout.to(stats) * out.to(stats)).sum(-1)  # dO . O: the merged rows' delta
        dq = torch.zeros(q.shape, dtype=stats, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        B, Hk, n, _ = k.shape
        grads_in = None  # (the dK/dV arriving from the previous rank, the exchange's works, the buffer sent)
        for step in range(plan.w):
            works = []
            if step < plan.w - 1:
                incoming = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in kv)
                works = _ring_exchange(plan, kv, incoming, 0, ("ring", "backward", "key/value"))
            src = (plan.rank - step) % plan.w
            dkv = torch.zeros(B, Hk, n, D + v.shape[-1], dtype=stats, device=k.device)
            for call in _step_calls(plan, src):
                _block_backward(plan, q, *kv, dout, lse, delta, call, dq, dkv, D)
            if grads_in is not None:
                _wait(grads_in[1])
                dkv += grads_in[0]
            received = torch.empty_like(dkv)
            grads_in = (received, _ring_exchange(plan, (dkv,), (received,), 2, ("ring", "backward", "dK/dV")), dkv)
            if works:
                _wait(works)
                kv = incoming
        _wait(grads_in[1])  # the last exchange brings this rank's own block's dK/dV home (each work waited once:
        dkv = grads_in[0]   # gloo's send work hangs on a second wait)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = _named_backend.sinks_gradient(delta, lse, sinks.to(stats), False).to(sinks.dtype)
        return dq.to(q.dtype), dkv[..., :D].to(k.dtype), dkv[..., D:].to(v.dtype), dsinks, None


def _block_backward(plan, q, k, v, dout, lse, delta, call, dq, dkv, D):
    """dQ, dK, dV of one block pair from the merged lse and delta, in torch ops by row tiles."""
    rows, keys, qg, kg, kind = call
    stats = lse.dtype
    kb, vb = k[:, :, keys].to(stats), v[:, :, keys].to(stats)
    B, H = q.shape[:2]
    Hk, nk = kb.shape[1], kb.shape[2]
    group = H // Hk
    if group > 1:
        kb = kb.repeat_interleave(group, dim=1)
        vb = vb.repeat_interleave(group, dim=1)
    dk = torch.zeros_like(kb)
    dv = torch.zeros_like(vb)
    q_rows = range(rows.start, rows.stop)
    tile = max(16, min(_ROW_TILE, _TILE_ELEMENTS // max(1, B * H * nk)))
    kpos = None if kg is None else torch.arange(kg, kg + nk, device=q.device)
    left, right = plan.window
    for t0 in range(0, len(q_rows), tile):
        r0, r1 = rows.start + t0, min(rows.stop, rows.start + t0 + tile)
        qt = q[:, :, r0:r1].to(stats)
        dot = dout[:, :, r0:r1].to(stats)
        s = torch.matmul(qt, kb.transpose(-1, -2)) * plan.scale
        if plan.softcap:
            tanh = torch.tanh(s / plan.softcap)
            s = tanh * plan.softcap
        allowed = None
        if kpos is None:  # merged calls: positions are relative, only the causal mask matters
            if kind == "causal":
                i = torch.arange(r0 - rows.start, r1 - rows.start, device=q.device)
                allowed = torch.arange(nk, device=q.device)[None, :] <= i[:, None]
        else:
            qpos = torch.arange(qg + r0 - rows.start, qg + r1 - rows.start, device=q.device)[:, None]
            allowed = torch.ones(r1 - r0, nk, dtype=torch.bool, device=q.device)
            if kind == "causal":
                allowed &= kpos[None, :] <= qpos
            if left >= 0:
                allowed &= kpos[None, :] >= qpos - left
            if right >= 0:
                allowed &= kpos[None, :] <= qpos + right
            if plan.slopes is not None:
                s = s - plan.slopes[:, :, None, None].to(stats) * (qpos - kpos[None, :]).abs().to(stats)
        p = torch.exp(s - lse[:, :, r0:r1, None])
        if allowed is not None:
            p = p.masked_fill(~allowed, 0.0)
        dp = torch.matmul(dot, vb.transpose(-1, -2))
        ds = p * (dp - delta[:, :, r0:r1, None])
        if plan.softcap:
            ds = ds * (1 - tanh * tanh)
        ds = ds * plan.scale
        dq[:, :, r0:r1] += torch.matmul(ds, kb)
        dk += torch.matmul(ds.transpose(-1, -2), qt)
        dv += torch.matmul(p.transpose(-1, -2), dot)
    if group > 1:
        dk = dk.view(B, Hk, group, nk, -1).sum(2)
        dv = dv.view(B, Hk, group, nk, -1).sum(2)
    dkv[:, :, keys, :D] += dk
    dkv[:, :, keys, D:] += dv


# --------------------------------------------------------------------------------------------
# All-gather
# --------------------------------------------------------------------------------------------
def _gather_sequence(plan, x, key):
    """The whole sequence (dim 2) from every rank's shard, in global order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(plan.w)]
    _count(key, x.numel() * x.element_size() * (plan.w - 1))
    dist.all_gather(parts, x, group=plan.group)
    order = global_order(plan.w, plan.layout, plan.c, x.device)
    whole = torch.empty(x.shape[0], x.shape[1], plan.seq_len, x.shape[3], dtype=x.dtype, device=x.device)
    whole[:, :, order] = torch.cat(parts, dim=2)
    return whole


def _scatter_sum(plan, whole, key):
    """Each rank's shard of the sum over ranks of ``whole`` (B, Hk, N, W): a reduce-scatter, as
    an all-to-all of the owners' pieces."""
    order = global_order(plan.w, plan.layout, plan.c, whole.device)
    pieces = whole[:, :, order].movedim(2, 0).contiguous()  # (N, B, Hk, W) in rank order
    received = torch.empty_like(pieces)
    _count(key, pieces.numel() * pieces.element_size() * (plan.w - 1) // plan.w)
    dist.all_to_all_single(received, pieces, group=plan.group)
    return received.view(plan.w, plan.n, *pieces.shape[1:]).sum(0).movedim(0, 2)


def _gather_calls(plan):
    """Per local query chunk: (query rows, key range [k0, k1), window, query_offset, chunk index)."""
    calls = []
    left, right = plan.window
    for index, (qr, qg) in enumerate(plan.local_chunks(plan.rank)):
        end = qg + plan.c
        k0 = max(0, qg - left) if left >= 0 else 0
        if plan.is_causal:  # keys end at the chunk's end: bottom-right alignment gives global positions
            k1, window = end, (left, 0 if right < 0 else min(right, 0))
        else:
            k1, window = (plan.seq_len if right < 0 else min(plan.seq_len, end + right)), (left, right)
        k0 = min(k0, k1)
        offset = end - k1 if plan.positional else 0
        calls.append((slice(qr, qr + plan.c), k0, k1, window, offset, qg // plan.c))
    return calls


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan):
        forward, _ = _kernels(q)
        D = k.shape[-1]
        kv = _gather_sequence(plan, torch.cat([k, v], dim=-1), ("all_gather", "forward", "key/value"))
        outs, lses = [], []
        sink_arg = None if sinks is None else sinks.detach().to(_stats_dtype(q))
        for rows, k0, k1, window, offset, index in _gather_calls(plan):
            out, lse = forward(q[:, :, rows], kv[:, :, k0:k1, :D], kv[:, :, k0:k1, D:], None, None, False,
                               plan.scale, plan.dropout_p, _chunk_seed(plan.seed, index), window=window,
                               softcap=plan.softcap, alibi_slopes=plan.slopes, sinks=sink_arg, **_offset_kw(offset))
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan = ctx.plan
        _, backward = _kernels(q)
        D = k.shape[-1]
        stats = lse.dtype
        kv = _gather_sequence(plan, torch.cat([k, v], dim=-1), ("all_gather", "backward", "key/value"))
        dkv = torch.zeros(kv.shape, dtype=stats, device=kv.device)
        dq = torch.empty_like(q)
        want_dsinks = sinks is not None and ctx.needs_input_grad[3]
        sink_arg = None if sinks is None else sinks.detach().to(stats)
        dsinks = None
        dout = dout.contiguous()
        for rows, k0, k1, window, offset, index in _gather_calls(plan):
            dq_c, dk_c, dv_c, _, delta = backward(
                dout[:, :, rows], q[:, :, rows], kv[:, :, k0:k1, :D], kv[:, :, k0:k1, D:], out[:, :, rows],
                lse[:, :, rows], None, None, False, plan.scale, plan.dropout_p, _chunk_seed(plan.seed, index), False,
                window=window, softcap=plan.softcap, alibi_slopes=plan.slopes, compute_delta=want_dsinks,
                sinks=sink_arg, **_offset_kw(offset))
            dq[:, :, rows] = dq_c
            dkv[:, :, k0:k1, :D] += dk_c
            dkv[:, :, k0:k1, D:] += dv_c
            if want_dsinks:
                part = _named_backend.sinks_gradient(delta, lse[:, :, rows], sink_arg, False)
                dsinks = part if dsinks is None else dsinks + part
        mine = _scatter_sum(plan, dkv, ("all_gather", "backward", "dK/dV"))
        return (dq, mine[..., :D].to(k.dtype), mine[..., D:].to(v.dtype),
                None if dsinks is None else dsinks.to(sinks.dtype), None)


# --------------------------------------------------------------------------------------------
# Ulysses
# --------------------------------------------------------------------------------------------
def _seq_to_heads(x, group, layout):
    """(B, H, n, W) sequence shards -> (B, H / w, N, W) head shards in global sequence order."""
    w = dist.get_world_size(group)
    B, H, n, W = x.shape
    pieces = x.reshape(B, w, H // w, n, W).movedim(1, 0).contiguous()
    received = torch.empty_like(pieces)
    _count(("ulysses", "all-to-all", "sequence to heads"), pieces.numel() * pieces.element_size() * (w - 1) // w)
    dist.all_to_all_single(received, pieces, group=group)
    by_rank = received.movedim(0, 2).reshape(B, H // w, w * n, W)
    order = global_order(w, layout, n * w // chunk_count(w, layout), x.device)
    whole = torch.empty_like(by_rank)
    whole[:, :, order] = by_rank
    return whole


def _heads_to_seq(x, group, layout):
    """The inverse of ``_seq_to_heads``."""
    w = dist.get_world_size(group)
    B, Hs, N, W = x.shape
    n = N // w
    order = global_order(w, layout, N // chunk_count(w, layout), x.device)
    pieces = x[:, :, order].reshape(B, Hs, w, n, W).movedim(2, 0).contiguous()
    received = torch.empty_like(pieces)
    _count(("ulysses", "all-to-all", "heads to sequence"), pieces.numel() * pieces.element_size() * (w - 1) // w)
    dist.all_to_all_single(received, pieces, group=group)
    return received.movedim(0, 1).reshape(B, Hs * w, n, W)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout):
        ctx.args = (group, layout)
        return _seq_to_heads(x, group, layout)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), *ctx.args), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout):
        ctx.args = (group, layout)
        return _heads_to_seq(x, group, layout)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), *ctx.args), None, None


def _ulysses(q, k, v, group, layout, is_causal, scale, window, softcap, alibi_slopes, sinks, dropout_p, seed,
             return_lse):
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    H = q.shape[1]
    heads = slice(rank * H // w, (rank + 1) * H // w)
    qh, kh, vh = (_SeqToHeads.apply(t, group, layout) for t in (q, k, v))
    extras = {"window": window, "softcap": softcap}
    stats = _stats_dtype(q)
    if alibi_slopes is not None:
        extras["alibi_slopes"] = _slopes(alibi_slopes, q.shape[0], H, stats)[:, heads]
    if sinks is not None:
        extras["sinks"] = sinks[heads] if sinks.dtype == stats else sinks.to(stats)[heads]
    backend = _backends.select_backend(q.device, q.dtype, "auto", "attention")
    out, lse = _named_backend.attention(backend, qh, kh, vh, None, None, is_causal, scale, dropout_p,
                                       _chunk_seed(seed, rank), extras)
    lse_seq = _heads_to_seq(lse.detach().unsqueeze(-1), group, layout).squeeze(-1) if return_lse else None
    return _HeadsToSeq.apply(out, group, layout), lse_seq


# --------------------------------------------------------------------------------------------
# Packed sequences (all-gather)
# --------------------------------------------------------------------------------------------
def context_parallel_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, group=None, *,
                                 is_causal=False, scale=None, enable_gqa=False, window_size=None, softcap=None,
                                 alibi_slopes=None, sinks=None, dropout_p=0.0, return_lse=False):
    """Attention over a packed batch whose documents are split over the ranks.

    ``query`` (Tq_local, H, D), ``key``/``value`` (Tk_local, Hk, D/Dv): this rank's rows as
    ``shard_packed(x, cu_seqlens, group)`` makes them (every document split into 2w pieces,
    head-tail per document); ``cu_seq_q``/``cu_seq_k`` (B + 1,) int32 and ``max_q``/``max_k``:
    the whole batch's, the same on every rank. ``is_causal``: query i of a document attends its
    keys j <= i + Lk - Lq (bottom-right, as FlashAttention's varlen). Keys are all-gathered;
    each local piece is one sequence of one kernel call, with its document's keys up to the
    piece's end (causal) or all of them, so a causal window and ALiBi align per piece. Without a
    causal mask a window or ALiBi would need a per-piece query offset: refused. Returns the local
    output (Tq_local, H, Dv); with ``return_lse`` also the lse (H, Tq_local).
    """
    scale, window, softcap_value, dropout_p = _check_local(query, key, value, enable_gqa, scale, window_size, softcap,
                                                           alibi_slopes, sinks, dropout_p, packed=True)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) \
                or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor of B + 1 offsets, got "
                             f"{getattr(cu, 'shape', cu)} {getattr(cu, 'dtype', '')}")
    if cu_seq_q.numel() != cu_seq_k.numel():
        raise ValueError(f"cu_seq_q and cu_seq_k must have one length (B + 1), got {cu_seq_q.numel()} and "
                         f"{cu_seq_k.numel()}")
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise ValueError(f"alibi_slopes must be (H,) for packed sequences, got {tuple(alibi_slopes.shape)}")
    if (alibi_slopes is not None or window != (-1, -1)) and not is_causal:
        raise NotImplementedError("context_parallel_varlen_attn: window_size and alibi_slopes need is_causal=True "
                                  "(without a causal mask each piece would need its own query offset)")
    group = _group(group)
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    cq, ck = cu_seq_q.cpu().long(), cu_seq_k.cpu().long()
    if (cq.diff() < 0).any() or (ck.diff() < 0).any() or cq[0] != 0 or ck[0] != 0:
        raise ValueError("cu_seq_q and cu_seq_k must be nondecreasing from 0")
    H, D = query.shape[1], query.shape[2]
    Hk, Dv = key.shape[1], value.shape[2]
    q_index, _, q_pieces = packed_rows(cq, rank, w)
    k_index, _, _ = packed_rows(ck, rank, w)

    def checksum(cu):
        return int((cu * torch.arange(1, cu.numel() + 1)).sum() % (2**61 - 1))
    fields = {"query heads H": H, "key/value heads Hk": Hk, "head dim D": D, "value head dim Dv": Dv,
              "dtype": _DTYPES.index(query.dtype), "cu_seq_q length": cq.numel(), "cu_seq_k length": ck.numel(),
              "cu_seq_q checksum": checksum(cq), "cu_seq_k checksum": checksum(ck), "max_q": int(max_q),
              "max_k": int(max_k), "is_causal": is_causal, "dropout": dropout_p > 0, "sinks": sinks is not None,
              "alibi_slopes": alibi_slopes is not None, "window left": window[0], "window right": window[1]}
    local_seed = torch.randint(2**62, (), dtype=torch.int64).item() if dropout_p > 0 else 0
    seed = _agree(group, fields, local_seed)
    if query.shape[0] != q_index.numel() or key.shape[0] != k_index.numel():
        raise ValueError(f"this rank's shard has {query.shape[0]} query and {key.shape[0]} key rows; shard_packed "
                         f"gives it {q_index.numel()} and {k_index.numel()} for these cu_seqlens")
    # The call: each local piece a sequence, with its document's keys up to the piece's end.
    left, right = window
    call_rows, call_cu_k, max_piece, max_keys = [], [0], 0, 0
    for d, p0, p1 in q_pieces:
        Lq, Lk = int(cq[d + 1] - cq[d]), int(ck[d + 1] - ck[d])
        if is_causal:
            k1 = min(max(p1 + Lk - Lq, 0), Lk)
            k0 = min(max(p0 + Lk - Lq - left, 0), k1) if left >= 0 else 0
        else:
            k0, k1 = 0, Lk
        if p1 == p0:
            k0 = k1 = 0
        call_rows.append(torch.arange(int(ck[d]) + k0, int(ck[d]) + k1))
        call_cu_k.append(call_cu_k[-1] + k1 - k0)
        max_piece, max_keys = max(max_piece, p1 - p0), max(max_keys, k1 - k0)
    lengths = [p1 - p0 for _, p0, p1 in q_pieces]
    call_cu_q = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()),
                             dtype=torch.int32, device=query.device)
    call_cu_k = torch.tensor(call_cu_k, dtype=torch.int32, device=query.device)
    key_rows = (torch.cat(call_rows) if call_rows else torch.zeros(0, dtype=torch.int64)).to(query.device)
    call_window = (left, 0 if right < 0 else min(right, 0)) if is_causal else window
    plan = _PackedPlan(group, w, rank, ck, k_index, key_rows, call_cu_q, call_cu_k, max(max_piece, 1),
                       max(max_keys, 1), scale, call_window, softcap_value,
                       None if alibi_slopes is None else _slopes(alibi_slopes, len(q_pieces), H, _stats_dtype(query)),
                       dropout_p, _chunk_seed(seed, rank) if dropout_p > 0 else None)
    out, lse = _PackedAttention.apply(query, key, value, sinks, plan)
    return (out, lse) if return_lse else out


class _PackedPlan:
    def __init__(self, group, w, rank, ck, k_index, key_rows, cu_q, cu_k, max_q, max_k, scale, window, softcap,
                 slopes, dropout_p, seed):
        self.group, self.w, self.rank, self.ck, self.k_index, self.key_rows = group, w, rank, ck, k_index, key_rows
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k
        self.scale, self.window, self.softcap, self.slopes = scale, window, softcap, slopes
        self.dropout_p, self.seed = dropout_p, seed
        self.indices = [packed_rows(ck, r, w)[0] for r in range(w)]  # every rank's key rows

    def args(self):
        return dict(window=self.window, softcap=self.softcap, alibi_slopes=self.slopes, cu_seq_q=self.cu_q,
                    cu_seq_k=self.cu_k, max_q=self.max_q, max_k=self.max_k)


def _gather_packed(plan, x, key):
    """The whole packed key/value (Tk, Hk, W) from every rank's rows (padded to one length)."""
    longest = max(i.numel() for i in plan.indices)
    padded = x.new_zeros(longest, *x.shape[1:])
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(plan.w)]
    _count(key, padded.numel() * padded.element_size() * (plan.w - 1))
    dist.all_gather(parts, padded, group=plan.group)
    whole = x.new_empty(int(plan.ck[-1]), *x.shape[1:])
    for index, part in zip(plan.indices, parts):
        whole[index.to(x.device)] = part[:index.numel()]
    return whole


def _scatter_packed(plan, whole, key):
    """Each rank's rows of the sum over ranks of ``whole`` (Tk, Hk, W)."""
    send = torch.cat([whole[index.to(whole.device)] for index in plan.indices])
    mine = plan.indices[plan.rank].numel()
    received = whole.new_empty(plan.w * mine, *whole.shape[1:])
    row_bytes = whole[0:1].numel() * whole.element_size()
    _count(key, sum(i.numel() for p, i in enumerate(plan.indices) if p != plan.rank) * row_bytes)
    dist.all_to_all_single(received, send, output_split_sizes=[mine] * plan.w,
                           input_split_sizes=[i.numel() for i in plan.indices], group=plan.group)
    return received.view(plan.w, mine, *whole.shape[1:]).sum(0)


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan):
        forward, _ = _kernels(q)
        D = k.shape[-1]
        kv = _gather_packed(plan, torch.cat([k, v], dim=-1), ("varlen", "forward", "key/value"))[plan.key_rows]
        sink_arg = None if sinks is None else sinks.detach().to(_stats_dtype(q))
        out, lse = forward(q, kv[..., :D], kv[..., D:], None, None, False, plan.scale, plan.dropout_p, plan.seed,
                           sinks=sink_arg, **plan.args())
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan = ctx.plan
        _, backward = _kernels(q)
        D = k.shape[-1]
        stats = lse.dtype
        kv = _gather_packed(plan, torch.cat([k, v], dim=-1), ("varlen", "backward", "key/value"))[plan.key_rows]
        want_dsinks = sinks is not None and ctx.needs_input_grad[3]
        sink_arg = None if sinks is None else sinks.detach().to(stats)
        dq, dk, dv, _, delta = backward(dout.contiguous(), q, kv[..., :D], kv[..., D:], out, lse, None, None, False,
                                        plan.scale, plan.dropout_p, plan.seed, False, compute_delta=want_dsinks,
                                        sinks=sink_arg, **plan.args())
        whole = torch.zeros(int(plan.ck[-1]), k.shape[1], D + v.shape[-1], dtype=stats, device=k.device)
        whole.index_add_(0, plan.key_rows, torch.cat([dk, dv], dim=-1).to(stats))
        mine = _scatter_packed(plan, whole, ("varlen", "backward", "dK/dV"))
        dsinks = _named_backend.sinks_gradient(delta, lse, sink_arg, True).to(sinks.dtype) if want_dsinks else None
        return dq, mine[..., :D].to(k.dtype), mine[..., D:].to(v.dtype), dsinks, None
