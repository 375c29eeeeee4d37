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
from . import attention_decode as decode
from . import attention_tiles as tiles
from . import linear_attention as la

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def jit_function(kernel):
    """The JITFunction under autotune/heuristics wrappers (its InterpretedFunction under the
    interpreter, for tools' dry runs)."""
    from triton.runtime.interpreter import InterpretedFunction

    while not isinstance(kernel, (triton.runtime.JITFunction, InterpretedFunction)):
        kernel = kernel.fn
    return kernel


# --------------------------------------------------------------------------------------------
# Softmax attention
# --------------------------------------------------------------------------------------------
_FLOAT_SCALARS = ("qk_scale", "scale", "dropout_p", "softcap2")


def _attention_signature(kernel, pointers, constexprs):
    """Every argument of `kernel`: pointers as given, "constexpr" for meta-parameters, fp32 for
    the float scalars, i64 for the seed and i32 for the other ints."""
    sig = {}
    for name in kernel.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in _FLOAT_SCALARS:
            sig[name] = "fp32"
        elif name == "seed":
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


_DIVISIBLE = ("Q", "K", "V", "Out", "Lse", "DOut", "Delta", "DQ", "DK", "DV", "DS", "OutPart", "LsePart")


def _divisibility(fn, head_d, head_dv):
    """The launch-time specialization of contiguous q/k/v/dO with head dims that are multiples of
    16: every tensor pointer and every q/k/v/dO stride divisible by 16 (vectorized loads)."""
    names = [n for n in fn.arg_names if n in _DIVISIBLE]
    if head_d % 16 == 0 and head_dv % 16 == 0:
        names += [n for n in fn.arg_names if n.startswith(("stride_q", "stride_k", "stride_v", "stride_do"))]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


# Feature letters of the case names: c causal, b/f bool/float mask (F: a float32 one with a
# half-precision query), p padding, r dropout, s dS out,
# L/R window left/right, t softcap, a ALiBi, k sinks, P packed, G paged, u seqused_k, S split,
# g GQA heads packed in a program's rows, h outputs laid out (B, N, H, D), q dQ added atomically.
_LETTERS = (("p", "pad"), ("r", "dropout"), ("s", "store_ds"), ("d", "store_pdp"), ("L", "window_left"),
            ("R", "window_right"), ("t", "softcap"), ("a", "alibi"), ("k", "sinks"), ("u", "seqused"),
            ("S", "split"), ("g", "pack_gqa"), ("h", "heads_inside_rows"), ("q", "atomic_dq"))


def attention_cases():
    """Every autotune tile of each kernel for each head-dim class (fp16, plain; one head-dim-128
    tile with causal + padding + bool mask), the fp32 tile of each class, dropout, a float
    mask with odd head dims, and the backward preprocess; then the contract's extras on the
    first tile of a class (and on every tile of the decoding and packed-training mixes at head
    dim 128): windows, soft-capping, ALiBi, sinks, packed and paged layouts, seqused_k, the
    Flash-Decoding split with GQA heads packed, the split's merge, and dQ's sum of P * dP.
    Forward fp16/bf16 cases must use wgmma on sm_90."""
    cases = []

    def add(kernel, name, dtype, head_d, head_dv, tile, *, mask_kind=0, layout=0, expect_wgmma=False, **flags):
        block_m, block_n, warps, stages = tile
        t = "*" + _TYPE[dtype]
        mask_type = {0: t, 1: "*u8", 2: "*fp32" if flags.get("mask_fp32") else t}[mask_kind]
        pointers = {n: t for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV", "DS")}
        pointers.update(Lse="*fp32", Delta="*fp32", PdP="*fp32", Mask=mask_type,
                        Pad="*u8" if flags.get("pad") else t,
                        Alibi="*fp32" if flags.get("alibi") else t, Sinks="*fp32" if flags.get("sinks") else t,
                        CuQ="*i32" if layout else t, CuK="*i32" if layout == 1 else t,
                        SeqUsed="*i32" if flags.get("seqused") or layout == 2 else t,
                        BlockTable="*i32" if layout == 2 else t, OutPart="*fp32" if flags.get("split") else t,
                        LsePart="*fp32" if flags.get("split") else "*fp32")
        if flags.get("mask_fp32"):
            pointers["DS"] = "*fp32"  # dS is written in the mask's dtype
        if flags.get("atomic_dq"):
            pointers["DQ"] = "*fp32"  # the dK/dV kernel's float32 sum of dQ
        block_d, block_dv = tiles.block_dims(head_d, head_dv)
        constexprs = dict(HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                          IS_CAUSAL=bool(flags.get("causal")), MASK_KIND=mask_kind, HAS_PAD=bool(flags.get("pad")),
                          HAS_DROPOUT=bool(flags.get("dropout")),
                          DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                          STORE_DS=bool(flags.get("store_ds")), STORE_PDP=bool(flags.get("store_pdp")),
                          WINDOW_LEFT=bool(flags.get("window_left")),
                          WINDOW_RIGHT=bool(flags.get("window_right")), HAS_SOFTCAP=bool(flags.get("softcap")),
                          HAS_ALIBI=bool(flags.get("alibi")), HAS_SINKS=bool(flags.get("sinks")), LAYOUT=layout,
                          HAS_SEQUSED=bool(flags.get("seqused")), SPLIT=bool(flags.get("split")),
                          PACK_GQA=bool(flags.get("pack_gqa")), ATOMIC_DQ=bool(flags.get("atomic_dq")),
                          BLOCK_M=block_m, BLOCK_N=block_n)
        # the launchers' own outputs have unit row strides (in rows of the head dim) where dense and
        # contiguous, unit head strides where packed or laid out (B, N, H, D)
        # (transformer_fast/_result_layout.py); Triton specializes an int argument equal to 1 as a constant
        rows_unit = layout == 0 and not flags.get("heads_inside_rows")
        unit = ("stride_om", "stride_dqm", "stride_dkn", "stride_dvn") if rows_unit else \
            ("stride_oh", "stride_dqh", "stride_dkh", "stride_dvh")
        constexprs.update({name: 1 for name in unit})
        fn = jit_function(kernel)
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        letters = "".join(letter for letter, flag in _LETTERS if flags.get(flag))
        float_mask = "F" if flags.get("mask_fp32") else "f"
        features = (("c" if flags.get("causal") else "") + {0: "", 1: "b", 2: float_mask}[mask_kind]
                    + letters + ("", "P", "G")[layout])
        tile_name = f"m{block_m}n{block_n}w{warps}s{stages}"
        cases.append(dict(
            name=f"{name}[{_TYPE[dtype]},d{head_d}/{head_dv},{features or 'plain'},{tile_name}]",
            fn=fn, signature=_attention_signature(fn, pointers, constexprs), constexprs=constexprs,
            attrs=_divisibility(fn, head_d, head_dv), num_warps=warps, num_stages=stages, expect_wgmma=expect_wgmma))

    heads = {64: (64, 64), 128: (128, 128), 256: (256, 256)}
    fwd = (attention.attention_fwd_kernel, "attention_fwd", tiles.FWD_TILES_LOWP, tiles.FWD_TILES_FP32)
    dkdv = (attention.attention_bwd_dkdv_kernel, "attention_bwd_dkdv", tiles.DKDV_TILES_LOWP, tiles.DKDV_TILES_FP32)
    dq = (attention.attention_bwd_dq_kernel, "attention_bwd_dq", tiles.DQ_TILES_LOWP, tiles.DQ_TILES_FP32)
    for kernel, name, lowp, fp32 in (fwd, dkdv, dq):
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
        add(kernel, name, torch.bfloat16, 64, 64, lowp[64][0], causal=True, pad=True, heads_inside_rows=True,
            expect_wgmma=forward)
        add(kernel, name, torch.bfloat16, 80, 40, lowp[128][0], mask_kind=2, expect_wgmma=forward)
        add(kernel, name, torch.float16, 40, 23, lowp[64][0], mask_kind=2, pad=True, expect_wgmma=forward)
        add(kernel, name, torch.bfloat16, 64, 64, lowp[64][0], mask_kind=2, mask_fp32=True,
            store_ds=kernel is attention.attention_bwd_dq_kernel, expect_wgmma=forward)
    # dS out (a float mask that requires grad): causal + padding + float mask + dropout, as in T5
    # training, for each dtype class
    for dtype, cls in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)):
        table = tiles.DQ_TILES_FP32 if dtype == torch.float32 else tiles.DQ_TILES_LOWP
        add(attention.attention_bwd_dq_kernel, "attention_bwd_dq", dtype, cls, cls, table[cls][0], causal=True,
            mask_kind=2, pad=True, dropout=True, store_ds=True)
    _extras_cases(add, fwd, dkdv, dq)
    _atomic_dq_cases(add, dkdv)
    preprocess = jit_function(attention.attention_bwd_preprocess_kernel)
    for dtype, dv, block in ((torch.float16, 64, 64), (torch.float32, 256, 32)):
        constexprs = dict(HEAD_DV=dv, BLOCK_DV=dv, BLOCK_M=block, stride_om=1)
        t = "*" + _TYPE[dtype]
        cases.append(dict(name=f"attention_bwd_preprocess[{_TYPE[dtype]},dv{dv},m{block}]", fn=preprocess,
                          signature=_attention_signature(preprocess, {"Out": t, "DOut": t, "Delta": "*fp32"},
                                                         constexprs),
                          constexprs=constexprs, num_warps=4, num_stages=1, expect_wgmma=False))
    convert = jit_function(attention.attention_bwd_dq_convert_kernel)
    for dtype in (torch.float16, torch.bfloat16):
        constexprs = dict(BLOCK=1024)
        cases.append(dict(name=f"attention_bwd_dq_convert[{_TYPE[dtype]}]", fn=convert,
                          signature=_attention_signature(convert, {"Src": "*fp32", "Dst": "*" + _TYPE[dtype]},
                                                         constexprs),
                          constexprs=constexprs, num_warps=4, num_stages=1, expect_wgmma=False))
    combine = jit_function(attention.attention_combine_kernel)
    for dtype, dv, sinks, packed in ((torch.float16, 64, False, False), (torch.bfloat16, 128, True, True),
                                     (torch.float32, 256, True, False), (torch.float16, 23, False, True)):
        block_dv = tiles.block_dims(dv, dv)[1]
        block_r, warps = decode.combine_launch_shape(block_dv)
        # packed (Tq, H, Dv) and a (B, N, H, Dv) layout have head stride 1 (a constexpr at launch)
        constexprs = dict(HEAD_DV=dv, BLOCK_DV=block_dv, BLOCK_R=block_r, HAS_SINKS=sinks,
                          **({"stride_oh": 1} if packed else {}))
        pointers = {"OutPart": "*fp32", "LsePart": "*fp32", "Out": "*" + _TYPE[dtype], "Lse": "*fp32",
                    "Sinks": "*fp32"}
        features = ("k" if sinks else "") + ("P" if packed else "")
        cases.append(dict(name=f"attention_combine[{_TYPE[dtype]},dv{dv},{features or 'plain'}]",
                          fn=combine, signature=_attention_signature(combine, pointers, constexprs),
                          constexprs=constexprs, attrs=_divisibility(combine, dv, dv), num_warps=warps, num_stages=1,
                          expect_wgmma=False))
    return cases


# The contract's extras, as models combine them: Mistral/Gemma-2 local layers (window + softcap),
# gpt-oss (window + sinks), BLOOM/MPT (ALiBi), packed training (varlen, causal window (-1, 0)) and
# decoding from a paged cache (split + GQA packing).
_TRAINING_MIXES = (
    dict(window_left=True, window_right=True, causal=True),
    dict(window_left=True, window_right=True, softcap=True, layout=1),
    dict(alibi=True, mask_kind=2, pad=True),
    dict(window_left=True, window_right=True, alibi=True, softcap=True, dropout=True),
)
_FORWARD_MIXES = (
    dict(window_left=True, window_right=True, sinks=True, seqused=True, layout=1),
    dict(split=True, pack_gqa=True, layout=2, window_left=True, window_right=True, sinks=True, softcap=True),
    dict(split=True, pack_gqa=True, mask_kind=2, pad=True, alibi=True),
)


def _extras_cases(add, fwd, dkdv, dq):
    for kernel, name, lowp, fp32 in (fwd, dkdv, dq):
        forward = kernel is fwd[0]
        mixes = _TRAINING_MIXES + (_FORWARD_MIXES if forward else ())
        for i, mix in enumerate(mixes):
            # each mix on the first tile of one head-dim class (rotating), in fp16/bf16
            cls = (64, 128, 256)[i % 3]
            dtype = (torch.float16, torch.bfloat16)[i % 2]
            add(kernel, name, dtype, cls, cls, lowp[cls][0], expect_wgmma=forward, **mix)
        # every tile of the head-dim-128 class: the decoding mix (forward) and packed causal training
        # with a window and soft-capping, as Gemma 2 trains (all kernels)
        for tile in lowp[128][1:]:
            if forward:
                add(kernel, name, torch.bfloat16, 128, 128, tile, expect_wgmma=True, **_FORWARD_MIXES[1])
            add(kernel, name, torch.bfloat16, 128, 128, tile, expect_wgmma=forward, **_TRAINING_MIXES[1])
        # fp32, with every score feature, packed
        add(kernel, name, torch.float32, 64, 64, fp32[64][0], layout=1, window_left=True, window_right=True,
            softcap=True, alibi=True, **({"sinks": True, "seqused": True} if forward else {}))
        add(kernel, name, torch.float32, 128, 128, fp32[128][0], layout=2 if forward else 1, window_left=True,
            softcap=True, **({"split": True, "pack_gqa": True, "sinks": True} if forward else {}))
    # dS out with soft-capping (the factor is taken after the store)
    add(dq[0], dq[1], torch.bfloat16, 64, 64, dq[2][64][0], mask_kind=2, softcap=True, alibi=True, store_ds=True,
        window_left=True, window_right=True)
    # the rows' sum of P * dP (the sinks' gradient): packed causal window training, as gpt-oss trains,
    # on every head-dim-128 tile; dense with padding and dropout; fp32
    for tile in dq[2][128]:
        add(dq[0], dq[1], torch.bfloat16, 128, 128, tile, store_pdp=True, **_TRAINING_MIXES[1])
    add(dq[0], dq[1], torch.float16, 64, 64, dq[2][64][0], pad=True, dropout=True, store_pdp=True)
    add(dq[0], dq[1], torch.float32, 64, 64, dq[3][64][0], causal=True, window_left=True, store_pdp=True)


def _atomic_dq_cases(add, dkdv):
    """The dK/dV kernel adding dQ atomically (TRANSFORMER_FAST_ATOMIC_DQ): every fp16/bf16 tile,
    causal on the first of head dims 64 and 128; fp32 with causal + padding + bool mask; a float
    mask with padding and dropout; packed causal-window training with soft-capping."""
    kernel, name, lowp, fp32 = dkdv
    for cls, dtype in ((64, torch.bfloat16), (128, torch.float16), (256, torch.bfloat16)):
        for tile in lowp[cls]:
            add(kernel, name, dtype, cls, cls, tile, atomic_dq=True)
        if cls < 256:
            add(kernel, name, dtype, cls, cls, lowp[cls][0], atomic_dq=True, causal=True)
    add(kernel, name, torch.float32, 64, 64, fp32[64][0], atomic_dq=True, causal=True, mask_kind=1, pad=True)
    add(kernel, name, torch.bfloat16, 128, 128, lowp[128][0], atomic_dq=True, mask_kind=2, pad=True, dropout=True)
    add(kernel, name, torch.bfloat16, 64, 64, lowp[64][0], atomic_dq=True, **_TRAINING_MIXES[1])


# --------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm
# --------------------------------------------------------------------------------------------
# float32 always; the other pointers (weight and bias included) take the case's dtype
_LAYER_NORM_FLOAT_ARGS = ("Mean", "Rstd", "DWPartial", "DBPartial")


def _layer_norm_case(fn, name, dtype, tile, flags, aligned_rows=True):
    """aligned_rows: row strides divisible by 16 as well as the pointers, the launch-time
    specialization of widths that are multiples of 16 (vectorized loads); off for odd widths."""
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
    divisible = [a for a in fn.arg_names if signature[a].startswith("*") or (aligned_rows and a.startswith("stride"))]
    on = "".join(k[4] if k.startswith("HAS_") else "rms" for k, v in flags.items() if v) or "plain"
    odd = "" if aligned_rows else ",odd"
    return dict(name=f"{name}[{_TYPE[dtype]},{on},m{block_m}n{block_n}{'' if single else 'loop'}w{warps}{odd}]",
                fn=fn, signature=signature, constexprs=constexprs, num_warps=warps, num_stages=1,
                attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible})


def layer_norm_cases():
    """Every tile config (a function of the row width only) in fp16 with every feature on; fp32
    and bf16 with a single-tile and the looped config; the other flag combinations (no residual/dh,
    weight only, RMS with and without weight, none) with those two configs in fp16, the LayerNorm
    ones with odd row strides (no vectorized row loads). Flags and dtypes change loads and stores,
    not the tile's register shape. The backward's partial-sum reduction in each parameter dtype."""
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
                cases.append(_layer_norm_case(kernel, name, torch.float16, tile, flags, aligned_rows=rms))
    block_n, block_p, warps = layer_norm.SUMS_TILE
    sums = layer_norm.layer_norm_partial_sums_kernel
    for dtype, weight, bias in ((torch.float32, True, True), (torch.float16, True, True), (torch.bfloat16, True, False),
                                (torch.bfloat16, False, True)):
        flags = dict(HAS_WEIGHT=weight, HAS_BIAS=bias, BLOCK_P=block_p, BLOCK_N=block_n)
        signature = {a: ("constexpr" if a in flags else "*fp32" if a.endswith("Partial") else
                         "*" + _TYPE[dtype] if a in ("DW", "DB") else "i32") for a in sums.arg_names}
        on = "".join(k[4] for k in ("HAS_WEIGHT", "HAS_BIAS") if flags[k])
        cases.append(dict(name=f"layer_norm_partial_sums[{_TYPE[dtype]},{on}]", fn=sums, signature=signature,
                          constexprs=flags, num_warps=warps, num_stages=1,
                          attrs={(sums.arg_names.index(a),): [["tt.divisibility", 16]]
                                 for a in ("DWPartial", "DBPartial", "DW", "DB")}))
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
FAMILIES = tuple(FAMILY_CASES)


def compile_cases(family):
    """The compile cases of a kernel family (a name in FAMILIES)."""
    return FAMILY_CASES[family]()
