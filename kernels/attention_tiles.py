"""Tile shapes of the Triton attention kernels (kernels/attention_*.py): the head-dim blocks, the
candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) tables per head-dim class and precision, the
autotune configs built from them, the pruning that picks a call's table, and the autotune key.

Which tiles are listed, and why, is in docs/attention.md ("Tiles"); the compile check
(kernels/compile_check.py) builds every one of them for sm_80 and sm_90.
"""
import triton

from ._autotune import forced_tile_index
from ._grid_math import next_power_of_2
from ._triton_options import interpreting


def block_dim(d):
    return max(16, next_power_of_2(d))  # tl.dot needs >= 16 along every dim


def block_dims(d, dv):
    """(BLOCK_D, BLOCK_DV). Where the query/key head dim is not a multiple of 16 and the value
    block would be narrower, the value block is widened to BLOCK_D. On an H100, Triton 3.6
    miscompiled the forward for (D, Dv) = (40, 23) and (24, 11), with wrong outputs and
    out-of-range shared-memory accesses (compute-sanitizer), while (48, 23), (80, 23), (80, 40)
    and ten other pairs with a padded head dim were right without widening (docs/attention.md).
    Widening wherever a head dim is padded would cost spills (dK/dV at (80, 40): 14 KB on sm_80).
    The extra value columns are loaded as zeros and never stored."""
    block_d, block_dv = block_dim(d), block_dim(dv)
    if d % 16 and block_dv < block_d:
        block_dv = block_d
    return block_d, block_dv


def head_class(block_d):
    """The tile tables' row for a padded head dim: 64 (up to 64), 128 or 256."""
    return 64 if block_d <= 64 else block_d


# (BLOCK_M, BLOCK_N, num_warps, num_stages); which apply to a call is decided by `pruner`.
# (128, 64, 4 warps) and (128, 128, 8 warps) spill on sm_80/sm_90 and are left out.
FWD_TILES_LOWP = {  # fp16/bf16, by head-dim class
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    256: [(64, 64, 8, 2), (64, 32, 4, 2)],  # (64, 64, 4 warps) spills here
}
# fp32 (ieee dots on CUDA cores). One tile per head dim, picked with the compile check: the one
# that spills least on sm_80 and sm_90 across plain inputs, causal + padding + bool mask, and
# causal + padding + float mask + dropout. ptxas is erratic here: (32, 32, 4 warps, 2 stages)
# at head dim 256 was given 32 registers and 67-77 KB of spills per thread.
FWD_TILES_FP32 = {64: [(32, 32, 4, 2)], 128: [(32, 32, 8, 1)], 256: [(16, 16, 4, 1)]}

# Backward. The dK/dV kernel holds a BLOCK_N key block (K, V and two fp32 accumulators) and
# streams BLOCK_M query rows: long key blocks and short query tiles. The dQ kernel holds BLOCK_M
# query rows and streams keys. Chosen on an H100 with benchmarks/tools/sweep_attention_tiles_gpu.py
# (bf16, N=4096; output in benchmarks/results/): the three fastest tiles per kernel and head dim
# that spill little or nothing, causal and not. The mask features are part of the autotune key:
# with them the same tile can spill (compile check).
DKDV_TILES_LOWP = {
    64: [(16, 128, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3)],
    # (64, 64, 8 warps): half the speed of the others on plain inputs, but with causal + padding +
    # a mask it spills least of them on sm_80 (76 bytes against 150-18000)
    128: [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2)],
    256: [(32, 32, 8, 1), (64, 32, 8, 1)],
}
DQ_TILES_LOWP = {
    64: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    128: [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
    256: [(32, 32, 8, 1), (64, 32, 8, 1)],
}
DKDV_TILES_FP32 = {64: [(32, 32, 8, 1)], 128: [(32, 32, 8, 1)], 256: [(16, 32, 8, 1)]}  # chosen as FWD_TILES_FP32
DQ_TILES_FP32 = {64: [(32, 32, 8, 1)], 128: [(32, 16, 8, 1)], 256: [(16, 32, 8, 1)]}


def all_tiles(*tables):
    """Every tile of the tables, each once, sorted."""
    return sorted({t for table in tables for ts in table.values() for t in ts})


def _configs(tiles, interpreter_tile):
    """One autotune config per tile; under the interpreter only `interpreter_tile` (it cannot
    benchmark, and small unequal tiles make the tests' short sequences span several)."""
    if interpreting():
        block_m, block_n = interpreter_tile
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def fwd_configs():
    return _configs(all_tiles(FWD_TILES_LOWP, FWD_TILES_FP32), (32, 16))


def dkdv_configs():
    return _configs(all_tiles(DKDV_TILES_LOWP, DKDV_TILES_FP32), (16, 32))


def dq_configs():
    return _configs(all_tiles(DQ_TILES_LOWP, DQ_TILES_FP32), (16, 32))


def tiles_for(args, table_lowp, table_fp32):
    """The candidate tiles of a call, from its BLOCK_D, BLOCK_DV and DOT_PRECISION."""
    head = head_class(max(args["BLOCK_D"], args["BLOCK_DV"]))
    table = table_fp32 if args["DOT_PRECISION"] == "ieee" else table_lowp
    return table[head]


def pruner(table_lowp, table_fp32):
    """The autotuner's early_config_prune: the configs of the call's candidate tiles (only the
    TRANSFORMER_FAST_TILE-th of them where that is set)."""
    def prune(configs, named_args, **kwargs):
        wanted = tiles_for({**named_args, **kwargs}, table_lowp, table_fp32)
        forced = forced_tile_index()
        if forced is not None:
            wanted = [wanted[forced % len(wanted)]]
        kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                in wanted]
        return kept or configs[:1]
    return prune


# The autotune keys: a tuned choice holds for one length bucket and one set of features (each
# feature changes the kernel's registers and spills, so its best tile).
TUNE_KEY = ["LEN_BUCKET", "BLOCK_D", "BLOCK_DV", "IS_CAUSAL", "MASK_KIND", "HAS_PAD", "HAS_DROPOUT", "DOT_PRECISION",
            "WINDOW_LEFT", "WINDOW_RIGHT", "HAS_SOFTCAP", "HAS_ALIBI", "LAYOUT"]
FWD_TUNE_KEY = TUNE_KEY + ["HAS_SINKS", "HAS_SEQUSED", "SPLIT", "PACK_GQA"]
DKDV_TUNE_KEY = TUNE_KEY + ["ATOMIC_DQ"]
DQ_TUNE_KEY = TUNE_KEY + ["STORE_DS"]


def length_bucket(nq, nk):
    """The autotune key's length bucket: powers of two of Nq and Nk, capped."""
    return min(next_power_of_2(nq), 16384) * 32768 + min(next_power_of_2(nk), 16384)
