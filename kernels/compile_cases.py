"""Every Triton kernel configuration the launchers may launch on a GPU, listed for
kernels/compile_check.py, which compiles each for sm_80 and sm_90 without a GPU.

A case is a dict: ``name``, ``fn`` (the JITFunction), ``signature`` (each argument's type, or
"constexpr"), ``constexprs``, optionally ``attrs`` (the launch-time specialization:
{(argument index,): [["tt.divisibility", 16]]}), ``num_warps``, ``num_stages`` and ``expect_wgmma``
(the sm_90 SASS must use Hopper's wgmma).
"""
import torch
import triton

from . import attention, layer_norm
from . import attention_tiles as tiles
from . import linear_attention as la

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def jit_function(kernel):
    """The JITFunction under autotune/heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


# --------------------------------------------------------------------------------------------
# Softmax attention
# --------------------------------------------------------------------------------------------
def _attention_signature(kernel, pointers, constexprs):
    """Every argument of `kernel`: pointers as given, "constexpr" for meta-parameters, fp32 for
    the float scalars, i64 for the seed and i32 for the other ints."""
    sig = {}
    for name in kernel.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in ("qk_scale", "scale", "dropout_p"):
            sig[name] = "fp32"
        elif name == "seed":
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def _divisibility(fn, head_d, head_dv):
    """The launch-time specialization of contiguous q/k/v/dO with head dims that are multiples of
    16: every tensor pointer and every q/k/v/dO stride divisible by 16 (vectorized loads)."""
    names = [n for n in fn.arg_names if n in ("Q", "K", "V", "Out", "Lse", "DOut", "Delta", "DQ", "DK", "DV", "DS")]
    if head_d % 16 == 0 and head_dv % 16 == 0:
        names += [n for n in fn.arg_names if n.startswith(("stride_q", "stride_k", "stride_v", "stride_do"))]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def attention_cases():
    """Every autotune tile of each kernel for each head-dim class (fp16, plain; one head-dim-128
    tile with causal + padding + bool mask), the fp32 tile of each class, dropout, a float
    mask with odd head dims, and the backward preprocess; forward fp16/bf16 cases must use wgmma
    on sm_90."""
    cases = []

    def add(kernel, name, dtype, head_d, head_dv, tile, *, causal=False, mask_kind=0, pad=False, dropout=False,
            store_ds=False, expect_wgmma=False):
        block_m, block_n, warps, stages = tile
        t = "*" + _TYPE[dtype]
        mask_type = {0: t, 1: "*u8", 2: t}[mask_kind]
        pointers = {n: t for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV", "DS")}
        pointers.update(Lse="*fp32", Delta="*fp32", Mask=mask_type, Pad="*u8" if pad else t)
        block_d, block_dv = tiles.block_dims(head_d, head_dv)
        constexprs = dict(HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=causal,
                          MASK_KIND=mask_kind, HAS_PAD=pad, HAS_DROPOUT=dropout,
                          DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", STORE_DS=store_ds,
                          BLOCK_M=block_m, BLOCK_N=block_n)
        fn = jit_function(kernel)
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        features = "".join(f for f, on in (("c", causal), ("b" if mask_kind == 1 else "f", mask_kind), ("p", pad),
                                             ("r", dropout), ("s", store_ds)) if on) or "plain"
        cases.append(dict(
            name=f"{name}[{_TYPE[dtype]},d{head_d}/{head_dv},{features},m{block_m}n{block_n}w{warps}s{stages}]",
            fn=fn, signature=_attention_signature(fn, pointers, constexprs), constexprs=constexprs,
            attrs=_divisibility(fn, head_d, head_dv), num_warps=warps, num_stages=stages, expect_wgmma=expect_wgmma))

    heads = {64: (64, 64), 128: (128, 128), 256: (256, 256)}
    kernels = ((attention.attention_fwd_kernel, "attention_fwd", tiles.FWD_TILES_LOWP, tiles.FWD_TILES_FP32),
               (attention.attention_bwd_dkdv_kernel, "attention_bwd_dkdv", tiles.DKDV_TILES_LOWP,
                tiles.DKDV_TILES_FP32),
               (attention.attention_bwd_dq_kernel, "attention_bwd_dq", tiles.DQ_TILES_LOWP, tiles.DQ_TILES_FP32))
    for kernel, name, lowp, fp32 in kernels:
        forward = kernel is attention.attention_fwd_kernel
        for cls, (d, dv) in heads.items():
            for i, tile in enumerate(lowp[cls]):
                # plain, but the first head-dim-128 tile with causal + padding + bool mask (the most work
                # per tile; these compile several times slower, so only one per kernel)
                full = cls == 128 and i == 0
                add(kernel, name, torch.float16, d, dv, tile, causal=full, mask_kind=1 if full else 0, pad=full,
                    expect_wgmma=forward)
        # fp32 (each head-dim class's tile, with causal + padding + bool mask), dropout, and a float
        # mask with odd head dims (padded inside the kernel)
        for cls, (d, dv) in heads.items():
            add(kernel, name, torch.float32, d, dv, fp32[cls][0], causal=True, mask_kind=1, pad=True)
        add(kernel, name, torch.bfloat16, 128, 128, lowp[128][0], causal=True, dropout=True, expect_wgmma=forward)
        add(kernel, name, torch.bfloat16, 80, 40, lowp[128][0], mask_kind=2, expect_wgmma=forward)
        add(kernel, name, torch.float16, 40, 23, lowp[64][0], mask_kind=2, pad=True, expect_wgmma=forward)
    # dS out (a float mask that requires grad): causal + padding + float mask + dropout, as in T5
    # training, for each dtype class
    for dtype, cls in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)):
        table = tiles.DQ_TILES_FP32 if dtype == torch.float32 else tiles.DQ_TILES_LOWP
        add(attention.attention_bwd_dq_kernel, "attention_bwd_dq", dtype, cls, cls, table[cls][0], causal=True,
            mask_kind=2, pad=True, dropout=True, store_ds=True)
    preprocess = jit_function(attention.attention_bwd_preprocess_kernel)
    for dtype, dv, block in ((torch.float16, 64, 64), (torch.float32, 256, 32)):
        constexprs = dict(HEAD_DV=dv, BLOCK_DV=dv, BLOCK_M=block)
        t = "*" + _TYPE[dtype]
        cases.append(dict(name=f"attention_bwd_preprocess[{_TYPE[dtype]},dv{dv},m{block}]", fn=preprocess,
                          signature=_attention_signature(preprocess, {"Out": t, "DOut": t, "Delta": "*fp32"},
                                                         constexprs),
                          constexprs=constexprs, num_warps=4, num_stages=1, expect_wgmma=False))
    return cases


# --------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm
# --------------------------------------------------------------------------------------------
_LAYER_NORM_FLOAT_ARGS = ("W", "B", "Mean", "Rstd", "DWPartial", "DBPartial")


def _layer_norm_case(fn, name, dtype, tile, flags):
    block_m, block_n, single, warps = tile
    constexprs = dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_TILE=single)
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in _LAYER_NORM_FLOAT_ARGS:
            signature[arg] = "*fp32"
        elif arg not in ("M", "N") and arg[0].isupper():
            signature[arg] = "*" + _TYPE[dtype]
        elif arg == "eps":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
    on = "".join(k[4] if k.startswith("HAS_") else "rms" for k, v in flags.items() if v) or "plain"
    return dict(name=f"{name}[{_TYPE[dtype]},{on},m{block_m}n{block_n}{'' if single else 'loop'}w{warps}]",
                fn=fn, signature=signature, constexprs=constexprs, num_warps=warps, num_stages=1)


def layer_norm_cases():
    """Every tile config (a function of the row width only) in fp16 with every feature on; fp32
    and bf16 with a single-tile and the looped config; the other flag combinations (no residual/dh,
    weight only, RMS with and without weight, none) with those two configs in fp16. Flags and
    dtypes change loads and stores, not the tile's register shape."""
    cases = []
    kernels = ((layer_norm.layer_norm_fwd_kernel, "layer_norm_fwd", "HAS_RESIDUAL"),
               (layer_norm.layer_norm_bwd_kernel, "layer_norm_bwd", "HAS_DH"))
    for kernel, name, extra in kernels:
        backward = kernel is layer_norm.layer_norm_bwd_kernel
        two_tiles = (layer_norm.row_tiles(1024, backward),
                     layer_norm.row_tiles(layer_norm.MAX_TILE + 1, backward))
        every = {extra: True, "HAS_WEIGHT": True, "HAS_BIAS": True, "IS_RMS": False}
        for tile in layer_norm.all_row_tiles(backward):
            cases.append(_layer_norm_case(kernel, name, torch.float16, tile, every))
        for dtype in (torch.float32, torch.bfloat16):
            for tile in two_tiles:
                cases.append(_layer_norm_case(kernel, name, dtype, tile, every))
        for tile in two_tiles:
            for has_extra, rms, weight, bias in ((False, False, False, False), (True, False, True, False),
                                                 (False, True, False, False), (True, True, True, False)):
                flags = {extra: has_extra, "HAS_WEIGHT": weight, "HAS_BIAS": bias, "IS_RMS": rms}
                cases.append(_layer_norm_case(kernel, name, torch.float16, tile, flags))
    return cases


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------
def linear_attention_cases():
    """The kernel configs the launchers launch on a GPU, within CI's compile budget: listing every
    one (10 kernel modes x ~17 block shapes x 3 dtypes x mask on/off) would take far longer, so
    every kernel mode is compiled at each contracted width's largest column tile for half
    precision (smaller column tiles of a width are the same program with smaller tiles), at the
    smallest, middle and largest width for fp32 (its own, smaller blocks), with bf16 and the
    mask on/off spread over them, plus the smallest shape. Every scan mode also compiles at every
    shape with a carried state (HAS_STATE; STORE_STATE where the mode writes a state: the final
    state, dS0, dz0), which adds the state tile's load and store to the registers the scan holds."""
    widest = la.MAX_BLOCK_C
    shapes = [(16, 16, torch.float16, True), (32, widest, torch.bfloat16, False),
              (64, widest, torch.float16, True), (128, widest, torch.float16, False),
              (256, widest, torch.float16, True), (16, widest, torch.float32, False),
              (64, widest, torch.float32, True), (256, widest, torch.float32, False)]
    cases = []
    for na, nc, dtype, has_mask in shapes:
        ty = _TYPE[dtype]
        ptr = f"*{ty}"
        blocks, num_warps, precision = la.block_config(na, nc, dtype)
        common = dict(HAS_MASK=has_mask, PRECISION=precision)
        tag = f"{ty}_mask{int(has_mask)}_a{blocks['BLOCK_A']}_c{blocks['BLOCK_C']}_n{blocks['BLOCK_N']}"
        for mode in (la.FWD_OUT, la.FWD_STATS, la.BWD_DQ, la.BWD_DK, la.BWD_DV):
            for has_state in (False, True):
                sig = {name: ptr for name in ("Q", "K", "V", "DO")}
                sig.update(KPM="*u8", DEN="*fp32", P="*fp32", OUT="*fp32" if mode == la.FWD_STATS else ptr,
                           ST="*fp32", SZ="*fp32", FS="*fp32", FZ="*fp32")
                sig.update({name: "i32" for name in (
                    "sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "sdb", "sdh", "sdn",
                    "smb", "smn", "stb", "sth", "sta", "stc", "szb", "szh", "szd", "H", "N", "D", "DV", "n_ptiles")})
                sig["eps"] = "fp32"
                store = has_state and mode in (la.FWD_OUT, la.BWD_DK, la.BWD_DV)
                const = dict(MODE=mode.value, HAS_STATE=has_state, STORE_STATE=store, **common, **blocks)
                sig.update({name: "constexpr" for name in const})
                cases.append(dict(name=f"linattn_scan_mode{mode.value}{'_state' if has_state else ''}_{tag}",
                                  fn=la.causal_scan_kernel, signature=sig, constexprs=const, num_warps=num_warps,
                                  num_stages=2))
        for backward in (False, True):
            sig = dict(X=ptr, Y=ptr, KPM="*u8", DEN="*fp32", G="*fp32", WS_T="*fp32", WS_t="*fp32")
            sig.update({name: "i32" for name in (
                "sxb", "sxh", "sxn", "syb", "syh", "syn", "smb", "smn", "H", "N", "D", "DV",
                "chunks_per_split")})
            const = dict(BACKWARD=backward, **common, **blocks)
            sig.update({name: "constexpr" for name in const})
            cases.append(dict(name=f"linattn_state_bwd{int(backward)}_{tag}", fn=la.state_kernel,
                              signature=sig, constexprs=const, num_warps=num_warps, num_stages=2))
        apply_blocks = dict(blocks)
        apply_blocks["BLOCK_M"] = apply_blocks.pop("BLOCK_N")
        for mode in (la.APPLY_OUT, la.APPLY_DQ, la.APPLY_DKDV):
            sig = dict(X=ptr, Y=ptr, KPM="*u8", S="*fp32", Z="*fp32", OUT=ptr, OUT2=ptr, DEN="*fp32",
                       G="*fp32")
            sig.update({name: "i32" for name in (
                "sxb", "sxh", "sxn", "syb", "syh", "syn", "smb", "smn", "H", "N", "D", "DV")})
            sig["eps"] = "fp32"
            const = dict(MODE=mode.value, **common, **apply_blocks)
            sig.update({name: "constexpr" for name in const})
            cases.append(dict(name=f"linattn_apply_mode{mode.value}_{tag}", fn=la.apply_kernel, signature=sig,
                              constexprs=const, num_warps=num_warps, num_stages=2))
    return cases


FAMILY_CASES = {"attention": attention_cases, "layer_norm": layer_norm_cases,
                "linear_attention": linear_attention_cases}


def compile_cases(family):
    """The compile cases of a kernel family (a name in kernels.FAMILIES)."""
    return FAMILY_CASES[family]()
