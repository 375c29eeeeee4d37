"""The `linear_state` suite: causal linear attention prefill with a carried state costs no more
than without one (the C++ kernels, on the CPU).

A carried state is where the kernels' chunk recurrence starts (the initial state) and what it
ends with (the final state), so carrying one should cost nothing measurable. For B=1 H=8 N=4096
D=64 float32, forward (without grad) and forward+backward (gradients of q, k, v and, with a
state, of the initial state, for upstream gradients of the output and of the final state):

  no state        linear_attention(q, k, v, is_causal=True)
  state in, out   the same call with an initial state and output_final_state=True
  two calls       the prefill cut in half (q, k, v given as halves, as a chunked prefill has
                  them), the second call starting from the state the first left

Every variant is checked first against the float64 oracle (its output on 12 query rows and its
final state; at most 2x the error of the same O(N^2) formula in float32, plus a floor). Timing:
`measure.time_interleaved` (round-robin, so a slow phase of a shared machine hits every variant);
each ratio is the median over rounds of the two times of that round. One thread unless --threads
says otherwise: the kernels split the heads over the threads alike with or without a state, and
on a shared machine the second call's parallel region would time how long a descheduled thread
keeps the other waiting, not the state. Target: each variant with a state at most 1.02x the time
without one (the 2% allow for timing noise).
"""
from __future__ import annotations

import torch

import transformer_fast as tf
from transformer_fast import reference

from . import cases, measure

CPU = torch.device("cpu")
TARGET_RATIO = 1.02
VARIANTS = ("no state", "state in, out", "two calls")


def _inputs(B, H, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    earlier_k, earlier_v = torch.randn(B, H, 64, D, generator=g), torch.randn(B, H, 64, D, generator=g)
    _, (S0, z0) = reference.linear_attention(earlier_k[:, :, :0], earlier_k, earlier_v, output_final_state=True)
    return q, k, v, S0, z0


def _halves(t):
    half = t.shape[2] // 2
    return t[:, :, :half].contiguous(), t[:, :, half:].contiguous()


def _call(variant, q, k, v, S0, z0):
    """The outputs: [out] without a state, [out, final S, final z] with one. "two calls" takes q, k,
    v as (first half, second half) pairs, as a chunked prefill has them, and returns [the first
    half's out, the second's, final S, final z]."""
    if variant == "no state":
        return [tf.linear_attention(q, k, v, is_causal=True, backend="cpp")]
    if variant == "state in, out":
        out, state = tf.linear_attention(q, k, v, is_causal=True, initial_state=(S0, z0), output_final_state=True,
                                         backend="cpp")
        return [out, *state]
    (q1, q2), (k1, k2), (v1, v2) = q, k, v
    first, state = tf.linear_attention(q1, k1, v1, is_causal=True, initial_state=(S0, z0), output_final_state=True,
                                       backend="cpp")
    second, state = tf.linear_attention(q2, k2, v2, is_causal=True, initial_state=state, output_final_state=True,
                                        backend="cpp")
    return [first, second, *state]


def _args(variant, q, k, v):
    return (q, k, v) if variant != "two calls" else tuple(_halves(t) for t in (q, k, v))


def _oracle(q, k, v, state, dtype, rows):
    """The O(N^2) formula in `dtype`, head by head (bounded memory): output rows, final S, z."""
    outs, Ss, zs = [], [], []
    for h in range(q.shape[1]):
        part = [t[:, h:h + 1].to(dtype) for t in (q, k, v)]
        initial = None if state is None else tuple(t[:, h:h + 1].to(dtype) for t in state)
        out, (S, z) = reference.linear_attention(*part, is_causal=True, initial_state=initial,
                                                 output_final_state=True)
        outs.append(out[:, :, rows])
        Ss.append(S)
        zs.append(z)
    return torch.cat(outs, 1), torch.cat(Ss, 1), torch.cat(zs, 1)


def check(variant, q, k, v, S0, z0, rows):
    """(ok, max error, bound): the output rows and the final state against float64."""
    with torch.no_grad():
        outs = _call(variant, *_args(variant, q, k, v), S0, z0)
    if variant == "two calls":
        outs = [torch.cat(outs[:2], dim=2), *outs[2:]]
    state = None if variant == "no state" else (S0, z0)
    exact = _oracle(q, k, v, state, torch.float64, rows)
    plain = _oracle(q, k, v, state, torch.float32, rows)
    worst = (0.0, 0.0, 1.0)
    for mine, ref, fp32 in zip([outs[0][:, :, rows], *outs[1:]], exact, plain):
        err = (mine.double() - ref).abs().max().item()
        bound = 2 * (fp32.double() - ref).abs().max().item() + cases.CHECK_RTOL[torch.float32] * max(
            1.0, ref.abs().max().item())
        if not err <= bound:
            return False, err, bound
        worst = max(worst, (err / bound, err, bound))
    return True, worst[1], worst[2]


def _timed(variant, q, k, v, S0, z0, backward, upstream):
    """A callable of one forward (without grad) or forward+backward (gradients of q, k, v and, with
    a state, of the initial state; upstream gradients of the output and the final state)."""
    args = _args(variant, q, k, v)
    if not backward:
        def forward():
            with torch.no_grad():
                _call(variant, *args, S0, z0)
        return forward
    leaves = [tuple(t.detach().clone().requires_grad_() for t in a) if isinstance(a, tuple)
              else a.detach().clone().requires_grad_() for a in args]
    leaves += [t.detach().clone().requires_grad_() for t in (S0, z0)]
    flat = [t for a in leaves for t in (a if isinstance(a, tuple) else (a,))]
    if variant == "no state":
        flat, grads = flat[:3], upstream[:1]
    elif variant == "two calls":
        grads = [*_halves(upstream[0]), *upstream[1:]]
    else:
        grads = upstream

    def forward_backward():
        torch.autograd.grad(_call(variant, *leaves), flat, grads)
    return forward_backward


def run(args):
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or 1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args):
    B, H, N, D = (1, 2, 64, 16) if args.smoke else (1, 8, 4096, 64)
    q, k, v, S0, z0 = _inputs(B, H, N, D, args.seed)
    rows = cases.check_rows(N)
    result = {"shape": f"B={B} H={H} N={N} D={D} causal float32", "threads": torch.get_num_threads(),
              "target_ratio": TARGET_RATIO, "checks": {}, "passes": {}}
    for variant in VARIANTS:
        ok, err, bound = check(variant, q, k, v, S0, z0, rows)
        result["checks"][variant] = {"ok": ok, "max_error": err, "error_bound": bound}
        print(f"  check {variant:<14} error {err:.2e} bound {bound:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    if not all(c["ok"] for c in result["checks"].values()):
        result["status"] = "wrong"
        return result
    result["status"] = "ok"
    g = torch.Generator().manual_seed(args.seed + 1)
    upstream = [torch.randn(s, generator=g) for s in ((B, H, N, D), (B, H, D, D), (B, H, D))]
    for name, backward in (("forward", False), ("forward+backward", True)):
        fns = {variant: _timed(variant, q, k, v, S0, z0, backward, upstream) for variant in VARIANTS}
        times = measure.time_interleaved(fns, CPU, max_repeats=args.repeats, min_repeats=args.min_repeats,
                                         budget_s=args.budget, min_sample_s=args.min_sample_ms / 1e3,
                                         keep_samples=True)
        row = {variant: {"ms": times[variant]["median_ms"], "rounds": times[variant]["samples"]} for variant in VARIANTS}
        for variant in VARIANTS[1:]:
            ratio = 1 / measure.paired_ratio(times, "no state", variant)  # time with a state / time without
            row[variant].update(ratio_to_no_state=ratio, met=ratio <= TARGET_RATIO)
        result["passes"][name] = row
        print(f"  {name:<17} no state {row['no state']['ms']:.2f} ms; "
              + "; ".join(f"{variant} {row[variant]['ms']:.2f} ms ({row[variant]['ratio_to_no_state']:.3f}x, "
                          f"{'met' if row[variant]['met'] else 'MISSED'})" for variant in VARIANTS[1:]), flush=True)
    return result


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    threads = "one thread" if body["threads"] == 1 else f"{body['threads']} threads"
    lines += [f"Causal linear attention prefill (C++ kernels), {body['shape']}, {threads}: with a "
              f"carried state against without one. Target: at most {body['target_ratio']:g}x the time without a state. Ratios are medians "
              f"over interleaved rounds of the paired times (time with a state / time without).", ""]
    lines += ["| variant | check error / bound |", "|---|---:|"]
    lines += [f"| {v} | {c['max_error']:.1e} / {c['error_bound']:.1e}{'' if c['ok'] else ' WRONG'} |"
              for v, c in body["checks"].items()]
    if body["status"] != "ok":
        return "\n".join(lines + ["", "A variant failed its check: not timed."]) + "\n"
    lines += ["", "| pass | no state ms | state in, out ms | ratio | two calls ms | ratio |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in body["passes"].items():
        cells = [f"{row['no state']['ms']:.2f}"]
        for variant in VARIANTS[1:]:
            r = row[variant]
            cells += [f"{r['ms']:.2f}", f"{r['ratio_to_no_state']:.3f}" + ("" if r["met"] else " (missed)")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
