"""Context-parallel linear attention: ``linear_attention`` over a sequence sharded across a process group.

Causal linear attention is a recurrence over one state (S = sum phi(k)^T v, z = sum phi(k); see
``transformer_fast.linear_attention``), and a sum of states is associative, so the sequence needs
no ring: each rank

1. computes the state of each of its chunks from zero (the kernels' state-only call: no queries,
   O(N_local D Dv), one matrix product per head);
2. all-gathers those states (float32, B H D (Dv + 1) numbers per chunk; one collective), from
   which it forms the exclusive prefix of the states before each of its chunks (the caller's
   ``initial_state`` first) and the whole sequence's final state;
3. runs the one-device kernels on each chunk with its prefix as ``initial_state``.

The backward mirrors it: the kernels' backward gives each chunk's gradient with respect to its
prefix; one all-reduce sums, for every chunk, the prefix gradients of the chunks after it (and the
final state's gradient), which flows into that chunk's state computation and so into its keys
and values. Non-causal: the global state is one all-reduce of the ranks' states, which every
query reads. Nothing of size N_local x D x Dv is stored, and the only traffic is the states:
independent of the sequence length.

Layouts (``transformer_fast.distributed.sequence``): "contiguous" (rank r holds chunk r of w) and
"head_tail" (chunk r and 2w-1-r of 2w). Linear attention costs the same per token at every
position, so "head_tail" balances nothing here; it is served so that a model sharded for softmax
attention's ring can run linear attention layers on the same shards (two chunks, two prefixes).

Every rank must call with the same B, H, D, Dv, dtype, shard length, flags and layout; a rank
whose arguments are invalid, or that disagrees with another, makes every rank raise ValueError
(the bad rank raises its own error) after one small metadata all-gather, bounded by the group's
timeout, instead of leaving the others waiting in a collective. As with any collective, the
backward must run on every rank (each rank's loss may depend on its outputs in any way).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _build
from ..linear_attention import LinearAttentionState, _linear_attention, _state_pair
from .sequence import LAYOUTS, rank_chunks

_C, _ = _build.load()

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# The metadata every rank sends: one float64 each, compared across ranks.
_FIELDS = ("batch", "heads", "query length", "key length", "head dim", "value head dim", "dtype", "device type",
           "is_causal", "layout", "eps", "initial_state given", "output_final_state", "key_padding_mask given",
           "gradients needed")


def context_parallel_linear_attention(query, key, value, group=None, *, layout="contiguous", is_causal=True,
                                      eps=1e-6, initial_state=None, output_final_state=False, key_padding_mask=None):
    """``linear_attention`` of the whole sequence, given this rank's shard of it.

    ``query``, ``key``, ``value``: (B, H, N_local, D) / (B, H, N_local, Dv), this rank's rows of
    the sequence as ``shard_sequence(x, group, dim=2, layout=layout)`` lays them out; every rank
    holds as many. ``key_padding_mask``: None or this rank's (B, N_local) bool shard (True = padded).
    Returns this rank's rows of the output (B, H, N_local, Dv), and with ``output_final_state=True``
    also the whole sequence's final ``LinearAttentionState`` (the same on every rank).

    ``initial_state`` (S0, z0): the state before the sequence, as for ``linear_attention``; pass
    the same on every rank. Its gradient on every rank is the whole one (the sum over the ranks'
    outputs and final states), as one device computes it. Gradients flow to ``query``, ``key``,
    ``value`` and ``initial_state``; they are first-order only (the exchange of states is a
    ``torch.autograd.Function`` whose backward is not differentiable).

    ``group``: the process group (None: the default one). Non-causal attention does not depend on
    the order of the rows, so ``layout`` matters only when ``is_causal``.
    """
    group = _check_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem, meta = _check_local(query, key, value, layout, is_causal, eps, initial_state, output_final_state,
                                 key_padding_mask)
    _agree_on_arguments(meta, problem, group, query)
    S0, z0 = _state_pair("initial_state", initial_state)
    eps = float(eps)
    if is_causal:
        out, (S, z) = _causal(query, key, value, key_padding_mask, eps, S0, z0, output_final_state, group, world,
                              rank, layout)
    else:
        out, (S, z) = _non_causal(query, key, value, key_padding_mask, eps, S0, z0, group)
    return (out, LinearAttentionState(S, z)) if output_final_state else out


# ------------------------------------------------------------------------------------------------
# Checks: local first, then one all-gather so that every rank raises together
# ------------------------------------------------------------------------------------------------
def _check_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_linear_attention needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (the default group), got "
                        f"{type(group).__name__}")
    return group


def _check_local(query, key, value, layout, is_causal, eps, initial_state, output_final_state, key_padding_mask):
    """(the exception this rank's arguments raise or None, the metadata list to compare)."""
    meta = [-1.0] * len(_FIELDS)
    try:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
        for name, flag in (("is_causal", is_causal), ("output_final_state", output_final_state)):
            if type(flag) is not bool:
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
        S0, z0 = _state_pair("initial_state", initial_state)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not (query.dim() == key.dim() == value.dim() == 4):
            raise ValueError(f"query, key and value must be 4-D (B, H, N_local, D) shards, got "
                             f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D")
        # The one-device op's own checks (shapes, dtypes, devices, mask, state, eps), without running it
        _C.linear_attention_args(query, key, value, is_causal, key_padding_mask, float(eps), S0, z0)
        if is_causal and layout == "head_tail" and query.shape[2] % 2:
            raise ValueError(f"layout 'head_tail' holds two equal chunks per rank: the local length must be even, "
                             f"got {query.shape[2]}")
        if query.dtype not in _DTYPES:
            raise TypeError(f"query must have a floating dtype among {_DTYPES}, got {query.dtype}")
        B, H, Nq, D = query.shape
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, S0, z0))
        meta = [B, H, Nq, key.shape[2], D, value.shape[3], _DTYPES.index(query.dtype),
                ("cpu", "cuda").index(query.device.type) if query.device.type in ("cpu", "cuda") else 2,
                is_causal, LAYOUTS.index(layout), float(eps), S0 is not None, output_final_state,
                key_padding_mask is not None, needs_grad]
    except (TypeError, ValueError) as exc:
        return exc, meta
    return None, [float(m) for m in meta]


def _agree_on_arguments(meta, problem, group, query):
    """All-gathers every rank's metadata (and whether its arguments were valid); raises on every rank
    if any rank's were not, or if two ranks disagree."""
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([0.0 if problem is None else 1.0, *meta], dtype=torch.float64, device=device)
    table = _all_gather_rows(mine, group).cpu().tolist()
    if problem is not None:
        raise problem
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"context_parallel_linear_attention: the arguments of rank(s) {bad} of the group are "
                         f"invalid (those ranks raise the reason); no rank computed anything")
    for i, field in enumerate(_FIELDS, start=1):
        values = [row[i] for row in table]
        if any(v != values[0] for v in values):
            shown = [_shown(field, v) for v in values]
            raise ValueError(f"context_parallel_linear_attention: every rank must pass the same {field}, got "
                             f"{shown} on ranks 0..{len(values) - 1} (shards of one sequence, laid out alike)")


def _all_gather_rows(flat, group):
    """(world, flat.numel()): every rank's 1-D ``flat``, in rank order; one collective."""
    gathered = flat.new_empty(dist.get_world_size(group) * flat.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gather(gathered, flat.contiguous(), group=group)
    return gathered.view(-1, flat.numel())


def _shown(field, value):
    if field == "dtype":
        return str(_DTYPES[int(value)]).replace("torch.", "")
    if field == "layout":
        return LAYOUTS[int(value)]
    if field in ("is_causal", "initial_state given", "output_final_state", "key_padding_mask given",
                 "gradients needed"):
        return bool(value)
    return value if field == "eps" else int(value)


# ------------------------------------------------------------------------------------------------
# The states and their exchange
# ------------------------------------------------------------------------------------------------
def _chunk_state(query, key, value, key_padding_mask, eps):
    """The state (S, z) of the chunk's unpadded keys from zero: the kernels with no queries."""
    _, S, z = _linear_attention(query.narrow(2, 0, 0), key, value, False, key_padding_mask, eps, None, None, True,
                                "auto")
    return S, z


def _pack(S, z):
    return torch.cat([S.reshape(-1), z.reshape(-1)])


def _unpack(flat, B, H, D, Dv):
    n = B * H * D * Dv
    return flat[..., :n].unflatten(-1, (B, H, D, Dv)), flat[..., n:].unflatten(-1, (B, H, D))


class _PrefixStates(torch.autograd.Function):
    """(this rank's chunk states (c, size), the initial state (size,) or None) -> (the exclusive
    prefix before each of this rank's chunks (c, size), the final state (size,)).

    ``order[g]``: the row of the gathered (w * c, size) states holding global chunk g; ``mine``:
    the global indices of this rank's chunks. Forward: one all-gather. Backward: this rank's
    gradient contributions to every chunk's state and to the initial state, summed over the
    ranks by one all-reduce."""

    @staticmethod
    def forward(ctx, local, initial, group, order, mine, key, value):
        ordered = _all_gather_rows(local.reshape(-1), group).view(-1, local.shape[1])[order]
        inclusive = ordered.cumsum(0)
        before = torch.cat([torch.zeros_like(inclusive[:1]), inclusive[:-1]])
        prefixes, total = before[mine], inclusive[-1]
        if initial is not None:
            prefixes, total = prefixes + initial, total + initial
        ctx.group, ctx.mine, ctx.chunks, ctx.has_initial = group, mine, len(order), initial is not None
        return prefixes, total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_prefixes, d_total):
        n = ctx.chunks
        # Row g < n: what this rank's outputs owe chunk g's state; row n: the initial state.
        owed = d_total.expand(n + 1, -1).clone()
        for m, g in enumerate(ctx.mine):
            owed[:g] += d_prefixes[m]
            owed[n] += d_prefixes[m]
        dist.all_reduce(owed, group=ctx.group)
        return owed[ctx.mine], (owed[n] if ctx.has_initial else None), None, None, None, None, None


class _SumStates(torch.autograd.Function):
    """(this rank's state (size,), the initial state or None) -> the whole sequence's state; one
    all-reduce each way (every rank's output reads every rank's state)."""

    @staticmethod
    def forward(ctx, local, initial, group):
        total = local.clone()
        dist.all_reduce(total, group=group)
        ctx.group, ctx.has_initial = group, initial is not None
        return total if initial is None else total + initial

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_total):
        owed = d_total.clone()
        dist.all_reduce(owed, group=ctx.group)
        return owed, (owed if ctx.has_initial else None), None


def _causal(query, key, value, key_padding_mask, eps, S0, z0, output_final_state, group, world, rank, layout):
    B, H, N, D = query.shape
    Dv = value.shape[3]
    chunks = len(rank_chunks(rank, world, layout))
    length = N // chunks
    mine = list(rank_chunks(rank, world, layout))
    n_global = chunks * world
    # Row r * chunks + m of the gathered states is rank r's m-th chunk.
    where = {g: r * chunks + m for r in range(world) for m, g in enumerate(rank_chunks(r, world, layout))}
    order = [where[g] for g in range(n_global)]

    def part(t, m):
        return None if t is None else t.narrow(-1 if t.dim() == 2 else 2, m * length, length)

    states = []
    for m, g in enumerate(mine):
        if g < n_global - 1 or output_final_state:
            S, z = _chunk_state(query, part(key, m), part(value, m), part(key_padding_mask, m), eps)
        else:  # the last chunk's state is wanted only as part of the final state
            dtype = torch.promote_types(query.dtype, torch.float32)
            S, z = query.new_zeros(B, H, D, Dv, dtype=dtype), query.new_zeros(B, H, D, dtype=dtype)
        states.append(_pack(S, z))
    initial = None if S0 is None else _pack(S0, z0)
    # key and value anchor the exchange in the graph: the rank holding only the last chunk computes
    # no state from them, yet its backward must join the exchange's all-reduce, and autograd runs a
    # node only on a path to the tensors whose gradients are asked for.
    prefixes, total = _PrefixStates.apply(torch.stack(states), initial, group, order, mine, key, value)
    prefix_S, prefix_z = _unpack(prefixes, B, H, D, Dv)
    outs = []
    for m in range(chunks):
        out, _, _ = _linear_attention(part(query, m), part(key, m), part(value, m), True,
                                      part(key_padding_mask, m), eps, prefix_S[m], prefix_z[m], False, "auto")
        outs.append(out)
    out = outs[0] if chunks == 1 else torch.cat(outs, dim=2)
    return out, _unpack(total, B, H, D, Dv)


def _non_causal(query, key, value, key_padding_mask, eps, S0, z0, group):
    B, H, _, D = query.shape
    Dv = value.shape[3]
    S, z = _chunk_state(query, key, value, key_padding_mask, eps)
    total = _SumStates.apply(_pack(S, z), None if S0 is None else _pack(S0, z0), group)
    S, z = _unpack(total, B, H, D, Dv)
    out, _, _ = _linear_attention(query, key.narrow(2, 0, 0), value.narrow(2, 0, 0), False, None, eps, S, z, False,
                                  "auto")
    return out, (S, z)
