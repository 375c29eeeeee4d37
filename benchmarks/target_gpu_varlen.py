"""target_gpu_varlen: the Triton attention's packed, decoding and windowed paths on one GPU.

    python -m benchmarks.run --only target_gpu_varlen        # also part of `--only gpu`

Three groups of cases, each checked before it is timed (relative Frobenius error of our output
against the other implementation's; a float64 reference on a few rows where the other is ours):

1. varlen: a pack of sequences of 64 ... 4096 tokens (16k tokens in all, GQA 32/8 heads, head dim
   128, bf16), full and causal (window (-1, 0)), forward and forward+backward: ours
   (`tf.varlen_attn`) against `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside
   torch);
2. decode: one query per sequence (B = 1, 32 query and 8 key heads, head dim 128) against a 32k
   cache, dense and paged (16-token pages in a shuffled pool): our kernel with the key split
   chosen automatically against the same kernel unsplit (num_splits=1) and against torch's SDPA
   (flash backend, the cache as a dense tensor);
3. window: a 4k sliding causal window at N = 32k (B = 1, 16 heads, head dim 128, bf16), forward
   and forward+backward, against our full causal attention at the same size (the window's cost
   should be about (4k / 16k) of causal's) and against torch's flash SDPA causal.

Timing as target_gpu_attention: `triton.testing.do_bench` medians, alternating order, `--gpu-rounds`
rounds, the ratio = their time / our time (> 1: ours faster).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import transformer_fast as tf

from .target_gpu import _rel_err, time_pair


def _pack(total, lo, hi, generator):
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def _cu(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.cuda()


def varlen_cases(args):
    from torch.nn.attention.varlen import varlen_attn as torch_varlen

    g = torch.Generator().manual_seed(args.seed)
    H, Hk, D, dtype = 32, 8, 128, torch.bfloat16
    lengths = _pack(args.tokens, args.min_len, args.max_len, g)
    cu, max_len = _cu(lengths), max(lengths)
    T = sum(lengths)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(T, Hk, D, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn(T, H, D, device="cuda", dtype=dtype)
    rows = []
    for window in ((-1, -1), (-1, 0)):
        def ours(q, k, v):
            return tf.varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window, enable_gqa=True)

        def theirs(q, k, v):
            return torch_varlen(q, k, v, cu, cu, max_len, max_len, window_size=window, enable_gqa=True)

        err = _rel_err(ours(q, k, v), theirs(q, k, v))
        for passes in args.passes:
            if passes == "fwd":
                pair = (lambda: theirs(q, k, v)), (lambda: ours(q, k, v))
            else:
                qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                pair = ((lambda: torch.autograd.grad(theirs(qg, kg, vg), (qg, kg, vg), dout)),
                        (lambda: torch.autograd.grad(ours(qg, kg, vg), (qg, kg, vg), dout)))
            t_theirs, t_ours, ratio = time_pair(*pair, args.rounds)
            rows.append(dict(group="varlen", case=f"{len(lengths)} seqs, {T} tokens, window {window}",
                             against="torch varlen_attn", passes=passes, theirs_ms=t_theirs * 1e3,
                             ours_ms=t_ours * 1e3, ratio=ratio, err=err))
            _print(rows[-1])
    return rows


def decode_cases(args):
    B, H, Hk, D, dtype = 1, 32, 8, 128, torch.bfloat16
    N, page = args.cache, 16
    q = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hk, N, D, device="cuda", dtype=dtype) for _ in range(2))
    rows = []

    def ours(splits):
        return lambda: tf.varlen_attn(q[:, :, 0].reshape(B, H, D), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                      cu_q, cu_k, 1, N, enable_gqa=True, num_splits=splits)

    cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    exact = torch.softmax((q[0].double() @ k[0].double().repeat_interleave(H // Hk, 0).transpose(-2, -1)) * D ** -0.5,
                          -1) @ v[0].double().repeat_interleave(H // Hk, 0)
    auto, single = ours(None), ours(1)

    def sdpa_flash():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:  # torch's flash backend with GQA where this torch has it, else its own choice
        sdpa_flash()
        sdpa, sdpa_name = sdpa_flash, "torch SDPA flash"
    except RuntimeError:
        sdpa, sdpa_name = (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "torch SDPA"

    err = _rel_err(auto()[0].float(), exact[:, 0].float())
    for name, other in (("ours unsplit (num_splits=1)", single), (sdpa_name, sdpa)):
        t_theirs, t_ours, ratio = time_pair(other, auto, args.rounds)
        rows.append(dict(group="decode", case=f"B=1, 1 query, cache {N}, dense", against=name, passes="fwd",
                         theirs_ms=t_theirs * 1e3, ours_ms=t_ours * 1e3, ratio=ratio, err=err))
        _print(rows[-1])
    # the same cache in shuffled 16-token pages
    pages = N // page
    order = torch.randperm(pages, device="cuda")
    pool_k = torch.empty(pages, page, Hk, D, device="cuda", dtype=dtype)
    pool_v = torch.empty_like(pool_k)
    pool_k[order] = k[0].transpose(0, 1).reshape(pages, page, Hk, D)
    pool_v[order] = v[0].transpose(0, 1).reshape(pages, page, Hk, D)
    table = order[None].to(torch.int32)
    used = torch.tensor([N], dtype=torch.int32, device="cuda")

    def paged(splits):
        return lambda: tf.varlen_attn(q[:, :, 0].reshape(B, H, D), pool_k, pool_v, cu_q, None, 1, N, enable_gqa=True,
                                      seqused_k=used, block_table=table, num_splits=splits)

    err = _rel_err(paged(None)(), auto())
    for name, other in (("ours paged unsplit (num_splits=1)", paged(1)), ("ours dense, split", auto)):
        t_theirs, t_ours, ratio = time_pair(other, paged(None), args.rounds)
        rows.append(dict(group="decode", case=f"B=1, 1 query, cache {N}, paged ({page})", against=name, passes="fwd",
                         theirs_ms=t_theirs * 1e3, ours_ms=t_ours * 1e3, ratio=ratio, err=err))
        _print(rows[-1])
    return rows


def window_cases(args):
    B, H, D, dtype, N, W = 1, 16, 128, torch.bfloat16, args.window_n, args.window
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4))

    def windowed(q, k, v):
        return tf.scaled_dot_product_attention(q, k, v, window_size=(W, 0))

    def causal(q, k, v):
        return tf.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows_ = torch.tensor([0, W, N // 2, N - 1], device="cuda")
    s = q[0, 0, rows_].double() @ k[0, 0].double().T * D ** -0.5
    j = torch.arange(N, device="cuda")
    s = s.masked_fill((j[None] > rows_[:, None]) | (j[None] < rows_[:, None] - W), float("-inf"))
    err = _rel_err(windowed(q, k, v)[0, 0, rows_].float(), (torch.softmax(s, -1) @ v[0, 0].double()).float())
    rows = []
    for name, other in (("ours full causal", causal), ("torch SDPA flash causal", sdpa)):
        for passes in args.passes:
            if passes == "fwd":
                pair = (lambda: other(q, k, v)), (lambda: windowed(q, k, v))
            else:
                qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
                pair = ((lambda: torch.autograd.grad(other(qg, kg, vg), (qg, kg, vg), dout)),
                        (lambda: torch.autograd.grad(windowed(qg, kg, vg), (qg, kg, vg), dout)))
            t_theirs, t_ours, ratio = time_pair(*pair, args.rounds)
            rows.append(dict(group="window", case=f"window ({W}, 0), N={N}, B x H = {B} x {H}", against=name,
                             passes=passes, theirs_ms=t_theirs * 1e3, ours_ms=t_ours * 1e3, ratio=ratio, err=err))
            _print(rows[-1])
    return rows


def _print(r):
    print(f"  {r['group']:<7} {r['case']:<48} {r['passes']:<7} vs {r['against']:<34} theirs {r['theirs_ms']:8.3f} ms  "
          f"ours {r['ours_ms']:8.3f} ms  ratio {r['ratio']:.2f}  err {r['err']:.1e}", flush=True)


def markdown(result):
    from .report import header_block

    body = result["result"]
    lines = header_block(result) + [
        "ratio = their time / our time (median of interleaved do_bench rounds; > 1 = ours faster). "
        "err: relative Frobenius error of our output against theirs (decode dense, window: against float64 rows).",
        "", "| group | case | pass | against | their ms | our ms | ratio | err |", "|---|---|---|---|---|---|---|---|"]
    for r in body["results"]:
        lines.append(f"| {r['group']} | {r['case']} | {r['passes']} | {r['against']} | {r['theirs_ms']:.3f} "
                     f"| {r['ours_ms']:.3f} | {r['ratio']:.2f} | {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def run(args):
    """The three groups; returns the suite's result body (written by benchmarks.run)."""
    if not torch.cuda.is_available():
        raise SystemExit("target_gpu_varlen needs a CUDA GPU")
    torch.manual_seed(args.seed)
    grid = argparse.Namespace(rounds=args.gpu_rounds, seed=args.seed, passes=list(args.passes), tokens=16384,
                              min_len=64, max_len=4096, cache=32768, window_n=32768, window=4096)
    if args.smoke:
        grid.tokens, grid.min_len, grid.max_len, grid.cache, grid.window_n, grid.window, grid.rounds = \
            512, 16, 128, 1024, 1024, 128, 1
    results = varlen_cases(grid) + decode_cases(grid) + window_cases(grid)
    return {"args": vars(grid), "results": results}
