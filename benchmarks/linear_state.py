"""The `linear_state` suite: causal linear attention prefill with a carried state costs no more
than without one (the C++ kernels, on the CPU).

A carried state is where the kernels' chunk recurrence starts (the initial state) and what it
ends with (the final state), so carrying one should cost nothing measurable. For B=1 H=8 N=4096
D=64 float32, forward (without grad) and forward+backward (gradients of q, k, v and, with a
state, of the initial state, for upstream gradients of the output and of the final state):

  no state        linear_attention(q, k, v, is_causal=True)
  state in, out   the same call with an initial state and output_final_state=True
  two calls       the prefill cut in half, the second call starting from the state the first left

Every variant is checked first against the float64 oracle (its output on 12 query rows and its
final state; at most 2x the error of the same O(N^2) formula in float32, plus a floor). Timing:
`measure.time_interleaved` (round-robin, so a slow phase of a shared machine hits every variant);
each ratio is the median over rounds of the two times of that round. Target: each variant with a
state at most 1.02x the time without one (the 2% allow for timing noise).
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


def _call(variant, q, k, v, S0, z0):
    """(out, final S, final z); the final state is None without a state."""
    if variant == "no state":
        return tf.linear_attention(q, k, v, is_causal=True, backend="cpp"), None, None
    if variant == "state in, out":
        out, state = tf.linear_attention(q, k, v, is_causal=True, initial_state=(S0, z0), output_final_state=True,
                                         backend="cpp")
        return out, state.S, state.z
    half = q.shape[2] // 2
    first, state = tf.linear_attention(q[:, :, :half], k[:, :, :half], v[:, :, :half], is_causal=True,
                                       initial_state=(S0, z0), output_final_state=True, backend="cpp")
    second, state = tf.linear_attention(q[:, :, half:], k[:, :, half:], v[:, :, half:], is_causal=True,
                                        initial_state=state, output_final_state=True, backend="cpp")
    return torch.cat([first, second], dim=2), state.S, state.z


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
    state = None if variant == "no state" else (S0, z0)
    with torch.no_grad():
        out, S, z = _call(variant, q, k, v, S0, z0)
    exact = _oracle(q, k, v, state, torch.float64, rows)
    plain = _oracle(q, k, v, state, torch.float32, rows)
    got = (out[:, :, rows], S, z) if S is not None else (out[:, :, rows],)
    worst = (0.0, 0.0, 1.0)
    for mine, ref, fp32 in zip(got, exact, plain):
        err = (mine.double() - ref).abs().max().item()
        bound = 2 * (fp32.double() - ref).abs().max().item() + cases.CHECK_RTOL[torch.float32] * max(
            1.0, ref.abs().max().item())
        if not err <= bound:
            return False, err, bound
        worst = max(worst, (err / bound, err, bound))
    return True, worst[1], worst[2]


def _timed(variant, q, k, v, S0, z0, backward, upstream):
    if not backward:
        def forward():
            with torch.no_grad():
                _call(variant, q, k, v, S0, z0)
        return forward
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if variant != "no state":
        leaves += [t.detach().clone().requires_grad_() for t in (S0, z0)]

    def forward_backward():
        outs = [o for o in _call(variant, *leaves[:3], *(leaves[3:] or (S0, z0))) if o is not None]
        torch.autograd.grad(outs, leaves, upstream[:len(outs)])
    return forward_backward


def run(args):
    B, H, N, D = (1, 2, 64, 16) if args.smoke else (1, 8, 4096, 64)
    q, k, v, S0, z0 = _inputs(B, H, N, D, args.seed)
    rows = cases.check_rows(N)
    result = {"shape": f"B={B} H={H} N={N} D={D} causal float32", "target_ratio": TARGET_RATIO, "checks": {},
              "passes": {}}
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
    lines += [f"Causal linear attention prefill (C++ kernels), {body['shape']}: with a carried state against "
              f"without one. Target: at most {body['target_ratio']:g}x the time without a state. Ratios are medians "
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
