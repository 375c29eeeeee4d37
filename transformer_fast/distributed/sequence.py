"""Sequence sharding for context parallelism: which rows of the sequence each rank holds.

Two layouts of a sequence of length N over a group of w ranks:

* ``"head_tail"``: the sequence cut into 2w equal chunks; rank r holds chunks r and 2w-1-r (in that
  order). Under a causal mask the early chunks attend few keys and the late ones many, so pairing
  chunk r with chunk 2w-1-r gives every rank the same work (zigzag / load-balanced ring attention).
* ``"contiguous"``: w equal chunks; rank r holds chunk r. Balanced without a causal mask only.

``shard_sequence`` and ``unshard_sequence`` move between the whole sequence and a rank's shard;
``shard_positions`` gives the global positions of the shard's rows (RoPE ``position_ids``).
Packed batches (``shard_packed``) are split per document, each document head-tail over the
ranks (pieces of near-equal length: documents need not divide), so every rank holds a piece of
every document and the causal work stays balanced per document.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("head_tail", "contiguous")


def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_count(world_size, layout):
    """How many equal chunks a sequence is cut into."""
    return 2 * world_size if layout == "head_tail" else world_size


def rank_chunks(rank, world_size, layout):
    """The chunk indices rank holds, in the order of its shard's rows."""
    return (rank, 2 * world_size - 1 - rank) if layout == "head_tail" else (rank,)


def check_divisible(seq_len, world_size, layout):
    chunks = chunk_count(world_size, layout)
    if seq_len % chunks:
        raise ValueError(f"a sequence of length {seq_len} cannot be sharded over a group of {world_size} ranks "
                         f"with layout {layout!r}: the length must be a multiple of {chunks}")
    return seq_len // chunks


def shard_positions(seq_len, group=None, layout="head_tail", device=None):
    """The global positions (int64) of this rank's shard of a sequence of length ``seq_len``."""
    check_layout(layout)
    w, r = _group_size_rank(group)
    c = check_divisible(int(seq_len), w, layout)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in rank_chunks(r, w, layout)])


def global_order(world_size, layout, chunk, device=None):
    """Where each row of the ranks' shards, concatenated in rank order, sits in the sequence."""
    return torch.cat([torch.arange(k * chunk, (k + 1) * chunk, device=device)
                      for r in range(world_size) for k in rank_chunks(r, world_size, layout)])


def shard_sequence(x, group=None, dim=2, layout="head_tail"):
    """This rank's shard of ``x`` (the whole sequence along ``dim``), laid out by ``layout``."""
    check_layout(layout)
    w, r = _group_size_rank(group)
    c = check_divisible(x.shape[dim], w, layout)
    return torch.cat([x.narrow(dim, k * c, c) for k in rank_chunks(r, w, layout)], dim=dim)


def unshard_sequence(x, group=None, dim=2, layout="head_tail"):
    """The whole sequence from every rank's shard ``x`` (an all-gather along ``dim``); not
    differentiable."""
    check_layout(layout)
    w, _ = _group_size_rank(group)
    shard = x.contiguous()
    parts = [torch.empty_like(shard) for _ in range(w)]
    dist.all_gather(parts, shard, group=group)
    gathered = torch.cat(parts, dim=dim)
    c = check_divisible(gathered.shape[dim], w, layout)
    inverse = torch.empty_like(order := global_order(w, layout, c, x.device))
    inverse[order] = torch.arange(order.numel(), device=x.device)
    return gathered.index_select(dim, inverse)


# ---- Packed batches (varlen) ----------------------------------------------------------------
def document_pieces(length, world_size):
    """Boundaries of a document's 2w near-equal pieces (lengths differ by at most one)."""
    return [length * k // (2 * world_size) for k in range(2 * world_size + 1)]


def packed_rows(cu_seqlens, rank, world_size):
    """For rank's shard of a packed batch: the global row indices it holds (int64), the local
    cu_seqlens (int32, one entry per document), and per local piece (document, global start,
    global end) in document coordinates."""
    cu = [int(v) for v in cu_seqlens.tolist()]
    rows, local_cu, pieces = [], [0], []
    for d in range(len(cu) - 1):
        start, length = cu[d], cu[d + 1] - cu[d]
        bounds = document_pieces(length, world_size)
        held = 0
        for k in rank_chunks(rank, world_size, "head_tail"):
            p0, p1 = bounds[k], bounds[k + 1]
            rows.append(torch.arange(start + p0, start + p1))
            pieces.append((d, p0, p1))
            held += p1 - p0
        local_cu.append(local_cu[-1] + held)
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return index, torch.tensor(local_cu, dtype=torch.int32), pieces


def shard_packed(x, cu_seqlens, group=None):
    """This rank's rows of a packed batch ``x`` ((total, ...), documents by ``cu_seqlens``) and its
    local cu_seqlens: every document split into 2w near-equal pieces, the rank holding pieces r
    and 2w-1-r of each (head-tail per document; a document shorter than 2w leaves some ranks
    pieces of length 0)."""
    w, r = _group_size_rank(group)
    index, local_cu, _ = packed_rows(cu_seqlens, r, w)
    return x.index_select(0, index.to(x.device)), local_cu.to(cu_seqlens.device)
