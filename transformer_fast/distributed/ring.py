"""The ring mode: key/value blocks travel around the ring while each rank computes its rows
against the block it holds; partial results merge by log-sum-exp (attention.py says why and how)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import _build
from .plan import _count, _kernels, _offset_kw, _peer, _stats_dtype

_ROW_TILE = 256  # query rows per tile of the ring's torch backward, at most
_TILE_ELEMENTS = 1 << 22  # and at most this many scores per tile (16 MiB in float32)


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
def step_calls(plan, src):
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


class RingAttention(torch.autograd.Function):
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
            for call in step_calls(plan, src):
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
            for call in step_calls(plan, src):
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
            dsinks = _build.extension().sinks_gradient(delta, lse, sinks.to(stats), False).to(sinks.dtype)
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
