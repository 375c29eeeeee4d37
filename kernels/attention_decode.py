"""Flash-Decoding for the Triton softmax attention: when the forward's programs (batch x heads x
query blocks) would leave most of the GPU idle, as when decoding a few queries against a long
cache, each sequence's keys are split over several programs. Each writes its share's output,
normalised by its own sum, and log-sum-exp into fp32 scratch (the forward kernel with SPLIT,
kernels/attention_forward.py); `attention_combine_kernel` then merges the shares of every row
by weights exp(lse_split - lse), adds the sinks, and writes out and lse.

This module also holds the host-side choices: how many splits (`plan_splits`, FlashAttention-2's
wave-efficiency rule over the device's SM count, read once per device) and whether a program packs
the query heads of a GQA group into its rows (`pack_gqa`).
"""

import functools
import math

import triton
import triton.language as tl

from . import _grid_math
from ._grid_math import cdiv
from ._triton_options import interpreting
from .attention_forward import _fwd_store

# A split's share is at least this many keys (about the keys a program streams before its
# partial result costs as much to write and merge as it saved); and at most this many splits.
SPLIT_KEYS = 256
MAX_SPLITS = 128
# The nominal query block of the choices below (the autotuner picks the real one later).
NOMINAL_BLOCK_M = 32 if interpreting() else 64
# Under the interpreter (no GPU): the SM count the split rule assumes.
INTERPRETER_SMS = 4


@triton.jit
def attention_combine_kernel(OutPart, LsePart, Out, Lse, Sinks, n_lse, num_splits, H, rows_per_head, stride_ob,
                             stride_oh, stride_om, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Merges the num_splits partial results (OutPart (splits, n_lse, HEAD_DV) fp32, LsePart
    (splits, n_lse) base 2) of lse entries r, in (B, H, rows_per_head) order: dense rows_per_head
    = Nq; packed (H, Tq) order, rows_per_head = Tq and B = 1. Out's strides count rows of HEAD_DV
    (packed (Tq, H, Dv): 0, 1, H)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_lse
    cols = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(0, num_splits):
        part = tl.cast(s, tl.int64) * n_lse + r
        lse_s = tl.load(LsePart + part, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m_i, lse_s)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        w = tl.exp2(lse_s - m_base)
        o = tl.load(OutPart + (part * HEAD_DV)[:, None] + cols[None, :],
                    mask=row_ok[:, None] & (cols[None, :] < HEAD_DV), other=0.0)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_i = l_i * alpha + w
        m_i = m_new
    h = (r // rows_per_head) % H
    out_offs = ((r // (rows_per_head * H)) * stride_ob + h * stride_oh + (r % rows_per_head) * stride_om) * HEAD_DV
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(Sinks + h, mask=row_ok, other=0.0)
    _fwd_store(acc, l_i, m_i, Out, out_offs, Lse + r, OutPart, out_offs, LsePart + r, row_ok, sink, 0.0, HEAD_DV,
               BLOCK_DV, HAS_SINKS, False, False)


def combine_launch_shape(block_dv):
    """(BLOCK_R, num_warps) of the combine kernel: 16 rows, fewer at the widest value heads."""
    return (16 if block_dv <= 128 else 8), 4


def sm_count(device):
    """The number of SMs of `device` (INTERPRETER_SMS under the interpreter)."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_SMS
    return _grid_math.sm_count(device)


def pack_gqa(group, rows, dropout_p):
    """Whether a program takes the rows of every query head of a GQA group (FlashAttention-3's
    rule): when that fills the query tile better by more than 10%, as with a handful of query
    rows per head (decoding). Not with dropout (its offsets assume one head per program)."""
    if group <= 1 or dropout_p > 0.0 or rows <= 0:
        return False
    block = NOMINAL_BLOCK_M
    own = rows / (cdiv(rows, block) * block)
    packed = rows * group / (cdiv(rows * group, block) * block)
    return own < 0.9 * packed


@functools.lru_cache(maxsize=4096)
def _efficient_splits(programs, sms, key_blocks):
    """FlashAttention-2's num_splits_heuristic: the fewest splits whose last wave of programs is
    at least 85% as full as the best choice's, among the counts that give each split a different
    number of key blocks."""
    if programs >= 0.8 * sms:
        return 1
    most = min(MAX_SPLITS, sms, key_blocks)
    efficiency = {}
    for n in range(1, most + 1):
        if n == 1 or cdiv(key_blocks, n) != cdiv(key_blocks, n - 1):
            waves = programs * n / sms
            efficiency[n] = waves / math.ceil(waves)
    best = max(efficiency.values(), default=0.0)
    for n, eff in efficiency.items():
        if eff >= 0.85 * best:
            return n
    return 1


def plan_splits(num_splits, programs, keys, device, dropout_p):
    """How many splits the forward runs: `num_splits` >= 1 asks for at most that many (1: never;
    no more than 16-key tiles), 0 chooses by `_efficient_splits` for `programs` programs of the
    unsplit grid and `keys` keys a row may see (none with dropout: training fills the GPU)."""
    if num_splits == 1 or keys <= 0:
        return 1
    if num_splits > 1:
        return max(1, min(num_splits, cdiv(keys, 16), 65535))
    if dropout_p > 0.0:
        return 1
    return _efficient_splits(programs, sm_count(device), cdiv(keys, SPLIT_KEYS))
