"""Context-parallel softmax attention (transformer_fast.distributed.attention) on gloo ranks,
against the float64 whole-sequence reference (transformer_fast.reference).

Each spawn runs many cases (spawning and importing cost more than the small problems): every
rank builds the whole inputs from one seed, takes its shard, runs the context-parallel call
and its backward, and compares its shard of out, lse, dq, dk, dv (and the ranks' summed dsinks)
with the reference's, within twice the reference's own error in the same dtype (tests/helpers.py).
"""
import pytest
import torch

from distributed_launch import run_ranks
from transformer_fast.distributed import attention as cp
from transformer_fast.distributed import plan as cp_plan
from transformer_fast.distributed import ring
from transformer_fast.distributed import varlen as cp_varlen
from transformer_fast.distributed.sequence import shard_packed, shard_positions, shard_sequence, unshard_sequence

MODES = ("ring", "all_gather", "ulysses")
LAYOUTS = ("head_tail", "contiguous")


# The device of the context-parallel calls: the CPU (gloo), or each rank's GPU (NCCL).
_DEVICE = torch.device("cpu")


def _on_device(kw):
    return {k: (v.to(_DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _close(actual, ref64, ref_lowp, what, atol):
    err = (actual.double().cpu() - ref64).abs().max().item() if actual.numel() else 0.0
    ref_err = (ref_lowp.double() - ref64).abs().max().item() if actual.numel() else 0.0
    assert err <= 2 * ref_err + atol, f"{what}: error {err:.3e} > 2 x {ref_err:.3e} + {atol:.0e}"


_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}


def _reference(q, k, v, do, sinks, dtype, causal, kw):
    """out, lse, dq, dk, dv, dsinks of the whole sequence on q.. rounded to dtype, computed in dtype."""
    from transformer_fast import reference
    ins = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    s = None if sinks is None else sinks.detach().clone().to(stats).requires_grad_()
    out, lse = reference.scaled_dot_product_attention(*ins, is_causal=causal, sinks=s, return_lse=True, **kw)
    out.backward(do.to(dtype))
    return out, lse, ins[0].grad, ins[1].grad, ins[2].grad, (None if s is None else s.grad)


def _dense_case(rank, w, group, mode, layout, causal, dtype=torch.float32, chunk=3, H=4, Hk=2, D=12, Dv=8,
                sinks=False, **kw):
    g = torch.Generator().manual_seed(1234)
    N = chunk * (2 * w if layout == "head_tail" else w)
    B = 2
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, N, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float64).float()
    rounded = [t.to(dtype).double() for t in (q, k, v, do)]
    ref64 = _reference(*rounded, s, torch.float64, causal, kw)
    ref_lowp = _reference(*rounded, s, dtype, causal, kw)
    sh = lambda t: shard_sequence(t, group, 2, layout)  # noqa: E731
    local = [sh(t).to(_DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    ls = None if s is None else s.float().to(_DEVICE).requires_grad_()
    out, lse = cp.context_parallel_attention(*local, group, mode=mode, layout=layout, is_causal=causal,
                                             enable_gqa=H != Hk, sinks=ls, return_lse=True, **_on_device(kw))
    out.backward(sh(do).to(_DEVICE, dtype))
    lse = lse.cpu()
    what = f"{mode} {layout} causal={causal} {dtype} {sorted(kw)} sinks={sinks} w={w}"
    atol = _ATOL[dtype]
    _close(out, sh(ref64[0]), sh(ref_lowp[0]), f"{what}: out", atol)
    lse_ref = sh(ref64[1].unsqueeze(-1)).squeeze(-1)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), f"{what}: lse's empty rows"
    finite = torch.isfinite(lse_ref)
    _close(lse[finite], lse_ref[finite], sh(ref_lowp[1].unsqueeze(-1)).squeeze(-1)[finite], f"{what}: lse", atol)
    for name, t, r64, rl in zip(("dq", "dk", "dv"), local, ref64[2:5], ref_lowp[2:5]):
        _close(t.grad, sh(r64), sh(rl), f"{what}: {name}", atol)
    if sinks:
        assert ls.grad is not None, f"{what}: no gradient for sinks"
        dsinks = ls.grad.clone()
        torch.distributed.all_reduce(dsinks, group=group)
        _close(dsinks, ref64[5], ref_lowp[5], f"{what}: dsinks (summed over ranks)", atol)


def _positional_case(rank, w, group, mode, layout, causal, **kw):
    """Window/ALiBi: every mode places each block's queries (the kernel ops' query_offset)."""
    _dense_case(rank, w, group, mode, layout, causal, **kw)


def _varlen_case(rank, w, group, causal, lengths_q, lengths_k=None, H=4, Hk=2, D=12, Dv=8, sinks=False, **kw):
    from transformer_fast import reference
    g = torch.Generator().manual_seed(99)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    cq = torch.tensor([0] + lengths_q, dtype=torch.int64).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lengths_k, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cq[-1]), H, D, generator=g, dtype=torch.float64)
    k = torch.randn(int(ck[-1]), Hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(int(ck[-1]), Hk, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(int(cq[-1]), H, Dv, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float64).float()
    window = kw.pop("window_size", None)
    ref_window = (-1, 0) if causal and window is None else window
    if causal and window is not None:
        ref_window = (window[0], 0 if window[1] < 0 else min(window[1], 0))
    refs = []
    for dtype in (torch.float64, torch.float32):
        ins = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
        rs = None if s is None else s.clone().to(dtype).requires_grad_()
        rkw = dict(kw)
        if "alibi_slopes" in rkw:
            rkw["alibi_slopes"] = rkw["alibi_slopes"].to(dtype)
        out, lse = reference.varlen_attention(*ins, cq, ck, window_size=ref_window, sinks=rs, return_lse=True, **rkw)
        out.backward(do.to(dtype))
        refs.append((out, lse, *(t.grad for t in ins), None if rs is None else rs.grad))
    local_q = [shard_packed(t, cq, group)[0].to(_DEVICE, torch.float32).requires_grad_() for t in (q,)]
    local_kv = [shard_packed(t, ck, group)[0].to(_DEVICE, torch.float32).requires_grad_() for t in (k, v)]
    ls = None if s is None else s.float().to(_DEVICE).requires_grad_()
    out, lse = cp_varlen.context_parallel_varlen_attn(local_q[0], *local_kv, cq.to(_DEVICE), ck.to(_DEVICE), max(lengths_q),
                                               max(lengths_k), group, is_causal=causal, enable_gqa=H != Hk, sinks=ls,
                                               window_size=window, return_lse=True, **_on_device(kw))
    out.backward(shard_packed(do, cq, group)[0].to(_DEVICE, torch.float32))
    lse = lse.cpu()
    what = f"varlen causal={causal} {lengths_q}/{lengths_k} {sorted(kw)} window={window} sinks={sinks} w={w}"
    shq = lambda t: shard_packed(t, cq, group)[0]  # noqa: E731
    shk = lambda t: shard_packed(t, ck, group)[0]  # noqa: E731
    _close(out, shq(refs[0][0]), shq(refs[1][0]), f"{what}: out", 1e-5)
    lse_ref = shq(refs[0][1].t()).t()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), f"{what}: lse's empty rows"
    finite = torch.isfinite(lse_ref)
    _close(lse[finite], lse_ref[finite], shq(refs[1][1].t()).t()[finite], f"{what}: lse", 1e-5)
    _close(local_q[0].grad, shq(refs[0][2]), shq(refs[1][2]), f"{what}: dq", 1e-5)
    for name, t, i in (("dk", local_kv[0], 3), ("dv", local_kv[1], 4)):
        _close(t.grad, shk(refs[0][i]), shk(refs[1][i]), f"{what}: {name}", 1e-5)
    if sinks:
        dsinks = ls.grad.clone()
        torch.distributed.all_reduce(dsinks, group=group)
        _close(dsinks, refs[0][5], refs[1][5], f"{what}: dsinks (summed over ranks)", 1e-5)


def _communication_case(rank, w, group):
    """The ring sends exactly w - 1 key/value blocks forward (and w - 1 again plus w dK/dV
    accumulators backward), and every mode's bytes match plan.bytes_sent_per_rank."""
    B, H, Hk, n, D, Dv = 1, 2 * w, w, 6, 8, 4
    for mode in MODES:
        q = torch.randn(B, H, n, D, requires_grad=True)
        k = torch.randn(B, Hk, n, D, requires_grad=True)
        v = torch.randn(B, Hk, n, Dv, requires_grad=True)
        cp_plan.reset_communication_counters()
        out = cp.context_parallel_attention(q, k, v, group, mode=mode, is_causal=True, enable_gqa=True)
        forward = cp_plan.communication_counters()
        out.sum().backward()
        both = cp_plan.communication_counters()
        if mode == "ring":
            assert forward == {("ring", "forward", "key/value"): [w - 1, (w - 1) * B * Hk * n * (D + Dv) * 4]}
            assert both[("ring", "backward", "key/value")][0] == w - 1
            assert both[("ring", "backward", "dK/dV")][0] == w
        sent = lambda counters: sum(b for _, b in counters.values())  # noqa: E731
        args = (mode, B, H, Hk, n * w, D, Dv, w)
        assert sent(forward) == cp_plan.bytes_sent_per_rank(*args), (mode, forward)
        assert sent(both) == cp_plan.bytes_sent_per_rank(*args, backward=True), (mode, both)


def _sequence_case(rank, w, group):
    """shard_sequence keeps this rank's chunks (rank r: r and 2w-1-r head-tail, r contiguous),
    shard_positions names their positions, unshard_sequence puts the whole sequence back."""
    N = 4 * w
    x = torch.arange(N, dtype=torch.float32).view(1, 1, N, 1).expand(2, 3, N, 2).contiguous()
    for layout, chunks in (("head_tail", (rank, 2 * w - 1 - rank)), ("contiguous", (rank,))):
        c = N // (2 * w if layout == "head_tail" else w)
        expected = torch.cat([torch.arange(k * c, (k + 1) * c) for k in chunks])
        assert torch.equal(shard_positions(N, group, layout), expected), layout
        mine = shard_sequence(x, group, 2, layout)
        assert torch.equal(mine[0, 0, :, 0].long(), expected), layout
        assert torch.equal(unshard_sequence(mine, group, 2, layout), x), layout
        assert torch.equal(unshard_sequence(shard_sequence(x.transpose(1, 2), group, 1, layout), group, 1, layout),
                           x.transpose(1, 2)), layout


def run_jobs(rank, w, group, jobs, device="cpu"):
    global _DEVICE
    _DEVICE = torch.device(device)
    for name, kwargs in jobs:
        globals()[name](rank, w, group, **kwargs)
    return True


def _dense_jobs(w, causal_only=False):
    heads = dict(H=2 * w, Hk=w)
    jobs = []
    for mode in MODES:
        for layout in LAYOUTS:
            for causal in ((True,) if causal_only else (False, True)):
                jobs.append(("_dense_case", dict(mode=mode, layout=layout, causal=causal, **heads)))
                jobs.append(("_dense_case", dict(mode=mode, layout=layout, causal=causal, sinks=True, softcap=1.5,
                                                 chunk=1, **heads)))
        jobs.append(("_positional_case", dict(mode=mode, layout="head_tail", causal=True, window_size=(3, 0),
                                              **heads)))
        jobs.append(("_positional_case", dict(mode=mode, layout="head_tail", causal=True, alibi_slopes=True,
                                              sinks=True, **heads)))
        if not causal_only:
            jobs.append(("_positional_case", dict(mode=mode, layout="contiguous", causal=False, window_size=(2, 3))))
            jobs.append(("_positional_case", dict(mode=mode, layout="head_tail", causal=False, alibi_slopes=True)))
            for dtype in (torch.bfloat16, torch.float16):
                jobs.append(("_dense_case", dict(mode=mode, layout="head_tail", causal=True, dtype=dtype, chunk=8,
                                                 sinks=True)))
    return jobs


def _varlen_jobs():
    docs = [5, 0, 1, 13, 2]
    return [("_varlen_case", dict(causal=False, lengths_q=docs)),
            ("_varlen_case", dict(causal=True, lengths_q=docs, sinks=True)),
            ("_varlen_case", dict(causal=True, lengths_q=[4, 9, 0], lengths_k=[7, 3, 2])),
            ("_varlen_case", dict(causal=True, lengths_q=docs, window_size=(2, 0), alibi_slopes=True))]


def test_world_2():
    jobs = _dense_jobs(2) + _varlen_jobs() + [("_communication_case", {}), ("_sequence_case", {})]
    assert run_ranks(run_jobs, 2, args=(jobs,)) == [True, True]


def test_world_4():
    jobs = (_dense_jobs(4, causal_only=True) + _varlen_jobs()[1:2]
            + [("_communication_case", {}), ("_sequence_case", {})])
    assert run_ranks(run_jobs, 4, args=(jobs,)) == [True] * 4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per NCCL rank)")
def test_world_2_nccl_on_gpus():
    """The same cases on CUDA tensors over NCCL, one GPU per rank: the algorithm has no device
    branch, so this checks the CUDA kernels and NCCL's collectives under it."""
    jobs = _dense_jobs(2) + _varlen_jobs()
    assert run_ranks(run_jobs, 2, args=(jobs, "cuda"), backend="nccl") == [True, True]


# ---- Dropout: a different mask than one device's, with the right statistics and gradients ----
def _dropout_body(rank, w, group, mode, p):
    """With one-hot values (v_j = e_j) the output is P_ij * keep_ij / (1 - p): its zeros show the
    mask, its other entries must be the reference's P_ij / (1 - p). The backward regenerates the
    forward's mask: checked against central differences of the same (seeded) call in float64."""
    B, H, n, D = 1, 2, 16, 8
    N = n * w
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    v = torch.eye(N).expand(B, H, N, N)
    sh = lambda t: shard_sequence(t, group, 2, "head_tail")  # noqa: E731
    torch.manual_seed(7)
    out = cp.context_parallel_attention(sh(q), sh(k), sh(v), group, mode=mode, is_causal=True, dropout_p=p)
    from transformer_fast import reference
    probs = reference.scaled_dot_product_attention(q.double(), k.double(), torch.eye(N, dtype=torch.float64)
                                                   .expand(B, H, N, N), is_causal=True)
    probs = sh(probs)
    allowed = probs > 0
    kept = (out != 0) & allowed
    fraction = kept.sum().item() / allowed.sum().item()
    assert abs(fraction - (1 - p)) < 4 * (p * (1 - p) / allowed.sum().item()) ** 0.5 + 1e-3, fraction
    torch.testing.assert_close(out[kept].double(), probs[kept] / (1 - p), rtol=1e-5, atol=1e-6)
    # gradients: one seeded call in float64, its analytic directional derivative vs differences
    q64, k64 = sh(q).double(), sh(k).double()
    v64 = sh(torch.randn(B, H, N, D, generator=g)).double()
    dirs = [sh(torch.randn(B, H, N, D, generator=g)).double() for _ in range(3)]
    do = sh(torch.randn(B, H, N, D, generator=g)).double()

    def loss(qq, kk, vv):
        torch.manual_seed(11)
        return (cp.context_parallel_attention(qq, kk, vv, group, mode=mode, is_causal=True, dropout_p=p) * do).sum()
    ins = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    loss(*ins).backward()
    eps = 1e-6
    for i in range(3):
        plus = [t + eps * dirs[i] if j == i else t for j, t in enumerate((q64, k64, v64))]
        minus = [t - eps * dirs[i] if j == i else t for j, t in enumerate((q64, k64, v64))]
        numeric = torch.tensor((loss(*plus) - loss(*minus)).item() / (2 * eps))
        torch.distributed.all_reduce(numeric, group=group)
        analytic = (ins[i].grad * dirs[i]).sum()
        torch.distributed.all_reduce(analytic, group=group)
        assert abs(numeric - analytic) <= 1e-6 * (1 + abs(analytic)), (mode, i, numeric.item(), analytic.item())
    return fraction


def _dropout_modes(rank, w, group, p):
    return [_dropout_body(rank, w, group, mode, p) for mode in ("all_gather", "ulysses")]


def test_dropout_statistics_and_gradients():
    fractions = run_ranks(_dropout_modes, 2, args=(0.3,))
    assert len(fractions) == 2 and all(len(f) == 2 for f in fractions)


# ---- Bad input: the same ValueError on every rank, never a hang --------------------------------
def _bad_input_body(rank, w, group):
    messages = []
    q = torch.randn(1, 4, 6, 8)
    cases = [({"q": torch.randn(1 + rank, 4, 6, 8)}, "batch size B"),
             ({"q": torch.randn(1, 4, 6 + 2 * rank, 8), "kv_len": 6 + 2 * rank}, "query shard length"),
             ({"dtype": torch.float32 if rank == 0 else torch.bfloat16}, "dtype"),
             ({"is_causal": rank == 1}, "is_causal")]
    for change, field in cases:
        qq = change.get("q", q).to(change.get("dtype", torch.float32))
        kv = torch.randn(qq.shape[0], 4, change.get("kv_len", 6), 8).to(qq.dtype)
        with pytest.raises(ValueError, match=field) as info:
            cp.context_parallel_attention(qq, kv, kv, group, mode="ring", is_causal=change.get("is_causal", False))
        messages.append(str(info.value))
    with pytest.raises(ValueError, match="heads"):  # Ulysses needs heads divisible by the group
        cp.context_parallel_attention(torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8),
                                      group, mode="ulysses")
    with pytest.raises(ValueError, match="length 6 .* 2 ranks .*head_tail"):
        shard_sequence(torch.randn(1, 1, 6, 2), group, 2, "head_tail")
    with pytest.raises(ValueError, match="length 5 .* 2 ranks .*contiguous"):
        shard_sequence(torch.randn(1, 1, 5, 2), group, 2, "contiguous")
    cu = torch.tensor([0, 3, 7 + rank], dtype=torch.int32)
    x = torch.randn(7 + rank, 2, 4)
    with pytest.raises(ValueError, match="cu_seq_q"):
        cp_varlen.context_parallel_varlen_attn(shard_packed(x, cu, group)[0], shard_packed(x, cu, group)[0],
                                        shard_packed(x, cu, group)[0], cu, cu, 5, 5, group)
    with pytest.raises(NotImplementedError, match="key_padding_mask"):
        cp.context_parallel_attention(q, q, q, group, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        cp.context_parallel_attention(q, q, q, group, mode="ring", dropout_p=0.1)
    return messages


def test_bad_input_raises_on_every_rank():
    messages = run_ranks(_bad_input_body, 2, timeout=60)
    assert messages[0] == messages[1]
    assert "rank 0: 1, rank 1: 2" in messages[0][0]


# ---- The ring's schedule (no processes) ------------------------------------------------------
@pytest.mark.parametrize("w", [2, 3, 4])
def test_head_tail_causal_ring_is_balanced(w):
    """Head-tail with a causal mask: step 0 is one causal call over the shard, every later step
    computes exactly 2c^2 (query, key) pairs on every rank, in one call; contiguous leaves rank 0
    idle after step 0."""
    c = 5
    for rank in range(w):
        plan = cp_plan.Plan(None, w, rank, "head_tail", 2 * c, True, 1.0, (-1, -1), 0.0, None, 0.0, None)
        calls = ring.step_calls(plan, rank)
        assert [(s.start, s.stop, t.start, t.stop, kind) for s, t, *_, kind in calls] == [(0, 2 * c, 0, 2 * c,
                                                                                           "causal")]
        for step in range(1, w):
            calls = ring.step_calls(plan, (rank - step) % w)
            assert len(calls) == 1 and calls[0][4] == "full"
            rows, keys = calls[0][:2]
            assert (rows.stop - rows.start) * (keys.stop - keys.start) == 2 * c * c
    plan = cp_plan.Plan(None, w, 0, "contiguous", c, True, 1.0, (-1, -1), 0.0, None, 0.0, None)
    assert all(ring.step_calls(plan, src) == [] for src in range(1, w))
