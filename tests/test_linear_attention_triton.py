"""The Triton linear-attention kernels (kernels/linear_attention_kernels.py, launched by
kernels/linear_attention.py) against the float64 reference.

Without a GPU they run under the Triton interpreter on CPU tensors (small shapes); the `gpu`
tests run the full grid on CUDA."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import reference

from attention_cases import make_qkv, random_key_padding
from helpers import TRITON_TESTS, compare_with_reference, kernel_device as _device

pytestmark = TRITON_TESTS


def _check(B, H, Nq, Nk, D, Dv, *, causal, pad, dtype=torch.float32, layout="bhnd", device=None):
    device = device or _device()
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, dtype=dtype, layout=layout, device=device)
    mask = random_key_padding(B, Nk, fully_padded_row=B - 1 if B > 1 else None, device=device) if pad else None

    def kernel(q, k, v, mask):
        return tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, backend="triton")

    def ref(q, k, v, mask):
        return reference.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask)

    what = f"B{B} H{H} Nq{Nq} Nk{Nk} D{D} Dv{Dv} causal={causal} pad={pad} {dtype} {layout}"
    compare_with_reference(kernel, ref, (q, k, v, mask), grad_inputs=(0, 1, 2), what=what)


# (Nq, Nk, D, Dv, causal, pad, dtype, layout): odd lengths, non-power-of-two head dims, Dv != D,
# unequal query/key lengths, transposed (non-contiguous) inputs, a fully padded sequence.
CASES = [
    (1, 1, 16, 16, False, False, torch.float32, "bhnd"),
    (1, 1, 40, 16, True, True, torch.float32, "bhnd"),
    (17, 17, 16, 16, True, False, torch.float32, "bhnd"),
    (17, 17, 40, 16, True, True, torch.float32, "bnhd"),
    (17, 17, 16, 40, False, True, torch.float32, "bhnd"),
    (64, 64, 64, 64, True, False, torch.float32, "bnhd"),
    (64, 64, 40, 40, False, True, torch.float32, "bnhd"),
    (64, 64, 16, 64, True, True, torch.float32, "bhnd"),
    (17, 64, 40, 64, False, True, torch.float32, "bhnd"),
    (64, 17, 64, 16, False, False, torch.float32, "bnhd"),
    (129, 129, 40, 16, True, True, torch.float32, "bhnd"),
    (17, 17, 40, 40, True, True, torch.float16, "bnhd"),
    (64, 64, 64, 16, True, False, torch.float16, "bhnd"),
    (64, 17, 16, 40, False, True, torch.float16, "bnhd"),
]


@pytest.mark.parametrize("Nq,Nk,D,Dv,causal,pad,dtype,layout", CASES)
def test_forward_and_gradients(Nq, Nk, D, Dv, causal, pad, dtype, layout):
    _check(2, 2, Nq, Nk, D, Dv, causal=causal, pad=pad, dtype=dtype, layout=layout)


def test_fused_qkv_layout():
    _check(2, 3, 17, 17, 40, 40, causal=True, pad=True, layout="qkv")


@pytest.mark.parametrize("causal", [False, True])
def test_column_tiling(monkeypatch, causal):
    """Tiny state tiles force several column tiles (Dv tiles in the forward and dV, D tiles in
    dQ and dK) and the per-tile partial dO . out sums in the half-precision configs (fp32's
    own configs tile at 16 or 32 columns already)."""
    from transformer_fast.kernels import linear_attention as kernels

    monkeypatch.setattr(kernels, "STATE_TILE_ELEMENTS", 16 * 16)
    monkeypatch.setattr(kernels, "MAX_BLOCK_C", 16)
    for plans in (kernels._forward_plans, kernels._backward_plans):  # plans keep the tiles they were made with
        plans.clear()
    try:
        _check(2, 2, 40, 40, 40, 64, causal=causal, pad=True, dtype=torch.float16)
        _check(1, 2, 17, 17, 64, 40, causal=causal, pad=False, dtype=torch.float16, layout="bnhd")
    finally:
        for plans in (kernels._forward_plans, kernels._backward_plans):
            plans.clear()


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_padded_keys_does_not_leak(causal):
    B, H, N, D, Dv = 2, 2, 33, 16, 24
    q, k, v = make_qkv(B, H, N, N, D, Dv)
    mask = random_key_padding(B, N)
    mask[0, -5:] = True
    mask[1] = True  # a fully padded sequence: output 0, gradients 0
    k_nan = k.masked_fill(mask[:, None, :, None], float("nan")).requires_grad_()
    v_nan = v.masked_fill(mask[:, None, :, None], float("nan")).requires_grad_()
    qg = q.clone().requires_grad_()
    out = tf.linear_attention(qg, k_nan, v_nan, is_causal=causal, key_padding_mask=mask, backend="triton")
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (qg, k_nan, v_nan), dout)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} is not finite"
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in (dq, dk, dv):
        assert torch.equal(g[1], torch.zeros_like(g[1]))
    assert torch.equal(dk[0][:, -5:], torch.zeros_like(dk[0][:, -5:]))
    # The result equals the one with finite values in the padded keys.
    expected = reference.linear_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                          key_padding_mask=mask)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_expanded_upstream_gradient():
    """out.sum().backward() hands the backward a stride-0 gradient."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 17, 17, 16, 16))
    tf.linear_attention(q, k, v, is_causal=True, backend="triton").sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.linear_attention(q64, k64, v64, is_causal=True).sum().backward()
    for a, b in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_full_grid(dtype, causal):
    for N in (1, 17, 64, 129, 1000):
        for D in (16, 40, 64, 128):
            for Dv in (16, 40, 64, 128):
                _check(2, 3, N, N, D, Dv, causal=causal, pad=N > 1, dtype=dtype, device="cuda")
    for D, Dv in ((256, 256), (256, 40), (96, 200)):
        _check(1, 2, 129, 129, D, Dv, causal=causal, pad=True, dtype=dtype, device="cuda")
    if not causal:
        _check(2, 3, 129, 1000, 64, 40, causal=False, pad=True, dtype=dtype, device="cuda", layout="bnhd")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp16_long_sequence_is_finite(causal):
    """fp16 states overflow at long lengths (a known fast-transformers failure); ours are fp32."""
    q, k, v = make_qkv(1, 2, 16384, 16384, 64, 64, dtype=torch.float16, device="cuda")
    v = (v + 4).requires_grad_()  # a biased value makes S grow like N
    q.requires_grad_()
    k.requires_grad_()
    out = tf.linear_attention(q, k, v, is_causal=causal, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()
    expected = reference.linear_attention(q.double()[:, :, -64:], k.double(), v.double(), key_padding_mask=None) \
        if not causal else None
    if expected is not None:
        torch.testing.assert_close(out[:, :, -64:].double(), expected, atol=2e-2, rtol=2e-2)
