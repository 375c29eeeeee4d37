"""context_parallel_linear_attention on gloo process groups of 2 and 4 ranks: every rank's output
rows, the gradients of its shards and of the initial state, and the final state, against a float64
loop written here and against the one-process linear_attention; bad arguments raise on every rank.

Each group runs every case of a test in one launch (spawning a rank costs seconds)."""
import pytest
import torch
import torch.nn.functional as F

from distributed_launch import run_ranks
from helpers import assert_close_to_reference

import transformer_fast as tf

EPS = 1e-6


def loop_reference(q, k, v, is_causal, mask=None, S0=None, z0=None, eps=EPS):
    """out_i = phi(q_i) S_i / (phi(q_i) . z_i + eps), the sums over unpadded keys (j <= i if causal),
    from (S0, z0); returns out and the final state. Differentiable, in the inputs' dtype."""
    B, H, N, D = q.shape
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    if mask is not None:
        phi_k = phi_k * (~mask)[:, None, :, None]
    S = torch.zeros(B, H, D, v.shape[-1], dtype=q.dtype) if S0 is None else S0.to(q.dtype)
    z = torch.zeros(B, H, D, dtype=q.dtype) if z0 is None else z0.to(q.dtype)
    if not is_causal:
        S = S + phi_k.transpose(2, 3) @ v
        z = z + phi_k.sum(2)
        out = (phi_q @ S) / ((phi_q * z[:, :, None]).sum(-1, keepdim=True) + eps)
        return out, S, z
    rows = []
    for i in range(N):
        S = S + phi_k[:, :, i, :, None] * v[:, :, i, None, :]
        z = z + phi_k[:, :, i]
        p = phi_q[:, :, i]
        rows.append((p[..., None] * S).sum(2) / ((p * z).sum(-1, keepdim=True) + eps))
    return torch.stack(rows, 2), S, z


def shard(x, rank, world, layout, dim):
    chunks = 2 * world if layout == "head_tail" else world
    pieces = x.chunk(chunks, dim)
    held = (rank, 2 * world - 1 - rank) if layout == "head_tail" else (rank,)
    return torch.cat([pieces[c] for c in held], dim)


def problem(seed, B, H, N, D, Dv, world, with_state, with_mask):
    """The whole problem (float64): q, k, v, initial state or None, mask or None, the upstream
    gradient of the output, and per rank the upstream gradients of the final state (each rank's
    loss reads the final state it gets; one device's loss reads it once with their sum)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for d in (D, D, Dv))
    state = None
    if with_state:  # the state of 7 earlier keys: positive z, as a real prefix has
        ek, ev = torch.randn(B, H, 7, D, generator=g, dtype=torch.float64), torch.randn(B, H, 7, Dv, generator=g,
                                                                                       dtype=torch.float64)
        _, S0, z0 = loop_reference(ek[:, :, :0], ek, ev, False)
        state = (S0, z0)
    mask = None
    if with_mask:
        mask = torch.rand(B, N, generator=g) < 0.3
        mask[0, : N // 2] = True  # the first half of batch 0 all padded: ranks with only padded keys
    dout = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    d_final = [(torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64),
                torch.randn(B, H, D, generator=g, dtype=torch.float64)) for _ in range(world)]
    return q, k, v, state, mask, dout, d_final


def one_device(fn, q, k, v, state, mask, dout, d_final, is_causal, dtype):
    """(out, final S, z, dq, dk, dv, dS0, dz0) of fn on the whole sequence in dtype; the loss reads
    the output with dout and the final state with the sum of the ranks' final-state gradients."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    init = None if state is None else [t.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
                                       .requires_grad_() for t in state]
    out, S, z = fn(*leaves, is_causal, mask, init)
    dS = sum(d[0] for d in d_final)
    dz = sum(d[1] for d in d_final)
    loss = (out.double() * dout).sum() + (S.double() * dS).sum() + (z.double() * dz).sum()
    grads = torch.autograd.grad(loss, leaves + (init or []))
    return [out.detach(), S.detach(), z.detach(), *grads] + ([None, None] if init is None else [])


def ours_one_device(q, k, v, is_causal, mask, init):
    out, (S, z) = tf.linear_attention(q, k, v, is_causal=is_causal, key_padding_mask=mask, eps=EPS,
                                      initial_state=None if init is None else tuple(init), output_final_state=True)
    return out, S, z


def plain(q, k, v, is_causal, mask, init):
    S0, z0 = (None, None) if init is None else init
    return loop_reference(q, k, v, is_causal, mask, S0, z0)


def _check_case(rank, world, group, case, dtype):
    from transformer_fast.distributed import context_parallel_linear_attention

    layout, is_causal, with_state, with_mask, seed, *final = case
    final = final[0] if final else True
    B, H, N, D, Dv = 2, 2, 8 * world, 5, 3  # 4 or 8 rows per rank's half chunk; odd head dims
    q, k, v, state, mask, dout, d_final = problem(seed, B, H, N, D, Dv, world, with_state, with_mask)
    if not final:  # no final state: its gradient is 0 in the references
        d_final = [(torch.zeros_like(dS), torch.zeros_like(dz)) for dS, dz in d_final]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    mine = [shard(t, rank, world, layout, 2).to(dtype).requires_grad_() for t in (q, k, v)]
    init = None if state is None else tuple(t.to(state_dtype).requires_grad_() for t in state)
    local_mask = None if mask is None else shard(mask, rank, world, layout, 1)
    result = context_parallel_linear_attention(*mine, group, layout=layout, is_causal=is_causal, eps=EPS,
                                               initial_state=init, output_final_state=final,
                                               key_padding_mask=local_mask)
    # Without the final state, the last chunk's rank computes no state of its own and still takes
    # part in the backward's exchange (it used to skip it: the other ranks then waited for it).
    out, (S, z) = result if final else (result, (torch.zeros(B, H, D, Dv), torch.zeros(B, H, D)))
    assert out.dtype == dtype and S.dtype == z.dtype == state_dtype
    dS, dz = d_final[rank]
    loss = ((out.double() * shard(dout, rank, world, layout, 2)).sum() + (S.double() * dS).sum()
            + (z.double() * dz).sum())
    grads = torch.autograd.grad(loss, mine + list(init or []))
    got = [out, S, z, *grads] + ([None, None] if init is None else [])

    exact = one_device(plain, q, k, v, state, mask, dout, d_final, is_causal, torch.float64)
    plain_lowp = one_device(plain, q, k, v, state, mask, dout, d_final, is_causal, dtype)
    ours = one_device(ours_one_device, q, k, v, state, mask, dout, d_final, is_causal, dtype)
    names = ("out", "final S", "final z", "dq", "dk", "dv", "d initial S", "d initial z")
    sharded = {"out", "dq", "dk", "dv"}
    for name, mine_t, ref, lowp, one in zip(names, got, exact, plain_lowp, ours):
        if not final and name.startswith("final"):
            continue
        if ref is None:
            assert mine_t is None, name
            continue
        if name in sharded:
            ref, lowp, one = (shard(t, rank, world, layout, 2) for t in (ref, lowp, one))
        what = f"rank {rank} {case} {name}"
        assert_close_to_reference(mine_t, ref, [lowp, one], what=what)
    return True


def check_cases(rank, world, group, cases, dtype):
    for case in cases:
        _check_case(rank, world, group, case, dtype)
    return True


# (layout, is_causal, initial state, key_padding_mask, seed)
CASES = [("contiguous", True, False, False, 0), ("contiguous", True, True, True, 1), ("head_tail", True, True, False, 2),
         ("head_tail", True, False, True, 3), ("contiguous", False, True, True, 4), ("head_tail", False, False, False, 5),
         ("contiguous", True, False, False, 8, False)]  # the last element: output_final_state (default True)


@pytest.mark.parametrize("world", [2, 4])
def test_matches_one_device_float32(world):
    """Output, final state and every gradient of every rank, causal and not, both layouts, with and
    without an initial state and padding, within 2x the error of the plain-torch float32 loop (and of
    the one-process linear_attention) against float64."""
    cases = CASES if world == 2 else CASES[1:4]
    assert run_ranks(check_cases, world, args=(cases, torch.float32)) == [True] * world


def test_matches_one_device_bfloat16_and_float64():
    """bf16 inputs (float32 states) within 2x plain torch's bf16 error; float64 to rounding."""
    cases = [("contiguous", True, True, True, 6), ("head_tail", False, True, False, 7)]

    assert run_ranks(check_dtypes, 2, args=(cases,)) == [True, True]


def check_dtypes(rank, world, group, cases):
    check_cases(rank, world, group, cases, torch.bfloat16)
    check_cases(rank, world, group, cases[:1], torch.float64)
    return True


def check_bad_input(rank, world, group):
    """Each bad call raises on every rank (never a hang); the group stays usable afterwards."""
    from transformer_fast.distributed import context_parallel_linear_attention as cp

    def qkv(N=4, D=5, dtype=torch.float32, B=1):
        return [torch.randn(B, 2, N, D, dtype=dtype) for _ in range(3)]

    def raises(fn, *words):
        with pytest.raises(ValueError) as info:
            fn()
        assert all(w in str(info.value) for w in words), str(info.value)

    # A different batch, head dim, dtype or shard length on rank 1
    raises(lambda: cp(*qkv(B=1 + rank), group), "batch")
    raises(lambda: cp(*qkv(D=5 + rank), group), "head dim")
    raises(lambda: cp(*qkv(dtype=torch.float32 if rank == 0 else torch.float64), group), "dtype", "float64")
    raises(lambda: cp(*qkv(N=4 + 2 * rank), group), "query length")
    # Flags that differ, an initial state on one rank only
    raises(lambda: cp(*qkv(), group, is_causal=rank == 0), "is_causal")
    state = (torch.zeros(1, 2, 5, 5), torch.zeros(1, 2, 5))
    raises(lambda: cp(*qkv(), group, initial_state=state if rank else None), "initial_state")
    # Gradients wanted on one rank only: its backward would wait for the others for ever
    raises(lambda: cp(*[t.requires_grad_(rank == 1) for t in qkv()], group), "gradients")
    # Invalid on one rank only: that rank raises its own error, the others name it
    bad_v = lambda: qkv()[:2] + [torch.randn(1, 2, 3 if rank == 1 else 4, 5)]  # noqa: E731
    raises(lambda: cp(*bad_v(), group), "value" if rank == 1 else "rank(s) [1]")
    # An odd shard length under head_tail (two equal chunks per rank) on rank 1
    raises(lambda: cp(*qkv(N=4 + rank), group, layout="head_tail"), "even" if rank else "rank(s) [1]")
    raises(lambda: cp(*qkv(), group, layout="zigzag"), "layout")
    # After all that, a valid call still runs on the same group
    torch.manual_seed(0)
    out = cp(*qkv(), group)
    return tuple(out.shape)


def test_bad_input_raises_on_every_rank():
    assert run_ranks(check_bad_input, 2, timeout=60) == [(1, 2, 4, 5)] * 2


def test_loop_reference_is_the_one_device_function():
    """The test's float64 loop against the package's linear_attention (so that the distributed
    checks above compare against the right thing)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 3, 11, 6, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 11, generator=g) < 0.3
    S0, z0 = torch.rand(2, 3, 6, 6, generator=g, dtype=torch.float64), torch.rand(2, 3, 6, generator=g,
                                                                                  dtype=torch.float64)
    for causal in (True, False):
        out, S, z = loop_reference(q, k, v, causal, mask, S0, z0)
        ref_out, (ref_S, ref_z) = tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, eps=EPS,
                                                      initial_state=(S0, z0), output_final_state=True)
        for a, b in ((out, ref_out), (S, ref_S), (z, ref_z)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
