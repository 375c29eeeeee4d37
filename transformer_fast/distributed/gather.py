"""The all-gather mode (key/value gathered once, as Llama 3 trains long contexts) and Ulysses
(all-to-all from sequence shards to head shards); attention.py says when each pays."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _backends, _build
from .plan import _chunk_seed, _count, _kernels, _offset_kw, _slopes, _stats_dtype
from .sequence import chunk_count, global_order


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


class AllGatherAttention(torch.autograd.Function):
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
                part = _build.extension().sinks_gradient(delta, lse[:, :, rows], sink_arg, False)
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


def ulysses(q, k, v, group, layout, is_causal, scale, window, softcap, alibi_slopes, sinks, dropout_p, seed,
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
    with _backends.named(_backends.explicit_backend("auto", q.device, q.dtype, "attention")):
        out, lse = torch.ops.transformer_fast.attention_forward(qh, kh, vh, None, None, is_causal, scale, dropout_p,
                                                                _chunk_seed(seed, rank), **extras)
    lse_seq = _heads_to_seq(lse.detach().unsqueeze(-1), group, layout).squeeze(-1) if return_lse else None
    return _HeadsToSeq.apply(out, group, layout), lse_seq
