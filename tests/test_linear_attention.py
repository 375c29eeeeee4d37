"""Linear attention on CPU: the reference and C++ backends against the float64 O(N^2) oracle,
padding (NaN in padded keys must not leak), the recurrent form, fp16 long sequences,
torch.compile, opcheck and input checks."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import _backends, _build, reference

from attention_cases import make_qkv
from helpers import compare_with_reference

CPP_STATUS = tf.available_backends()["cpp"]["cpu"]
CPP_REASON = None if CPP_STATUS == "ok" else CPP_STATUS
BACKENDS = ["reference", pytest.param("cpp", marks=pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON)))]


def random_padding(B, Nk, *, fully_padded_row=None):
    """(B, Nk) bool, True = padded: scattered padded keys (not only a suffix), one row fully padded."""
    mask = torch.rand(B, Nk) < 0.3
    if fully_padded_row is not None:
        mask[fully_padded_row] = True
    return mask


def oracle(q, k, v, is_causal, mask):
    return reference.linear_attention(q, k, v, is_causal=is_causal, key_padding_mask=mask)


# (B, H, Nq, Nk, D, Dv, is_causal, padding, layout): every N in {1, 17, 64, 129, 1000}, every D and Dv
# in {16, 40, 64, 128}, causal or not, padding (with a fully padded sequence) or not, Nq != Nk.
CASES = [
    (1, 2, 1, 1, 16, 16, True, False, "bhnd"),
    (2, 2, 17, 17, 40, 64, True, True, "bhnd"),
    (2, 3, 64, 64, 64, 40, False, True, "bhnd"),
    (2, 1, 129, 129, 128, 16, True, True, "bnhd"),
    (1, 2, 1000, 1000, 64, 64, True, False, "bhnd"),
    (2, 2, 17, 129, 40, 128, False, True, "bnhd"),
    (1, 2, 129, 17, 16, 64, False, False, "bnhd"),
    (2, 1, 1000, 1000, 16, 128, False, True, "bhnd"),
    (2, 1, 1000, 1000, 40, 16, True, True, "bnhd"),
]


def _case_id(c):
    B, H, Nq, Nk, D, Dv, causal, pad, layout = c
    return f"B{B}H{H}-{Nq}x{Nk}-D{D}-Dv{Dv}-{'causal' if causal else 'full'}{'-pad' if pad else ''}-{layout}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference_fp32(backend, case):
    B, H, Nq, Nk, D, Dv, causal, pad, layout = case
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, layout=layout)
    mask = random_padding(B, Nk, fully_padded_row=B - 1 if B > 1 else None) if pad else None

    def kernel(q, k, v):
        return tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, backend=backend)

    out = compare_with_reference(kernel, lambda q, k, v: oracle(q, k, v, causal, mask), (q, k, v), (0, 1, 2),
                                 what=f"{backend} {_case_id(case)}")
    assert out.shape == (B, H, Nq, Dv) and out.is_contiguous()
    if pad and B > 1:  # the fully padded sequence attends to nothing: 0, not NaN
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


LOWP_CASES = [
    (2, 2, 129, 129, 64, 40, True, True, "bnhd"),
    (2, 2, 17, 64, 40, 16, False, True, "bhnd"),
    (1, 2, 1000, 1000, 16, 64, True, False, "bhnd"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", LOWP_CASES, ids=_case_id)
def test_matches_reference_low_precision(backend, dtype, case):
    B, H, Nq, Nk, D, Dv, causal, pad, layout = case
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, layout=layout, dtype=dtype)
    mask = random_padding(B, Nk, fully_padded_row=B - 1) if pad else None

    def kernel(q, k, v):
        out = tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, backend=backend)
        assert out.dtype == dtype
        return out

    compare_with_reference(kernel, lambda q, k, v: oracle(q, k, v, causal, mask), (q, k, v), (0, 1, 2),
                           what=f"{backend} {dtype} {_case_id(case)}")


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_cpp_kernel_in_float64_is_exact(is_causal, with_state):
    """The kernel-level C++ functions also take float64 (the public dispatch sends float64 to the
    reference); in float64 any formula or indexing slip shows far above rounding. With a state:
    an initial state in (a transposed, strided S), the final state out and its gradient in."""
    q, k, v = make_qkv(2, 2, 200, 200, 24, 40, dtype=torch.float64, layout="bnhd")
    mask = random_padding(2, 200, fully_padded_row=1)
    dout = torch.randn(2, 2, 200, 40, dtype=torch.float64)
    state = (None,) * 4
    if with_state:
        S0 = torch.rand(2, 2, 40, 24, dtype=torch.float64).transpose(-2, -1) * 5
        z0 = torch.rand(2, 2, 24, 3, dtype=torch.float64)[..., 1] * 5
        state = (S0, z0, torch.randn(2, 2, 24, 40, dtype=torch.float64), torch.randn(2, 2, 24, dtype=torch.float64))
    fwd = _backends.kernel("linear_attention_forward", "cpp")
    bwd = _backends.kernel("linear_attention_backward", "cpp")
    ref_fwd = _backends.kernel("linear_attention_forward", "reference")
    ref_bwd = _backends.kernel("linear_attention_backward", "reference")
    got = fwd(q, k, v, mask, is_causal, 1e-6, *state[:2], with_state)
    want = ref_fwd(q, k, v, mask, is_causal, 1e-6, *state[:2], with_state)
    for g, w in zip(got, want):
        if w is None:
            assert g.numel() == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    for g, w in zip(bwd(dout, q, k, v, mask, is_causal, 1e-6, *state),
                    ref_bwd(dout, q, k, v, mask, is_causal, 1e-6, *state)):
        if w is None:
            assert g.numel() == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_padded_keys_does_not_leak(is_causal, dtype):
    B, H, N, D, Dv = 2, 2, 150, 32, 24
    q, k, v = make_qkv(B, H, N, N, D, Dv, dtype=dtype)
    mask = random_padding(B, N, fully_padded_row=1)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[mask[:, None, :, None].expand_as(k)] = float("nan")
    v_nan[mask[:, None, :, None].expand_as(v)] = float("inf")
    dout = torch.randn(B, H, N, Dv, dtype=dtype)
    results = []
    for kk, vv in ((k, v), (k_nan, v_nan)):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, vv))
        out = tf.linear_attention(qg, kg, vg, is_causal=is_causal, key_padding_mask=mask, backend="cpp")
        results.append((out, *torch.autograd.grad(out, (qg, kg, vg), dout)))
    for clean, dirty in zip(*results):
        assert torch.isfinite(dirty).all()
        assert torch.equal(clean, dirty)  # padded keys are skipped, not multiplied by zero
    _, _, dk, dv = results[1]
    assert (dk[mask[:, None, :, None].expand_as(dk)] == 0).all() and (dv[mask[:, None, :, None].expand_as(dv)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_form_equals_parallel_form(dtype):
    """Decoding token by token with linear_attention_step gives the causal parallel result (the
    C++ kernel for float32, the reference for float64)."""
    B, H, N, D, Dv = 2, 3, 77, 24, 40
    q, k, v = make_qkv(B, H, N, N, D, Dv, dtype=dtype)
    parallel = tf.linear_attention(q, k, v, is_causal=True)
    state, steps = None, []
    for i in range(N):
        out, state = tf.linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], state)
        steps.append(out)
    state_dtype = torch.promote_types(dtype, torch.float32)
    assert state.S.dtype == state_dtype and state.z.dtype == state_dtype
    recurrent = torch.stack(steps, dim=2)
    assert recurrent.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-6)  # fp32 state
    torch.testing.assert_close(recurrent, parallel, **tol)
    torch.testing.assert_close(parallel.double(), oracle(q.double(), k.double(), v.double(), True, None),
                               **tol)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
@pytest.mark.parametrize("is_causal", [False, True])
def test_fp16_long_sequence_stays_finite(is_causal):
    """N = 16384 fp16 tokens whose sums S, z overflow fp16 (|S| ~ 1e5 > 65504): the float32
    state keeps the output finite and right (fp16 cumulative sums give inf/NaN here)."""
    N, D = 16384, 16
    q, k, v = (torch.randn(1, 2, N, D) + 2 for _ in range(3))
    q16, k16, v16 = (t.half() for t in (q, k, v))
    assert not torch.isfinite((reference.elu_feature_map(k16) * v16).sum(2)).all()  # an fp16 state overflows
    qg, kg, vg = (t.clone().requires_grad_() for t in (q16, k16, v16))
    out = tf.linear_attention(qg, kg, vg, is_causal=is_causal, backend="cpp")
    grads = torch.autograd.grad(out, (qg, kg, vg), torch.randn_like(out))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    expected = tf.linear_attention(q16.float(), k16.float(), v16.float(), is_causal=is_causal, backend="cpp")
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
def test_torch_compile_fullgraph():
    q, k, v = (torch.randn(2, 2, 33, 16, requires_grad=True) for _ in range(3))
    mask = random_padding(2, 33)

    def f(q, k, v):
        return tf.linear_attention(q, k, v, is_causal=True, key_padding_mask=mask, backend="cpp").sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    expected = f(q, k, v)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(expected.sum(), (q, k, v)))


def test_opcheck():
    """The kernel ops on the CPU (the dispatcher's C++ kernels): schema, fake kernel, autograd, AOT."""
    q, k, v = (torch.randn(2, 2, 7, 8, requires_grad=True) for _ in range(3))
    v_wide = torch.randn(2, 2, 9, 12, requires_grad=True)
    pad = torch.tensor([[False] * 7, [False, True, False, True, True, False, True]])
    ops = torch.ops.transformer_fast
    torch.library.opcheck(ops.linear_attention_forward, (q, k, v, pad, True, 1e-6, None, None, False))
    torch.library.opcheck(ops.linear_attention_forward, (q, k[:, :, :5].detach().requires_grad_(), v_wide[:, :, :5],
                                                         None, False, 1e-3, None, None, False))
    dout = torch.randn(2, 2, 7, 8)
    torch.library.opcheck(ops.linear_attention_backward, (dout, q.detach(), k.detach(), v.detach(), pad, False, 1e-6,
                                                          None, None, None, None))
    q_t, k_t, v_t = make_qkv(2, 2, 7, 7, 8, 8, layout="bnhd")  # transposed views: outputs are still contiguous
    torch.library.opcheck(ops.linear_attention_forward, (q_t.requires_grad_(), k_t.requires_grad_(),
                                                         v_t.requires_grad_(), pad, True, 1e-6, None, None, False))
    torch.library.opcheck(ops.linear_attention_backward, (dout, q_t.detach(), k_t.detach(), v_t.detach(), None, True,
                                                          1e-6, None, None, None, None))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequences(backend):
    q = torch.randn(2, 1, 0, 8, requires_grad=True)
    k, v = torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 4)
    assert tf.linear_attention(q, k, v, backend=backend).shape == (2, 1, 0, 4)
    q = torch.randn(2, 1, 3, 8)
    out = tf.linear_attention(q, k[:, :, :0], v[:, :, :0], backend=backend)
    assert torch.equal(out, torch.zeros(2, 1, 3, 4))


def test_bad_inputs_raise_clear_errors():
    q, k, v = make_qkv(2, 2, 5, 5, 8, 6)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        tf.linear_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True)
    with pytest.raises(ValueError, match="eps must be > 0"):
        tf.linear_attention(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match=r"value.shape\[2\]"):
        tf.linear_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="value head dim must be between"):
        tf.linear_attention(q, k, torch.randn(2, 2, 5, 257))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, key_len\) = \(2, 5\)"):
        tf.linear_attention(q, k, v, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a torch.Tensor, got list"):
        tf.linear_attention(q, k, v, key_padding_mask=[[False] * 5] * 2)
    with pytest.raises(TypeError, match="value has dtype"):
        tf.linear_attention(q, k, v.half())
    with pytest.raises(ValueError, match="key must have the query's shape"):
        tf.linear_attention_step(q[:, :, 0], k[:, :1, 0], v[:, :, 0])
    with pytest.raises(ValueError, match="value must have shape"):
        tf.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:1, :, 0])
    with pytest.raises(ValueError, match="query must have 3 dimensions"):
        tf.linear_attention_step(q, k, v)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
def test_cpp_kernel_checks_its_arguments():
    """Direct calls of the extension (bypassing the public checks) fail with a message, not a crash."""
    fwd = _backends.kernel("linear_attention_forward", "cpp")
    q, k, v = make_qkv(1, 1, 4, 4, 8, 8)
    with pytest.raises(RuntimeError, match="key_padding_mask must be a bool"):
        fwd(q, k, v, torch.zeros(1, 4), False, 1e-6, None, None, False)
    with pytest.raises(RuntimeError, match="causal needs equal query and key lengths"):
        fwd(q, k[:, :, :2], v[:, :, :2], None, True, 1e-6, None, None, False)
    with pytest.raises(RuntimeError, match="inconsistent shapes"):
        fwd(q, k, v[:, :, :3], None, False, 1e-6, None, None, False)
    with pytest.raises(RuntimeError, match="initial_S and initial_z come together"):
        fwd(q, k, v, None, False, 1e-6, torch.zeros(1, 1, 8, 8), None, False)
    with pytest.raises(RuntimeError, match=r"initial_z must be a Float CPU tensor of shape \[1, 1, 8\]"):
        fwd(q, k, v, None, False, 1e-6, torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, dtype=torch.float64), False)
