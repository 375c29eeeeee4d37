"""What the context-parallel modes share: the argument checks and the ranks' agreement on them,
the kernel ops for a device, the plan of one call, and the communication counters."""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from .. import _backends
from .._device_kernels import op_kernel
from .sequence import LAYOUTS, chunk_count, rank_chunks

MODES = ("ring", "all_gather", "ulysses")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

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


def bytes_sent_per_rank(mode, B, H, Hk, seq_len, D, Dv, world_size, dtype=torch.float32, backward=False,
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


class Plan:
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
