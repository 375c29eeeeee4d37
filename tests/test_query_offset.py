"""The kernel ops' query_offset (context parallelism's block pairs): query i sits at key position
i + Nk - Nq + query_offset, which moves the sliding window and ALiBi's distance but not is_causal.
Every backend's attention_forward and attention_backward ops, dense and packed, against a float64
reference written here with explicit loops over the positions, for offsets negative, zero,
positive and beyond the block (rows with no allowed key: out 0, lse the sink or +inf)."""
import math

import pytest
import torch

from transformer_fast._device_kernels import op_kernel

from attention_cases import differentiable_attention
from helpers import BACKENDS, assert_close_to_reference, kernel_device
from helpers import skip_unavailable_backend  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("skip_unavailable_backend")

SCALE = 0.3


# --------------------------------------------------------------------------------------------
# The reference: one dense sequence (B, H, Nq, D) in the inputs' dtype
# --------------------------------------------------------------------------------------------
def allowed_and_distance(Nq, Nk, window, is_causal, query_offset):
    """(allowed (Nq, Nk) bool, distance (Nq, Nk)) from the contract, position by position."""
    left, right = window
    allowed = [[True] * Nk for _ in range(Nq)]
    distance = [[0] * Nk for _ in range(Nq)]
    for i in range(Nq):
        pos = i + Nk - Nq + query_offset
        for j in range(Nk):
            ok = not (is_causal and j > i)
            ok = ok and not (left >= 0 and j < pos - left)
            ok = ok and not (right >= 0 and j > pos + right)
            allowed[i][j] = ok
            distance[i][j] = abs(pos - j)
    return torch.tensor(allowed, dtype=torch.bool).reshape(Nq, Nk), torch.tensor(distance).reshape(Nq, Nk)


def reference_attention(q, k, v, window, is_causal, query_offset, softcap=0.0, slopes=None, sinks=None):
    """(out, lse) of dense inputs, differentiable in q, k, v and sinks (no NaN on empty rows)."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed, distance = allowed_and_distance(Nq, Nk, window, is_causal, query_offset)
    allowed, distance = allowed.to(q.device), distance.to(q.device, q.dtype)
    s = SCALE * q @ k.transpose(-2, -1)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s - slopes.to(q.dtype)[:, :, None, None] * distance
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)  # (Nq,)
    if sinks is not None:
        sink_column = sinks.to(q.dtype)[None, :, None, None].expand(B, H, Nq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_column], -1), -1)
    else:
        lse = torch.logsumexp(s.masked_fill(empty[:, None], 0.0), -1)
        lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    p = torch.exp(s - lse[..., None])
    return p @ v, lse


def reference_delta(q, k, v, dout, window, is_causal, query_offset, softcap=0.0, slopes=None, sinks=None):
    """delta_i = sum_j p_ij dP_ij with dP = dO V^T."""
    group = q.shape[1] // k.shape[1]
    with torch.no_grad():
        out, lse = reference_attention(q, k, v, window, is_causal, query_offset, softcap, slopes, sinks)
        B, H, Nq, _ = q.shape
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        allowed, distance = allowed_and_distance(Nq, k.shape[2], window, is_causal, query_offset)
        s = SCALE * q @ kr.transpose(-2, -1)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s - slopes.to(q.dtype)[:, :, None, None] * distance.to(q.dtype)
        p = torch.exp(s.masked_fill(~allowed, float("-inf")) - lse[..., None])
        return (p * (dout @ vr.transpose(-2, -1))).sum(-1)


def reference_results(q, k, v, dout, config):
    """(out, lse, dq, dk, dv, delta) of the reference in q's dtype."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, **config)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    delta = reference_delta(q.detach(), k.detach(), v.detach(), dout, **config)
    return out.detach(), lse.detach(), dq, dk, dv, delta


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------
def check_lse(actual, ref64, ref32, what):
    """+inf exactly where the reference has it (rows with no key and no sink), else close."""
    infinite = torch.isinf(ref64)
    assert torch.equal(torch.isinf(actual) & (actual > 0), infinite), f"{what}: rows with no allowed key"
    assert_close_to_reference(actual[~infinite], ref64[~infinite], ref32[~infinite], what=what)


def check_results(kernel, ref64, ref32, what, with_delta):
    names = ("out", "lse", "dq", "dk", "dv", "delta")
    for name, actual, r64, r32 in zip(names, kernel, ref64, ref32):
        if name == "delta" and not with_delta:
            continue
        if name == "lse":
            check_lse(actual, r64, r32, f"{what} lse")
        else:
            assert_close_to_reference(actual, r64, r32, what=f"{what} {name}")


def run_kernels(backend, q, k, v, dout, *, window, is_causal, query_offset, softcap, slopes, sinks, packed=None):
    """(out, lse, dq, dk, dv, delta) of `backend`'s kernel ops; packed: dict(cu_seq_q, cu_seq_k,
    max_q, max_k) with q, k, v, dout packed."""
    device = q.device.type
    forward, backward = op_kernel("attention_forward", backend, device), op_kernel("attention_backward", backend,
                                                                                   device)
    extras = dict(window=window, softcap=softcap, alibi_slopes=slopes, **(packed or {}))
    out, lse = forward(q, k, v, None, None, is_causal, SCALE, 0.0, None, sinks=sinks, query_offset=query_offset,
                       **extras)
    dq, dk, dv, _, delta = backward(dout, q, k, v, out, lse, None, None, is_causal, SCALE, 0.0, None, False,
                                    compute_delta=sinks is not None, sinks=sinks, query_offset=query_offset, **extras)
    return out, lse, dq, dk, dv, delta


# --------------------------------------------------------------------------------------------
# Dense
# --------------------------------------------------------------------------------------------
# (H, Hk, Nq, Nk, window, is_causal, extras, offsets); extras: softcap, alibi, sinks.
DENSE = [
    (2, 2, 17, 17, (-1, 0), False, (), (-40, -5, 0, 6, 40)),   # a context-parallel block pair, causal
    (2, 2, 17, 17, (3, 0), False, ("sinks",), (-20, -4, 9, 18)),  # sliding window; -20 and 18: no key at all
    (4, 2, 17, 9, (2, 5), False, ("alibi", "softcap"), (-12, 3, 30)),  # GQA, Nq > Nk
    (2, 2, 1, 17, (3, 0), False, ("alibi", "sinks"), (-10, -2, 4)),  # one decoding query
    (2, 2, 17, 1, (-1, 0), False, (), (-3, 0, 20)),
    (2, 2, 9, 17, (-1, -1), False, ("alibi",), (-7, 12)),  # no window: the offset moves ALiBi only
    (2, 2, 17, 17, (2, 5), True, ("softcap",), (-3, 4)),  # is_causal stays top-left
    (2, 2, 17, 17, (20, 20), False, (), (-9, 9)),  # wider than the block, yet bounded once moved
]


def _extras(names, B, H, device):
    gen = torch.Generator().manual_seed(7)
    softcap = 2.0 if "softcap" in names else 0.0
    slopes = (torch.rand(B, H, generator=gen) * 0.5).to(device) if "alibi" in names else None
    sinks = torch.randn(H, generator=gen).to(device) if "sinks" in names else None
    return softcap, slopes, sinks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"H{c[0]}Hk{c[1]}q{c[2]}k{c[3]}w{c[4][0]}_{c[4][1]}"
                         f"{'-causal' if c[5] else ''}-{'-'.join(c[6]) or 'plain'}")
def test_dense(backend, case):
    H, Hk, Nq, Nk, window, is_causal, names, offsets = case
    B, D = 2, 24
    device = kernel_device()
    torch.manual_seed(0)
    softcap, slopes, sinks = _extras(names, B, H, device)
    for query_offset in offsets:
        q = torch.randn(B, H, Nq, D, device=device)
        k, v = torch.randn(B, Hk, Nk, D, device=device), torch.randn(B, Hk, Nk, D, device=device)
        dout = torch.randn(B, H, Nq, D, device=device)
        config = dict(window=window, is_causal=is_causal, query_offset=query_offset, softcap=softcap,
                      slopes=slopes, sinks=sinks)
        kernel = run_kernels(backend, q, k, v, dout, **config)
        ref64 = reference_results(*(t.double() for t in (q, k, v, dout)), config)
        ref32 = reference_results(q, k, v, dout, config)
        check_results(kernel, ref64, ref32, f"{backend} offset {query_offset}", sinks is not None)


# --------------------------------------------------------------------------------------------
# Packed: one offset for every sequence
# --------------------------------------------------------------------------------------------
LENGTHS_Q, LENGTHS_K = (5, 1, 17, 0), (5, 9, 17, 3)
PACKED = [
    ((-1, 0), 2, ("sinks",), (-20, -6, 0, 7, 30)),
    ((2, 5), 1, ("alibi", "softcap"), (-9, 4, 25)),  # GQA
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"w{c[0][0]}_{c[0][1]}-Hk{c[1]}-{'-'.join(c[2])}")
def test_packed(backend, case):
    window, Hk, names, offsets = case
    H, D = 2, 24
    B = len(LENGTHS_Q)
    device = kernel_device()
    torch.manual_seed(1)
    softcap, slopes, sinks = _extras(names, B, H, device)
    cu_q = torch.tensor([0, *torch.tensor(LENGTHS_Q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(LENGTHS_K).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max(LENGTHS_Q), max_k=max(LENGTHS_K))
    for query_offset in offsets:
        seqs = [(torch.randn(1, H, nq, D, device=device), torch.randn(1, Hk, nk, D, device=device),
                 torch.randn(1, Hk, nk, D, device=device), torch.randn(1, H, nq, D, device=device))
                for nq, nk in zip(LENGTHS_Q, LENGTHS_K)]
        q, k, v, dout = (torch.cat([s[n][0].transpose(0, 1) for s in seqs]) for n in range(4))
        kernel = run_kernels(backend, q, k, v, dout, window=window, is_causal=False, query_offset=query_offset,
                             softcap=softcap, slopes=slopes, sinks=sinks, packed=packed)
        refs = {torch.float64: [], torch.float32: []}
        for b, (qb, kb, vb, dob) in enumerate(seqs):
            config = dict(window=window, is_causal=False, query_offset=query_offset, softcap=softcap,
                          slopes=None if slopes is None else slopes[b:b + 1], sinks=sinks)
            refs[torch.float64].append(reference_results(*(t.double() for t in (qb, kb, vb, dob)), config))
            refs[torch.float32].append(reference_results(qb, kb, vb, dob, config))

        def pack(results):  # per sequence (out, lse, dq, dk, dv, delta) -> the packed layouts
            rows = [torch.cat([r[n][0].transpose(0, 1) for r in results]) for n in (0, 2, 3, 4)]
            lse, delta = (torch.cat([r[n][0] for r in results], dim=1) for n in (1, 5))
            return rows[0], lse, rows[1], rows[2], rows[3], delta
        check_results(kernel, pack(refs[torch.float64]), pack(refs[torch.float32]),
                      f"{backend} packed offset {query_offset}", sinks is not None)


# --------------------------------------------------------------------------------------------
# The op's other paths and the offset's range
# --------------------------------------------------------------------------------------------
def test_dispatcher_autograd_passes_the_offset_to_the_backward():
    """torch.ops' autograd node (csrc/ops/attention_op.cpp) keeps query_offset for the backward op, and
    for the composite backward of second derivatives (create_graph=True)."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 24) for _ in range(3))
    dout = torch.randn(1, 2, 9, 24)
    config = dict(window=(2, 0), is_causal=False, query_offset=-4, softcap=0.0, slopes=torch.rand(1, 2) * 0.5,
                  sinks=None)
    ref64 = reference_results(*(t.double() for t in (q, k, v, dout)), config)
    ref32 = reference_results(q, k, v, dout, config)
    for create_graph in (False, True):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = torch.ops.transformer_fast.attention_forward(qg, kg, vg, None, None, False, SCALE, 0.0, None, [2, 0],
                                                              alibi_slopes=config["slopes"], query_offset=-4)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout, create_graph=create_graph)
        for name, g, r64, r32 in zip(("dq", "dk", "dv"), grads, ref64[2:5], ref32[2:5]):
            assert_close_to_reference(g.detach(), r64, r32, what=f"{name} create_graph={create_graph}")


def test_explicit_backend_passes_the_offset_to_the_backward():
    """A backend by name gets query_offset, forward and backward."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 24) for _ in range(3))
    dout = torch.randn(1, 2, 9, 24)
    config = dict(window=(-1, 0), is_causal=False, query_offset=-3, softcap=0.0, slopes=None, sinks=None)
    ref64 = reference_results(*(t.double() for t in (q, k, v, dout)), config)
    ref32 = reference_results(q, k, v, dout, config)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = differentiable_attention(qg, kg, vg, None, None, False, SCALE, 0.0, None, "reference", window=(-1, 0),
                                   query_offset=-3)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    assert_close_to_reference(out.detach(), ref64[0], ref32[0], what="out")
    for name, g, r64, r32 in zip(("dq", "dk", "dv"), grads, ref64[2:5], ref32[2:5]):
        assert_close_to_reference(g, r64, r32, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offset_out_of_range_is_refused(backend):
    device = kernel_device()
    q = torch.randn(1, 1, 3, 16, device=device)
    forward = op_kernel("attention_forward", backend, device)
    backward = op_kernel("attention_backward", backend, device)
    for offset in (2**30 + 1, -2**30 - 1):
        with pytest.raises(ValueError, match="query_offset must be in"):
            forward(q, q, q, None, None, False, 1.0, 0.0, None, window=(2, 0), query_offset=offset)
        lse = torch.zeros(1, 1, 3, device=device)
        with pytest.raises(ValueError, match="query_offset must be in"):
            backward(q, q, q, q, q, lse, None, None, False, 1.0, 0.0, None, False, window=(2, 0),
                     query_offset=offset)
    out, _ = forward(q, q, q, None, None, False, 1.0, 0.0, None, window=(2, 0), query_offset=2**30)
    assert out.abs().max().item() == 0.0  # every row's window lies past the keys
