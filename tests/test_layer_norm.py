"""LayerNorm / RMSNorm with the fused residual add: every backend against the float64 reference
(tests/helpers.py policy) and against torch.nn.LayerNorm / nn.RMSNorm, forward and every gradient."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_fast as tf
from transformer_fast import reference
from helpers import assert_close_to_reference, compare_with_reference, need_backend

WIDTHS = (1, 7, 64, 768, 1000, 4096, 65536)
LEADING = ((5,), (2, 3), (3, 1, 2))          # 1 to 3 leading dims
WIDE_LEADING = ((2,), (1, 2), (2, 1, 1))     # few rows of 65536
# (is_rms, has_weight, has_bias)
AFFINE = ((False, True, True), (False, True, False), (False, False, True), (False, False, False),
          (True, True, False), (True, False, False))


def _leading(width, i):
    return (WIDE_LEADING if width > 4096 else LEADING)[i % 3]


def _inputs(lead, width, dtype, device="cpu", *, has_weight=True, has_bias=True, residual=True, offset=0.0,
            scale=1.0):
    shape = (*lead, width)
    x = (torch.randn(shape, device=device) * scale + offset).to(dtype)
    r = torch.randn(shape, device=device).to(dtype) if residual else None
    w = (torch.rand(width, device=device) + 0.5).to(dtype) if has_weight else None
    b = torch.randn(width, device=device).to(dtype) if has_bias else None
    return x, r, w, b


def _fused(is_rms, width, eps, backend):
    """kernel(x, r, w, b) -> y (or y and h flattened into one tensor, so one random upstream
    gradient reaches both outputs)."""
    def run(x, r, w, b):
        if is_rms:
            out = tf.rms_norm(x, (width,), w, eps, residual=r, backend=backend)
        else:
            out = tf.layer_norm(x, (width,), w, b, eps, residual=r, backend=backend)
        return torch.cat([out[0].flatten(), out[1].flatten()]) if r is not None else out
    return run


def _check(backend, lead, width, dtype, is_rms, has_weight, has_bias, residual, device="cpu", offset=0.0,
           scale=1.0, what=""):
    x, r, w, b = _inputs(lead, width, dtype, device, has_weight=has_weight, has_bias=has_bias and not is_rms,
                         residual=residual, offset=offset, scale=scale)
    eps = 1e-5 if not is_rms else 1e-6
    inputs = [x, r, w, b]
    grads = tuple(i for i, t in enumerate(inputs) if t is not None)
    compare_with_reference(_fused(is_rms, width, eps, backend),
                           _fused(is_rms, width, eps, "reference"),
                           inputs, grads, what=what or f"{backend} {dtype} {lead}x{width} rms={is_rms}")


# ------------------------------------------------------------------------------------------------
# The full grid on the C++ backend; the reference backend on a part of it.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", WIDTHS)
def test_cpp_against_reference(width, dtype):
    need_backend("cpp")
    for i, ((is_rms, has_w, has_b), residual) in enumerate(itertools.product(AFFINE, (False, True))):
        _check("cpp", _leading(width, i), width, dtype, is_rms, has_w, has_b, residual)


@pytest.mark.parametrize("width", (1, 7, 1000, 65536))
def test_reference_backend_against_reference(width):
    for i, ((is_rms, has_w, has_b), residual) in enumerate(itertools.product(AFFINE[::2], (False, True))):
        _check("reference", _leading(width, i), width, torch.float32, is_rms, has_w, has_b, residual)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", (1, 7, 64, 768, 1000, 9000))
def test_triton_against_reference(width, dtype):
    """Under the interpreter: small widths; 9000 takes the looped path (two tiles, a ragged one)."""
    need_backend("triton")
    for i, ((is_rms, has_w, has_b), residual) in enumerate(itertools.product(AFFINE, (False, True))):
        if width > 1000 and i % 3:
            continue
        lead = (2,) if width > 1000 else _leading(width, i)
        _check("triton", lead, width, dtype, is_rms, has_w, has_b, residual)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "cpp"])
def test_rows_over_several_programs(backend):
    """Several programs/threads, each with several row tiles (the last ragged), and their partial
    weight gradients."""
    need_backend(backend)
    for lead, width, dtype, flags in (((70,), 1000, torch.float32, (False, True, True, True)),
                                      ((2, 41), 2000, torch.float16, (True, True, False, False))):
        if backend == "triton":  # the interpreter's 4 backward programs take 2+ row tiles each
            from transformer_fast.kernels.layer_norm import row_tiles

            block_m = row_tiles(width, backward=True)[0]
            assert math.prod(lead) > 4 * 2 * block_m and math.prod(lead) % block_m, (lead, block_m)
        _check(backend, lead, width, dtype, *flags)


@pytest.mark.parametrize("backend, threads", [("cpp", 1), ("cpp", 2), pytest.param("triton", 0, marks=pytest.mark.gpu)])
def test_weight_gradient_over_many_rows(backend, threads):
    """dweight and dbias sum thousands of rows per thread or program: within 2x torch's error too,
    with the C++ kernel's rows in one block (one thread) or two. (Triton on a GPU only: the
    interpreter's tl.sum is numpy's, which adds a tile's rows in order.)"""
    need_backend(backend)
    device = "cuda" if backend == "triton" else "cpu"
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        _check(backend, (5888,), 7, torch.float32, False, True, True, True, device=device)
        _check(backend, (2000,), 32, torch.float32, False, True, True, False, device=device)  # C++: into the results
        _check(backend, (3, 2000), 96, torch.float32, False, True, True, False, device=device)
        _check(backend, (4100,), 1000, torch.float32, True, True, False, False, device=device)
    finally:
        torch.set_num_threads(before)


@pytest.mark.triton
def test_partial_sums_over_several_steps(monkeypatch):
    """dweight and dbias are the column sums of the backward's partial-sum rows, one per program:
    with 75 programs (more than the reduction's steps of SUMS_TILE rows, a ragged last one) and
    a width that ends in a ragged column block, in float32 and float16 parameters. (Not bfloat16
    here: the interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest.)"""
    need_backend("triton")
    from transformer_fast.kernels import layer_norm as kln

    monkeypatch.setattr(kln, "backward_programs", lambda block_n, single, device: 75)
    kln._backward_plans.clear()  # plans made with the real program count
    try:
        assert kln.SUMS_TILE[1] < 75 and 1000 % kln.SUMS_TILE[0]
        _check("triton", (300,), 1000, torch.float32, False, True, True, True)
        _check("triton", (3, 100), 1000, torch.float16, False, True, True, False)
        assert {plan.partial_shape for plan in kln._backward_plans.plans.values()} == {(75, 1000)}
    finally:
        kln._backward_plans.clear()


@pytest.mark.triton
def test_triton_widest_rows():
    need_backend("triton")
    _check("triton", (2,), 65536, torch.float32, False, True, True, True)
    _check("triton", (1,), 65536, torch.float16, True, True, False, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", WIDTHS + (8192, 8193, 20000))
def test_triton_gpu_full_grid(width, dtype):
    for i, ((is_rms, has_w, has_b), residual) in enumerate(itertools.product(AFFINE, (False, True))):
        lead = _leading(width, i) if width <= 4096 else ((64,), (4, 16), (2, 3, 5))[i % 3]
        _check("triton", lead, width, dtype, is_rms, has_w, has_b, residual, device="cuda")
    _check("triton", (3, 7), width, dtype, False, True, True, True, device="cuda", offset=1e4 if dtype ==
           torch.float32 else 100.0)


# ------------------------------------------------------------------------------------------------
# Numerics: a large common offset with a small variance
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton), "reference"])
@pytest.mark.parametrize("width", (7, 1000, 65536))
def test_large_offset(backend, width):
    need_backend(backend)
    if backend == "triton" and width > 1000:
        width = 9000
    lead = (2,) if width > 1000 else (3, 5)
    for residual in (False, True):
        _check(backend, lead, width, torch.float32, False, True, True, residual, offset=1e4, scale=1.0,
               what=f"{backend} offset 1e4 width {width} residual={residual}")
        _check(backend, lead, width, torch.float32, False, False, False, residual, offset=1e4, scale=0.01,
               what=f"{backend} offset 1e4 std 0.01 width {width} residual={residual}")
    if backend == "cpp":
        _check(backend, lead, width, torch.bfloat16, False, True, True, True, offset=100.0)
        _check(backend, lead, width, torch.float16, False, True, True, True, offset=1e3)


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("width", (7, 600))
def test_offset_much_larger_than_spread(backend, width):
    """Rows of mean -1000 and standard deviation 1, each kept whole in one tile. LayerNorm does
    not change when a row is shifted by a constant, so the fp32 reference taken about each row's
    first element is as valid as the plain one, and far more accurate here: a plain fp32 sum of
    the row loses the low bits that the spread lives in. The kernels must match that accuracy
    (the Triton kernel's plain sum was up to 70x off it, as torch's own layer_norm is)."""
    need_backend(backend)
    for _ in range(3):
        x = torch.randn(4, width) - 1000.0
        ref64 = reference.layer_norm(x.double(), (width,))
        shifted32 = reference.layer_norm(x - x[:, :1], (width,))
        out = tf.layer_norm(x, (width,), backend=backend)
        assert_close_to_reference(out, ref64, shifted32, what=f"{backend} offset -1000 width {width}")


def test_cpp_statistics_of_large_offset():
    """mean and rstd themselves, against float64 (the first element an outlier, too)."""
    need_backend("cpp")
    from transformer_fast import _build

    C = _build.extension()
    for width in (1, 15, 16, 17, 1000, 65536):
        x = torch.randn(3, width) * 0.5 + 1e4
        x[1, 0] = 2e4  # an outlier where the kernel takes its shift
        _, _, mean, rstd = C.layer_norm_forward(x, None, None, None, 1e-5, False)
        x64 = x.double()
        var = x64.var(dim=1, unbiased=False)
        torch.testing.assert_close(mean.double(), x64.mean(1), rtol=2e-7, atol=0)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=2e-5, atol=0)


# ------------------------------------------------------------------------------------------------
# Layouts: row-strided slices, transposed leading dims, 2-D normalized_shape, mixed weight dtype
# ------------------------------------------------------------------------------------------------
def _strided_cases(device="cpu", dtype=torch.float32):
    """(3, 4, 64) tensors with unusual strides."""
    t = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    yield "row-strided slice", t(3, 4, 80)[:, :, 3:67]                # a view, row stride 80
    yield "every other row", t(3, 8, 64)[:, ::2]                        # a view, row stride 128
    yield "transposed leading dims", t(4, 3, 64).transpose(0, 1)        # needs a copy
    yield "expanded", t(1, 4, 64).expand(3, 4, 64)                      # stride 0


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton), "reference"])
def test_non_contiguous_inputs(backend):
    need_backend(backend)
    for name, x in _strided_cases():
        for (r_name, r), is_rms in itertools.product(_strided_cases(), (False, True)):
            w = torch.rand(64) + 0.5
            b = None if is_rms else torch.randn(64)
            inputs = [x, r, w, b]
            grads = tuple(i for i, t in enumerate(inputs) if t is not None)
            compare_with_reference(_fused(is_rms, 64, 1e-5, backend), _fused(is_rms, 64, 1e-5, "reference"),
                                   inputs, grads, what=f"{backend} x {name}, residual {r_name}, rms={is_rms}")


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton)])
def test_non_contiguous_upstream_gradient(backend):
    """dy of stride 0 (from .sum()) and a transposed dh."""
    need_backend(backend)
    x, r = torch.randn(4, 33, requires_grad=True), torch.randn(4, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    dh = torch.randn(33, 4).t()
    y, h = tf.layer_norm(x, 33, w, None, residual=r, backend=backend)
    (y.sum() + (h * dh).sum()).backward()
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64, h64 = reference.layer_norm(x64, (33,), w64, None, residual=r64)
    (y64.sum() + (h64 * dh.double()).sum()).backward()
    for got, exp in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton)])
def test_two_dim_normalized_shape(backend):
    need_backend(backend)
    x, r = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    w, b = torch.randn(5, 12), torch.randn(5, 12)

    def run(be):
        return lambda x, r, w, b: torch.cat([t.flatten() for t in tf.layer_norm(x, (5, 12), w, b, residual=r,
                                                                                   backend=be)])
    compare_with_reference(run(backend), run("reference"), [x, r, w, b], (0, 1, 2, 3), what="normalized (5, 12)")


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_weight_with_low_precision_input(backend, dtype):
    """weight/bias may be float32 for a bf16/fp16 input (mixed precision): y has the input's dtype,
    dweight/dbias the parameters'."""
    need_backend(backend)
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        dtype = torch.float16
    x = torch.randn(6, 100).to(dtype).requires_grad_()
    w, b = (torch.rand(100) + 0.5).requires_grad_(), torch.randn(100, requires_grad=True)
    y = tf.layer_norm(x, (100,), w, b, backend=backend)
    assert y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = reference.layer_norm(x64, (100,), w64, b64)
    y64.backward(dy.double())
    xl, wl, bl = (t.detach().requires_grad_() for t in (x, w.to(dtype), b.to(dtype)))
    yl = reference.layer_norm(xl, (100,), wl, bl)
    yl.backward(dy)
    assert_close_to_reference(y, y64, yl, what="y")
    assert_close_to_reference(x.grad, x64.grad, xl.grad, what="dx")
    # float32 parameter gradients summed in float32: at least as close as the low-precision reference
    assert_close_to_reference(w.grad, w64.grad, wl.grad.float(), what="dweight")
    assert_close_to_reference(b.grad, b64.grad, bl.grad.float(), what="dbias")


def _default_rms_eps(dtype):
    """torch's rms_norm eps=None: the machine epsilon of the type it computes in."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


@pytest.mark.parametrize("backend, dtype", [
    *(("cpp", d) for d in (torch.bfloat16, torch.float16, torch.float32)),
    *(("reference", d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)),
    *(pytest.param("triton", d, marks=pytest.mark.triton) for d in (torch.float16, torch.float32))])
def test_rms_norm_default_eps_is_that_of_the_type_it_computes_in(backend, dtype):
    """eps=None is float32's machine epsilon for bf16/fp16 input, as torch computes (not the
    input dtype's, 7.8e-3 for bf16, which swamps the mean square of rows of scale 0.01): the
    output and gradient of such rows as close to float64 as torch's, a module's too."""
    need_backend(backend)
    x = (torch.randn(3, 64) * 0.01).to(dtype).requires_grad_()
    w = (torch.rand(64) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(3, 64, dtype=dtype)
    y = tf.rms_norm(x, (64,), w, backend=backend)
    y.backward(dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = reference.rms_norm(x64, (64,), w64, _default_rms_eps(dtype))
    y64.backward(dy.double())
    xt, wt = (t.detach().requires_grad_() for t in (x, w))
    yt = F.rms_norm(xt, (64,), wt)
    yt.backward(dy)
    assert_close_to_reference(y, y64, yt, what="y")
    assert_close_to_reference(x.grad, x64.grad, xt.grad, what="dx")
    m = nn.RMSNorm(64, dtype=dtype)
    expected = m(x.detach())
    assert_close_to_reference(tf.convert(m)(x.detach()), y64.detach() / w64.detach(), expected, what="module")


@pytest.mark.parametrize("dtype, weight_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float64), (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16), (torch.float64, torch.bfloat16)])
def test_rms_norm_weight_of_any_dtype(dtype, weight_dtype):
    """torch's rms_norm takes a weight of any floating dtype (a bf16 nn.RMSNorm on float32
    activations): y has the input's dtype, dweight the weight's, and both are as close to the
    float64 reference as torch's own F.rms_norm."""
    x = torch.randn(5, 40, dtype=dtype, requires_grad=True)
    w = (torch.rand(40) + 0.5).to(weight_dtype).requires_grad_()
    y = tf.rms_norm(x, (40,), w)
    dy = torch.randn(5, 40, dtype=dtype)
    y.backward(dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    reference.rms_norm(x64, (40,), w64, _default_rms_eps(dtype)).backward(dy.double())
    xt, wt = (t.detach().requires_grad_() for t in (x, w))
    yt = F.rms_norm(xt, (40,), wt)
    yt.backward(dy)
    assert y.dtype == yt.dtype == dtype and w.grad.dtype == weight_dtype
    y64 = reference.rms_norm(x64.detach(), (40,), w64.detach(), _default_rms_eps(dtype))
    assert_close_to_reference(y, y64, yt, what="y")
    assert_close_to_reference(x.grad, x64.grad, xt.grad, what="dx")
    assert_close_to_reference(w.grad, w64.grad, wt.grad, what="dweight")
    m = nn.RMSNorm(40, dtype=weight_dtype)  # a converted module takes the inputs torch's takes
    expected = m(x.detach())
    got = tf.convert(m)(x.detach())
    assert got.dtype == expected.dtype == dtype
    y64 = reference.rms_norm(x64.detach(), (40,), None, _default_rms_eps(dtype))
    assert_close_to_reference(got, y64, expected, what="converted module")


def test_cpp_weight_gradient_is_deterministic():
    need_backend("cpp")
    x, dy = torch.randn(257, 300), torch.randn(257, 300)
    w, b = torch.randn(300, requires_grad=True), torch.randn(300, requires_grad=True)
    grads = []
    for _ in range(3):
        y = tf.layer_norm(x, 300, w, b, backend="cpp")
        grads.append(torch.autograd.grad(y, (w, b), dy))
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1])


@pytest.mark.parametrize("backend", ["cpp", pytest.param("triton", marks=pytest.mark.triton), "reference"])
def test_zero_rows(backend):
    """No rows: empty results of the input's shape and gradients of it, whatever the strides (an
    empty slice with a stride of 2 along the row must pass the kernels' unit-stride check)."""
    need_backend(backend)
    inputs = {"contiguous": lambda: torch.randn(0, 3, 16),
              "stride 2 along the row": lambda: torch.randn(0, 3, 32)[..., ::2],
              "rows, stride 2 along the row": lambda: torch.randn(0, 32)[:, ::2],
              "permuted": lambda: torch.randn(16, 3, 0).permute(2, 1, 0)}
    for (name, make), is_rms in itertools.product(inputs.items(), (False, True)):
        norm = tf.rms_norm if is_rms else tf.layer_norm
        x, r = make().requires_grad_(), make().requires_grad_()
        w = torch.rand(16, requires_grad=True)
        y = norm(x, (16,), w, backend=backend)
        y2, h = norm(x, (16,), w, residual=r, backend=backend)
        assert y.shape == y2.shape == h.shape == x.shape, name
        (y.sum() + y2.sum() + h.sum()).backward()
        assert x.grad.shape == x.shape and r.grad.shape == r.shape, name
        assert torch.equal(w.grad, torch.zeros(16)), name  # no rows: nothing to sum


@pytest.mark.parametrize("fn", [tf.layer_norm, tf.rms_norm], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,normalized_shape", [((3, 0), (0,)), ((2, 3, 0), (3, 0)), ((0, 0), (0,))])
def test_rows_of_no_elements(fn, shape, normalized_shape):
    """As torch's: empty outputs of the input's shape, and gradients of it (a reshape of
    these must not raise)."""
    x = torch.randn(shape, requires_grad=True)
    r = torch.randn(shape)
    y = fn(x, normalized_shape)
    y2, h = fn(x, normalized_shape, residual=r)
    assert y.shape == y2.shape == h.shape == x.shape
    (y.sum() + y2.sum()).backward()
    assert x.grad.shape == x.shape


# ------------------------------------------------------------------------------------------------
# Modules: drop-in for torch.nn, state dicts both ways, torch.compile
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [True, False])
def test_modules_match_torch(kind, affine):
    torch.manual_seed(1)
    shape = (7, 48)
    if kind == "layer_norm":
        ours, theirs = tf.LayerNorm(48, elementwise_affine=affine), nn.LayerNorm(48, elementwise_affine=affine)
    else:
        ours, theirs = tf.RMSNorm(48, eps=1e-6, elementwise_affine=affine), nn.RMSNorm(48, eps=1e-6,
                                                                                     elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    back = type(theirs)(48, **({"eps": 1e-6} if kind == "rms_norm" else {}), elementwise_affine=affine)
    back.load_state_dict(ours.state_dict(), strict=True)
    for p, q in zip(back.parameters(), theirs.parameters()):
        assert torch.equal(p, q)

    x = torch.randn(*shape) * 3 + 2
    theirs64 = type(theirs)(48, **({"eps": 1e-6} if kind == "rms_norm" else {}), elementwise_affine=affine).double()
    theirs64.load_state_dict(theirs.state_dict())
    xs = [x.clone().requires_grad_() for _ in range(3)]
    outs = [ours(xs[0]), theirs64(xs[1].double()), theirs(xs[2])]
    dy = torch.randn(*shape)
    for o in outs:
        o.backward(dy.to(o.dtype))
    assert_close_to_reference(outs[0], outs[1], outs[2], what=f"{kind} module output")
    assert_close_to_reference(xs[0].grad, xs[1].grad, xs[2].grad, what=f"{kind} module input grad")
    if affine:
        for p, p64, p32 in zip(ours.parameters(), theirs64.parameters(), theirs.parameters()):
            assert_close_to_reference(p.grad, p64.grad, p32.grad, what=f"{kind} module parameter grad")


def test_module_residual_forward():
    m = tf.LayerNorm(32)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    y, h = m(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (32,), m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph_modules():
    torch._dynamo.reset()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = tf.LayerNorm(32), tf.RMSNorm(32)
            self.proj = nn.Linear(32, 32)

        def forward(self, x, r):
            y, h = self.norm1(x, r)
            return self.norm2(self.proj(y)) + h

    model = Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, r = torch.randn(3, 5, 32, requires_grad=True), torch.randn(3, 5, 32)
    out_c = compiled(x, r)
    out_c.sum().backward()
    grad_c = x.grad.clone()
    x.grad = None
    out_e = model(x, r)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(grad_c, x.grad)


# ------------------------------------------------------------------------------------------------
# Bad inputs and op registration
# ------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"does not end with normalized_shape \(5,\)"):
        tf.layer_norm(x, (5,))
    with pytest.raises(ValueError, match=r"does not end with normalized_shape"):
        tf.rms_norm(x, (4, 6, 1))
    with pytest.raises(ValueError, match=r"weight must have shape normalized_shape = \(6,\), got \(5,\)"):
        tf.layer_norm(x, (6,), weight=torch.ones(5))
    with pytest.raises(ValueError, match=r"bias must have shape"):
        tf.layer_norm(x, (6,), weight=torch.ones(6), bias=torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"weight must have the input's dtype torch.float32, got torch.float64"):
        tf.layer_norm(x, (6,), weight=torch.ones(6, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"input's dtype torch.float16 or torch.float32, got torch.float64"):
        tf.layer_norm(x.half(), (6,), weight=torch.ones(6, dtype=torch.float64))
    y, h = tf.layer_norm(x, (6,), residual=x.double())  # the add promotes, as x + r does
    torch.testing.assert_close(h, x.double() * 2, atol=0, rtol=0)
    assert y.dtype == torch.float64
    with pytest.raises(ValueError, match="residual is on meta but input is on cpu"):
        tf.rms_norm(x, (6,), residual=torch.empty(4, 6, device="meta"))
    with pytest.raises(ValueError, match=r"residual must have the input's shape \(4, 6\), got \(6,\)"):
        tf.layer_norm(x, (6,), residual=x[0])
    with pytest.raises(ValueError, match="eps must be >= 0"):
        tf.layer_norm(x, (6,), eps=-1.0)
    with pytest.raises(TypeError, match="floating-point"):
        tf.layer_norm(x.long(), (6,))
    with pytest.raises(ValueError, match="normalized_shape"):
        tf.LayerNorm(5)(x)


def _op_cases(dtype=torch.float32):
    x, r = torch.randn(6, 40, dtype=dtype, requires_grad=True), torch.randn(6, 40, dtype=dtype, requires_grad=True)
    w = torch.randn(40, dtype=dtype, requires_grad=True)
    b = torch.randn(40, dtype=dtype, requires_grad=True)
    xs = torch.randn(6, 50, dtype=dtype)[:, 5:45].requires_grad_()  # row stride 50
    ops = torch.ops.transformer_fast
    return [
        (ops.layer_norm_forward, (x, r, w, b, 1e-5, False)),
        (ops.layer_norm_forward, (x, None, w, None, 1e-5, False)),
        (ops.layer_norm_forward, (x, None, None, b, 1e-5, False)),
        (ops.layer_norm_forward, (xs, r, None, None, 1e-5, True)),
        (ops.layer_norm_forward, (x, r, w, None, 1e-6, True)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    """The kernel op on the CPU (the dispatcher's C++ kernel): schema, fake kernel, autograd, AOT."""
    for op, args in _op_cases(dtype):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_op_kernels_keep_the_input_shape(lead, is_rms, residual):
    """The Triton kernel ops as the CUDA key runs them (transformer_fast/_device_kernels.py),
    called directly: rows are reshaped only where the input is not 2-D, and every result comes
    back in its input's shape, equal to the float64 reference (forward and backward)."""
    need_backend("triton")
    from transformer_fast._device_kernels import op_kernel

    forward, backward = (op_kernel(f"layer_norm_{step}", "triton", "cpu") for step in ("forward", "backward"))
    width, eps = 33, 1e-5
    x, r, w, b = _inputs(lead, width, torch.float32, has_bias=not is_rms, residual=residual)
    y, h, mean, rstd = forward(x, r, w, b, eps, is_rms)
    dy = torch.randn_like(x)
    dx, dw, db = backward(dy, None, x if r is None else h, w, b, mean, rstd, eps, is_rms)

    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    x64, r64, w64, b64 = leaves
    if is_rms:
        out = reference.rms_norm(x64, (width,), w64, eps, residual=r64)
    else:
        out = reference.layer_norm(x64, (width,), w64, b64, eps, residual=r64)
    y64 = out[0] if residual else out
    y64.backward(dy.double())
    assert y.shape == x.shape and dx.shape == x.shape and (not residual or h.shape == x.shape)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    if residual:
        torch.testing.assert_close(h, x + r)
    # dx is the gradient with respect to h = x + r, which is also x's and r's
    torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=1e-4, atol=1e-4)
    if not is_rms:
        torch.testing.assert_close(db.double(), b64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("is_rms", [True, False])
def test_weight_gradient_of_a_few_dozen_rows(is_rms):
    """dweight over 64-200 rows (one chunk of the C++ sums or a few) within 2x torch's error; torch's
    rms_norm sums its rows pairwise (in chunks of 64 summed in order, RMSNorm's reached 2.4x). One
    thread: the rows in one block."""
    need_backend("cpp")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_weight_gradients(is_rms)
    finally:
        torch.set_num_threads(before)


def _check_weight_gradients(is_rms):
    for seed, (M, N) in enumerate([(64, 1024)] * 6 + [(200, 512)]):
        torch.manual_seed(seed)
        x, w, dy = torch.randn(M, N) * 2 + 0.5, torch.randn(N), torch.randn(M, N)

        def weight_grad(fn, *tensors):
            x, w, dy = tensors
            w = w.clone().requires_grad_()
            (fn(x, (N,), w, 1e-5) if is_rms else fn(x, (N,), w, None, 1e-5)).backward(dy)
            return w.grad

        ours, theirs = (tf.rms_norm, F.rms_norm) if is_rms else (tf.layer_norm, F.layer_norm)
        exact = weight_grad(theirs, x.double(), w.double(), dy.double())
        assert_close_to_reference(weight_grad(ours, x, w, dy), exact, weight_grad(theirs, x, w, dy), atol=1e-7,
                                  what=f"dweight seed {seed} ({M}, {N})")
