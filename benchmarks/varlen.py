"""The `varlen` suite: the C++ CPU attention on packed sequences, sliding windows and decoding,
against what PyTorch offers for the same work (speed ratios: PyTorch time / ours, > 1 = ours
faster).

  pack      16 sequences with lengths drawn from 64 to 2048 (fixed seed), packed, through
            `varlen_attn` (causal: window (-1, 0)), against F.scaled_dot_product_attention on the
            same batch padded to the longest (the padding, and causality, as a bool mask; target
            1.5x) and against a loop of one F.sdpa call per sequence (target 1.0x)
  window    a sliding window of 512 keys (window (512, 0)) at N = 16384, against F.sdpa with the
            equivalent (N, N) bool mask (target 10x); peak memory of each, and ours at N/4, N/2, N
  decode    one decoding step from a 32k cache, B=1 H=32 Hk=8 D=128, fp32 and bf16, through
            `scaled_dot_product_attention` (as a generate loop calls it) against
            F.sdpa(enable_gqa=True) (target 1.5x, fp32); and without GQA: 1 and 2 queries (scores
            one dot product at a time), 16 (MKL's products) against 2k-4k keys, and a batch of 8
            single queries against 512 (no target: reported; the models suite's `generate` is
            what a decoding model meets)

Each implementation is checked against the float64 oracle (transformer_fast/reference.py) on a
few query rows first (ours within 2x PyTorch's error plus a floor; a wrong one is reported, not
timed). Timing: `measure.time_interleaved` (round-robin rounds), ratios the median over rounds of
the paired times (`measure.paired_ratio`). Peak memory: `measure.run_measuring_memory` (torch's
CPU allocator under the profiler).
"""
from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from . import cases, measure

CPU = torch.device("cpu")
TARGETS = {"pack vs padded": 1.5, "pack vs loop": 1.0, "window vs bool mask": 10.0, "decode float32": 1.5}


def _time(fns, args, budget=None):
    return measure.time_interleaved(fns, CPU, max_repeats=args.repeats, min_repeats=args.min_repeats,
                                    budget_s=args.budget if budget is None else budget,
                                    min_sample_s=args.min_sample_ms / 1e3, keep_samples=True)


def _check(ours, theirs, exact, dtype):
    """(ok, our error, bound): ours against float64 within 2x PyTorch's error plus a floor."""
    err = (ours.double() - exact).abs().max().item()
    bound = 2 * (theirs.double() - exact).abs().max().item() + cases.CHECK_RTOL[dtype] * max(1.0, exact.abs().max().item())
    return err <= bound, err, bound


def _row(name, times, theirs, ours="ours", **extra):
    ratio = measure.paired_ratio(times, theirs, ours)
    row = {"case": name, "torch_impl": theirs, "torch_ms": times[theirs]["median_ms"],
           "ours_ms": times[ours]["median_ms"], "ratio": ratio, "rounds": times[ours]["samples"],
           "target": TARGETS.get(name), **extra}
    row["met"] = row["target"] is None or ratio >= row["target"]
    print(f"  {name:<22} {theirs:<10} {row['torch_ms']:10.2f} ms  ours {row['ours_ms']:10.2f} ms  ratio {ratio:6.2f}"
          + (f"  (target {row['target']:g}x: {'met' if row['met'] else 'MISSED'})" if row["target"] else ""),
          flush=True)
    return row


# --------------------------------------------------------------------------------------------
# A pack of unequal sequences
# --------------------------------------------------------------------------------------------
def pack(args):
    count, H, D, lo, hi = (4, 2, 16, 8, 64) if args.smoke else (16, 4, 64, 64, 2048)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, N = int(cu[-1]), max(lengths)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    # the same batch padded to the longest sequence, (count, H, N, D), and its bool mask (True = attend)
    padded = [torch.zeros(count, H, N, D) for _ in range(3)]
    for b, n in enumerate(lengths):
        for t, src in zip(padded, (q, k, v)):
            t[b, :, :n] = src[cu[b]:cu[b] + n].transpose(0, 1)
    valid = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    mask = (valid[:, None, :, None] & valid[:, None, None, :]) & torch.ones(N, N, dtype=torch.bool).tril()
    mask = mask | ~valid[:, None, :, None]  # padded query rows attend everything (discarded), no NaN rows
    seqs = [[t[cu[b]:cu[b] + n].transpose(0, 1)[None] for t in (q, k, v)] for b, n in enumerate(lengths)]

    def ours():
        with torch.no_grad():
            return tf.varlen_attn(q, k, v, cu, cu, N, N, window_size=(-1, 0))

    def padded_sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(*padded, attn_mask=mask)

    def loop():
        with torch.no_grad():
            return [F.scaled_dot_product_attention(*s, is_causal=True) for s in seqs]

    result = {"shape": f"{count} sequences of {lo}-{hi} tokens ({T} in all, longest {N}), H={H} D={D}, causal, "
                       "float32", "lengths": lengths}
    # check: the longest sequence's rows against float64
    b = lengths.index(N)
    rows = cases.check_rows(N)
    exact = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, window_size=(-1, 0))
    exact = exact[cu[b]:cu[b] + N][rows]
    ok, err, bound = _check(ours()[cu[b]:cu[b] + N][rows], loop()[b][0].transpose(0, 1)[rows], exact, torch.float32)
    ok_p, err_p, _ = _check(padded_sdpa()[b].transpose(0, 1)[:N][rows], loop()[b][0].transpose(0, 1)[rows], exact,
                            torch.float32)
    result.update(max_error=err, error_bound=bound, status="ok" if ok and ok_p else "wrong")
    if result["status"] != "ok":
        return result
    times = _time({"ours": ours, "padded": padded_sdpa, "loop": loop}, args)
    result["rows"] = [_row("pack vs padded", times, "padded"), _row("pack vs loop", times, "loop")]
    # training on the pack: forward+backward against the loop
    dout = torch.randn(T, H, D, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seq_leaves = [[t.detach().clone().requires_grad_() for t in s] for s in seqs]

    def ours_fwd_bwd():
        out = tf.varlen_attn(*leaves, cu, cu, N, N, window_size=(-1, 0))
        torch.autograd.grad(out, leaves, dout)

    def loop_fwd_bwd():
        for b, s in enumerate(seq_leaves):
            out = F.scaled_dot_product_attention(*s, is_causal=True)
            torch.autograd.grad(out, s, dout[cu[b]:cu[b + 1]].transpose(0, 1)[None])

    times = _time({"ours": ours_fwd_bwd, "loop": loop_fwd_bwd}, args)
    result["rows"].append(_row("pack fwd+bwd vs loop", times, "loop"))
    return result


# --------------------------------------------------------------------------------------------
# A sliding window at 16k
# --------------------------------------------------------------------------------------------
def window(args):
    N, H, D, W = (256, 2, 16, 32) if args.smoke else (16384, 4, 64, 512)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, H, N, D, generator=g) for _ in range(3))
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    mask = (j <= i) & (j >= i - W)

    def ours():
        with torch.no_grad():
            return tf.scaled_dot_product_attention(q, k, v, window_size=(W, 0))

    def bool_mask():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    rows = cases.check_rows(N)
    exact = reference.scaled_dot_product_attention(q[:, :, rows].double(), k.double(), v.double(),
                                                   attn_mask=mask[rows])
    _, ours_mem, out = measure.run_measuring_memory(ours, CPU)
    _, torch_mem, theirs = measure.run_measuring_memory(bool_mask, CPU)
    ok, err, bound = _check(out[:, :, rows], theirs[:, :, rows], exact, torch.float32)
    result = {"shape": f"B=1 H={H} N={N} D={D}, window ({W}, 0), float32", "max_error": err, "error_bound": bound,
              "status": "ok" if ok else "wrong", "peak_memory_bytes": {"ours": ours_mem, "bool mask": torch_mem},
              "mask_bytes": mask.numel()}
    if not ok:
        return result
    times = _time({"ours": ours, "bool mask": bool_mask}, args)
    result["rows"] = [_row("window vs bool mask", times, "bool mask",
                           peak_memory_mib={k_: (m or 0) / 2**20 for k_, m in result["peak_memory_bytes"].items()})]
    # Memory grows linearly with N: the peak RSS of a fresh process over one forward+backward at
    # N/4, N/2 and N (RSS sees the kernels' own tile buffers, which torch's allocator does not).
    result["peak_rss_growth_mib_by_n"] = _peak_rss_growth_mib((N // 4, N // 2, N), H, D, W)
    print("  peak RSS growth of one forward+backward, ours: "
          + ", ".join(f"N={n}: {m:.0f} MiB" for n, m in result["peak_rss_growth_mib_by_n"].items())
          + f"; the bool mask alone {mask.numel() / 2**20:.0f} MiB", flush=True)
    return result


_RSS_CODE = """
import sys, torch, transformer_fast as tf
n, h, d, w = map(int, sys.argv[1:])
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
dout = torch.randn(1, h, n, d)
tf.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], window_size=(w, 0)).sum().backward()
before = hwm()
tf.scaled_dot_product_attention(q, k, v, window_size=(w, 0)).backward(dout)
print(hwm() - before)
"""


def _peak_rss_growth_mib(lengths, heads, head_dim, window):
    """{str(n): MiB} for each length, each in a process of its own (run side by side: a peak RSS
    is per process)."""
    procs = {n: subprocess.Popen([sys.executable, "-c", _RSS_CODE, str(n), str(heads), str(head_dim), str(window)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in lengths}
    growth = {}
    for n, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"peak RSS at N={n} failed:\n{err[-2000:]}")
        growth[str(n)] = float(out)
    return growth


# --------------------------------------------------------------------------------------------
# One decoding step
# --------------------------------------------------------------------------------------------
def decode(args):
    """One decoding step per shape: (case, B, H, Hk, Nq, Nk, D); Hk < H is grouped-query attention."""
    shapes = ([("decode", 1, 4, 2, 1, 256, 16), ("decode MHA", 2, 4, 4, 2, 64, 24)] if args.smoke else
              [("decode", 1, 32, 8, 1, 32768, 128), ("decode MHA", 1, 8, 8, 1, 4096, 128),
               ("decode MHA", 1, 8, 8, 2, 2048, 128), ("decode MHA", 1, 8, 8, 16, 2048, 64),
               ("decode MHA", 8, 8, 8, 1, 512, 64)])
    rows = []
    for case, B, H, Hk, Nq, N, D in shapes:
        for name in ("float32", "bfloat16"):
            dtype = getattr(torch, name)
            g = torch.Generator().manual_seed(args.seed)
            q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
            k, v = (torch.randn(B, Hk, N, D, generator=g).to(dtype) for _ in range(2))

            def ours():
                with torch.no_grad():
                    return tf.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            def theirs():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            exact = reference.scaled_dot_product_attention(q.double(), k.double(), v.double())
            ok, err, bound = _check(ours(), theirs(), exact, dtype)
            row = {"dtype": name, "shape": f"B={B} H={H} Hk={Hk} Nq={Nq} Nk={N} D={D}", "max_error": err,
                   "error_bound": bound, "status": "ok" if ok else "wrong"}
            if not ok:
                rows.append({**row, "case": f"{case} {name}"})
                continue
            times = _time({"ours": ours, "sdpa": theirs}, args)
            rows.append({**row, **_row(f"{case} {name}", times, "sdpa")})
    return {"rows": rows}


def run(args):
    print(f"  {torch.get_num_threads()} threads", flush=True)
    return {"pack": pack(args), "window": window(args), "decode": decode(args), "targets": TARGETS}


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    lines += ["Speed ratios: PyTorch time / ours (median over interleaved rounds of the paired times).", "",
              "| case | shape | PyTorch | PyTorch ms | ours ms | ratio | target | check error / bound |",
              "|---|---|---|---:|---:|---:|---|---:|"]
    parts = [(body["pack"], body["pack"].get("shape")), (body["window"], body["window"].get("shape"))]
    parts += [(r, r.get("shape")) for r in body["decode"]["rows"]]
    for part, shape in parts:
        if part.get("status") != "ok":
            lines.append(f"| {part.get('case', '')} | {shape} | | | | WRONG | | {part['max_error']:.1e} / "
                         f"{part['error_bound']:.1e} |")
            continue
        for r in part.get("rows", [part]):
            target = f"{r['target']:g}x {'met' if r['met'] else '**missed**'}" if r.get("target") else ""
            lines.append(f"| {r['case']} | {shape} | {r['torch_impl']} | {r['torch_ms']:.2f} | {r['ours_ms']:.2f} | "
                         f"{r['ratio']:.2f} | {target} | {part['max_error']:.1e} / {part['error_bound']:.1e} |")
    w = body["window"]
    if w.get("status") == "ok":
        mem = w["peak_memory_bytes"]
        lines += ["", f"Window: peak memory above the inputs, ours {(mem['ours'] or 0) / 2**20:.1f} MiB, F.sdpa with "
                      f"the bool mask {(mem['bool mask'] or 0) / 2**20:.1f} MiB (the mask itself, an input, "
                      f"{w['mask_bytes'] / 2**20:.0f} MiB). Peak RSS growth of one forward+backward of ours by N "
                  "(a fresh process; RSS also sees the kernels' tile buffers): "
                  + ", ".join(f"{n}: {m:.0f} MiB" for n, m in w["peak_rss_growth_mib_by_n"].items()) + "."]
    if body["pack"].get("lengths"):
        lines += ["", f"Pack lengths: {body['pack']['lengths']}."]
    return "\n".join(lines) + "\n"
