"""Inputs whose sequence stride is smaller than a row: stride 0 (`expand`), overlapping windows
(`unfold`) and overlapping `as_strided` views, for q, k, v, the upstream gradient, x and the
residual, on every backend, forward and backward, against the float64 reference computed from
contiguous copies of the same values. The C++ kernels must not hand such a stride to the BLAS as
a leading dimension (MKL rejects it and skips the product)."""
import functools

import pytest
import torch

import transformer_fast as tf
from transformer_fast import reference

from attention_cases import flash_gradients, random_key_padding
from helpers import assert_close_to_reference, kernel_device as _device, need_backend
from test_attention_cuda_emulated import emulated_attention, emulation  # noqa: F401 (a fixture)

LAYOUTS = ("expand", "unfold", "overlap")


def strided(kind, shape, dtype, device="cpu"):
    """A random tensor of `shape` (..., N, W) whose rows overlap: "expand" repeats one row (sequence
    stride 0), "unfold" takes windows of W elements every max(1, W // 3) (stride below W),
    "overlap" lets every row start one element after the previous and the heads or batches share
    storage too (as_strided). The last-dim stride is 1 in all three."""
    *lead, N, W = shape
    if kind == "expand":
        return torch.randn(*lead, 1, W, dtype=dtype, device=device).expand(shape)
    if kind == "unfold":
        step = max(1, W // 3)
        return torch.randn(*lead, step * (N - 1) + W, dtype=dtype, device=device).unfold(-1, W, step)
    strides, outer = [1, 1], N + W - 1
    for size in reversed(lead):  # each leading index moves by half the span of the dims inside it
        strides.insert(0, max(1, outer // 2))
        outer = strides[0] * (size - 1) + outer
    return torch.as_strided(torch.randn(outer, dtype=dtype, device=device), shape, strides)


def _assert_layout(t, kind):
    """The view really is what the test means: some row starts less than a row after another."""
    if t.shape[-2] > 1:
        assert t.stride(-1) == 1 and t.stride(-2) < t.shape[-1], (kind, t.shape, t.stride())


def _check(kernel, reference_fn, inputs, dout, *, what, gradient_formulation=None):
    """kernel(*inputs) (inputs as given: strided views) and its gradients for the upstream
    gradient `dout` (as given) against reference_fn on contiguous float64 copies; the reference
    error is that of reference_fn on contiguous copies in the inputs' dtype (and of
    gradient_formulation(contiguous inputs, dout), where given), as tests/helpers.py rules."""
    dtype = inputs[0].dtype

    def leaves(convert):
        return [convert(t.detach()).requires_grad_() for t in inputs]

    args_k = leaves(lambda t: t)
    args_64 = leaves(lambda t: t.to(torch.float64).contiguous())
    args_lp = leaves(lambda t: t.contiguous())
    out_k, out_64, out_lp = kernel(*args_k), reference_fn(*args_64), reference_fn(*args_lp)
    assert_close_to_reference(out_k, out_64, out_lp, what=f"{what} output")
    g_k = torch.autograd.grad(out_k, args_k, dout)
    g_64 = torch.autograd.grad(out_64, args_64, dout.to(torch.float64).contiguous())
    g_lp = [[g] for g in torch.autograd.grad(out_lp, args_lp, dout.contiguous())]
    if gradient_formulation is not None:
        for alt, g in zip(g_lp, gradient_formulation([t.detach() for t in args_lp], dout.contiguous())):
            alt.append(g)
    for i, (a, b, c) in enumerate(zip(g_k, g_64, g_lp)):
        assert_close_to_reference(a, b, c, what=f"{what} grad of input {i}")
    assert out_k.dtype == dtype


def _operands(shapes, strided_ones, kind, dtype, device="cpu"):
    """Random tensors of `shapes` (a dict name -> shape); those named in `strided_ones` strided."""
    out = {}
    for name, shape in shapes.items():
        if name in strided_ones:
            out[name] = strided(kind, shape, dtype, device)
            _assert_layout(out[name], kind)
        else:
            out[name] = torch.randn(shape, dtype=dtype, device=device)
    return out


# ---------------------------------------------------------------------------------------------
# Softmax attention
# ---------------------------------------------------------------------------------------------
# (B, H, Hk, Nq, Nk, D, Dv, causal, key padding): products of 1-2 rows (MKL's gemv and the C++
# few-rows path), of 16+ rows and columns (register tiles), GQA, causal, padded keys, an odd
# head dim (no packed bf16 products), Dv != D.
ATTENTION_CASES = [
    (2, 2, 2, 40, 40, 32, 32, False, False),
    (1, 2, 2, 70, 45, 40, 24, True, True),
    (1, 4, 2, 33, 65, 16, 16, False, True),
    (2, 1, 1, 2, 20, 32, 48, False, False),
    (1, 2, 2, 24, 24, 17, 17, True, False),
]


def _check_attention(backend, case, strided_ones, kind, dtype, device="cpu", dout=None, attention=None):
    B, H, Hk, Nq, Nk, D, Dv, causal, padded = case
    t = _operands({"q": (B, H, Nq, D), "k": (B, Hk, Nk, D), "v": (B, Hk, Nk, Dv), "dout": (B, H, Nq, Dv)},
                  strided_ones, kind, dtype, device)
    pad = random_key_padding(B, Nk, device=device) if padded else None

    def kernel(q, k, v):
        fn = attention or functools.partial(tf.scaled_dot_product_attention, backend=backend)
        return fn(q, k, v, is_causal=causal, key_padding_mask=pad, enable_gqa=Hk != H)

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, is_causal=causal, key_padding_mask=pad)

    def flash(inputs, dout):
        return flash_gradients(*inputs, dout, key_padding_mask=pad, is_causal=causal)

    _check(kernel, ref, [t["q"], t["k"], t["v"]], t["dout"] if dout is None else dout, gradient_formulation=flash,
           what=f"attention[{backend}] {kind} {'+'.join(sorted(strided_ones))} {case}")


def _case_id(c):
    B, H, Hk, Nq, Nk, D, Dv, causal, padded = c
    return f"B{B}H{H}Hk{Hk}-{Nq}x{Nk}-D{D}Dv{Dv}{'-causal' if causal else ''}{'-pad' if padded else ''}"


# The C++ backend's two product paths (see test_attention.py), chosen on these small shapes by
# the packing threshold: packed blocks (bf16: AMX brgemm; fp32: register tiles against K^T, V^T
# in panels), or MKL.
PACK_MIN_ROWS = {"packed": "0", "unpacked": "1000000000"}
CPP_PATHS = [pytest.param(d, path, id=f"{str(d)[6:]}-{path}")
             for d in (torch.float32, torch.bfloat16) for path in PACK_MIN_ROWS]


# Each operand strided alone in three of the cases, all four at once in every case.
CPP_OPERANDS = [pytest.param(case, operand, id=f"{_case_id(case)}-{operand}")
                for i, case in enumerate(ATTENTION_CASES) for operand in ("q", "k", "v", "dout", "all")
                if operand == "all" or i in (0, 1, 3)]


@pytest.mark.parametrize("dtype,products", CPP_PATHS)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case,operand", CPP_OPERANDS)
def test_attention_cpp(case, operand, kind, dtype, products, monkeypatch):
    need_backend("cpp")
    monkeypatch.setenv("TRANSFORMER_FAST_PACK_MIN_ROWS", PACK_MIN_ROWS[products])
    _check_attention("cpp", case, {"q", "k", "v", "dout"} if operand == "all" else {operand}, kind, dtype)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_attention_cpp_fp16(case, kind):
    """fp16 (MKL has no fp16 product: at::addmm) with every operand strided."""
    need_backend("cpp")
    _check_attention("cpp", case, {"q", "k", "v", "dout"}, kind, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case", ATTENTION_CASES[1:4], ids=_case_id)
def test_attention_reference(case, kind, dtype):
    _check_attention("reference", case, {"q", "k", "v", "dout"}, kind, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_attention_triton(kind, dtype):
    need_backend("triton")
    # Under the interpreter: 32 x 16 forward and 16 x 32 backward tiles, so 20 queries and 33 keys
    # span two of each; GQA, causal and padded at once.
    _check_attention("triton", (1, 2, 1, 20, 33, 16, 16, True, True), {"q", "k", "v", "dout"}, kind, dtype,
                     device=_device())


@pytest.mark.parametrize("kind", LAYOUTS)
def test_attention_cuda_kernels_emulated(emulation, kind):
    """The C++ backend's CUDA kernels (csrc/cuda/attention_cuda.cuh), run on CPU threads: 20 keys span
    two forward key tiles of 16 and three dQ key tiles of 8."""
    _check_attention("cuda-emulated", (1, 2, 1, 12, 20, 16, 8, True, True), {"q", "k", "v", "dout"}, kind,
                     torch.float32, attention=emulated_attention(emulation, (16, 8, 16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("upstream", ["weighted_sum", "sum"])
def test_attention_cpp_upstream_gradient_of_a_sum(upstream, dtype):
    """The upstream gradient of (out * w).sum() is w expanded over (B, H, Nq): sequence stride 0
    with a unit last-dim stride, passed to the kernel as it is; that of out.sum() is one scalar
    expanded (every stride 0)."""
    need_backend("cpp")
    case = (2, 2, 2, 40, 40, 32, 32, False, False)
    shape = (2, 2, 40, 32)
    dout = (torch.randn(32, dtype=dtype) if upstream == "weighted_sum" else torch.ones((), dtype=dtype)).expand(shape)
    _check_attention("cpp", case, set(), "expand", dtype, dout=dout)


# ---------------------------------------------------------------------------------------------
# Linear attention
# ---------------------------------------------------------------------------------------------
def _check_linear(backend, shape, causal, padded, kind, dtype, device="cpu"):
    B, H, N, D, Dv = shape
    t = _operands({"q": (B, H, N, D), "k": (B, H, N, D), "v": (B, H, N, Dv), "dout": (B, H, N, Dv)},
                  {"q", "k", "v", "dout"}, kind, dtype, device)
    pad = random_key_padding(B, N, device=device) if padded else None

    def kernel(q, k, v):
        return tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=pad, backend=backend)

    def ref(q, k, v):
        return reference.linear_attention(q, k, v, is_causal=causal, key_padding_mask=pad)

    _check(kernel, ref, [t["q"], t["k"], t["v"]], t["dout"],
           what=f"linear_attention[{backend}] {kind} {shape} causal={causal} pad={padded}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_linear_attention(backend, causal, kind, dtype):
    need_backend(backend)
    # 70 tokens: two of the causal form's 64-token chunks.
    _check_linear(backend, (2, 2, 70, 24, 40), causal, causal, kind, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_linear_attention_triton(causal, kind):
    need_backend("triton")
    _check_linear("triton", (1, 2, 20, 16, 16), causal, not causal, kind, torch.float32, device=_device())


# ---------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm with the fused residual
# ---------------------------------------------------------------------------------------------
def _check_norm(backend, is_rms, kind, dtype, shape=(33, 48), device="cpu"):
    """x, the residual and the upstream gradients of y and h strided. (M, W) rows go to the kernels
    as they are; y and h are returned stacked, so that the upstream gradient's two halves, views
    with its strides, reach the backward as dy and dh."""
    width = shape[-1]
    t = _operands({"x": shape, "r": shape}, {"x", "r"}, kind, dtype, device)
    dout = strided(kind, (2, *shape), dtype, device)
    w = torch.rand(width, dtype=dtype, device=device) + 0.5
    b = torch.randn(width, dtype=dtype, device=device)

    def kernel(x, r, w, b=None):
        if is_rms:
            return torch.stack(tf.rms_norm(x, (width,), w, 1e-6, residual=r, backend=backend))
        return torch.stack(tf.layer_norm(x, (width,), w, b, 1e-5, residual=r, backend=backend))

    def ref(x, r, w, b=None):
        if is_rms:
            return torch.stack(reference.rms_norm(x, (width,), w, 1e-6, residual=r))
        return torch.stack(reference.layer_norm(x, (width,), w, b, 1e-5, residual=r))

    inputs = [t["x"], t["r"], w] if is_rms else [t["x"], t["r"], w, b]
    _check(kernel, ref, inputs, dout, what=f"{'rms' if is_rms else 'layer'}_norm[{backend}] {kind} {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_norm(backend, is_rms, kind, dtype):
    need_backend(backend)
    _check_norm(backend, is_rms, kind, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
def test_norm_triton(is_rms, kind):
    need_backend("triton")
    _check_norm("triton", is_rms, kind, torch.float32, shape=(21, 40), device=_device())
