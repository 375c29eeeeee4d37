"""Context-parallel attention over packed batches (varlen): documents split over the ranks,
head-tail per document, keys all-gathered."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _build
from .plan import _DTYPES, _agree, _check_local, _chunk_seed, _count, _group, _kernels, _slopes, _stats_dtype
from .sequence import packed_rows


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
        dsinks = _build.extension().sinks_gradient(delta, lse, sink_arg, True).to(sinks.dtype) if want_dsinks else None
        return dq, mine[..., :D].to(k.dtype), mine[..., D:].to(v.dtype), dsinks, None
