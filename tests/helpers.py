"""The comparison policy shared by every kernel test.

A kernel in dtype T is judged against the float64 reference: its error may be at most twice the
error of the same reference computed in T (the policy flash-attention uses), plus a small
absolute slack for results whose reference error happens to be ~0.
"""
import pytest
import torch

import transformer_fast as tf

# Absolute slack per dtype: a few ulps at magnitude ~1, far below a real bug's error.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float64: 1e-12}


def max_error(a, b):
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, torch.zeros_like(a), (a - b).abs()).max().nan_to_num(nan=float("inf")).item()


def assert_close_to_reference(actual, reference64, reference_lowp, *, what="output", factor=2.0, atol=None):
    """actual: the kernel's result; reference64: the float64 reference; reference_lowp: the
    reference computed in the kernel's dtype (from the same rounded inputs), or a list of such
    references (other formulations of the same quantity): the reference error is the largest."""
    assert not torch.isnan(actual).any(), f"{what}: the kernel produced NaN"
    atol = ATOL[actual.dtype] if atol is None else atol
    err = max_error(actual, reference64)
    lowps = reference_lowp if isinstance(reference_lowp, (list, tuple)) else [reference_lowp]
    ref_err = max(max_error(r, reference64) for r in lowps)
    bound = factor * ref_err + atol
    assert err <= bound, (f"{what}: max error {err:.3e} > {factor} x reference error {ref_err:.3e} "
                          f"+ {atol:.1e} (dtype {actual.dtype})")


def compare_with_reference(kernel_fn, reference_fn, inputs, grad_inputs=(), *, what="", factor=2.0, atol=None,
                           gradient_formulation=None):
    """Runs kernel_fn(*inputs) and reference_fn in float64 and in the inputs' dtype, checks the
    output and the gradients w.r.t. the inputs at positions `grad_inputs` (a random upstream
    gradient) with assert_close_to_reference. Non-tensor inputs pass through unchanged.

    gradient_formulation(inputs, dout) -> gradients: where a kernel's backward is specified by
    other equations than autograd's (attention's delta = rowsum(dO * O)), those equations
    evaluated in the inputs' dtype by plain torch ops; their error also counts as the
    reference's error in that dtype."""
    def prepared(dtype):
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                # detach(), not clone(): a clone of a view with gaps (q sliced out of a fused QKV
                # projection) would be contiguous, and the kernel would never see the layout.
                x = x.detach().to(dtype) if dtype is not None else x.detach()
                x.requires_grad_(i in grad_inputs)
            out.append(x)
        return out

    lowp = next(x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point())
    args_k, args_64, args_lp = prepared(None), prepared(torch.float64), prepared(lowp)
    out_k = kernel_fn(*args_k)
    out_64 = reference_fn(*args_64)
    out_lp = reference_fn(*args_lp)
    assert_close_to_reference(out_k, out_64, out_lp, what=f"{what} output", factor=factor, atol=atol)
    if grad_inputs:
        # The upstream gradient as the kernel receives it (in its output's dtype), for every run:
        # the float64 reference then differentiates exactly the kernel's inputs. Drawn in float64
        # and rounded only for the kernel, its rounding would be an error every low-precision
        # result shares, and one that the plain-torch result's own error can cancel by chance.
        dout = torch.randn_like(out_64).to(out_k.dtype).to(torch.float64)
        g_k = torch.autograd.grad(out_k, [args_k[i] for i in grad_inputs], dout.to(out_k.dtype))
        g_64 = torch.autograd.grad(out_64, [args_64[i] for i in grad_inputs], dout)
        g_lp = torch.autograd.grad(out_lp, [args_lp[i] for i in grad_inputs], dout.to(out_lp.dtype))
        g_alt = [[g] for g in g_lp]
        if gradient_formulation is not None:
            for alt, g in zip(g_alt, gradient_formulation(prepared(lowp), dout.to(lowp))):
                alt.append(g)
        for i, a, b, c in zip(grad_inputs, g_k, g_64, g_alt):
            assert_close_to_reference(a, b, c, what=f"{what} grad of input {i}", factor=factor, atol=atol)
    return out_k


def kernel_device():
    """Where the Triton kernels run: a GPU, or the interpreter on CPU tensors."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def unavailable_reason(backend):
    """None where ``backend`` runs on some device here, else why it does not (on CPU tensors)."""
    status = tf.available_backends()[backend]
    return None if "ok" in status.values() else status["cpu"]


# A module of Triton tests: marked `triton`, skipped (with the reason) where the backend cannot run.
TRITON_TESTS = [pytest.mark.triton,
                pytest.mark.skipif(unavailable_reason("triton") is not None,
                                   reason=f"triton backend unavailable: {unavailable_reason('triton')}")]


# The backends a test parametrized over "backend" runs on, and the low-precision dtype each is tested
# in (the interpreter's bf16 products are unreliable, so Triton takes fp16).
BACKENDS = ["reference", "cpp", pytest.param("triton", marks=pytest.mark.triton)]
LOW_PRECISION = {"reference": torch.float32, "cpp": torch.bfloat16, "triton": torch.float16}


def need_backend(backend):
    """Skips the calling test, with the reason, where ``backend`` is unavailable."""
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(f"{backend} backend unavailable: {reason}")


@pytest.fixture
def skip_unavailable_backend(request):
    """Skips a test parametrized with an unavailable ``backend``, with the reason. A module opts
    in with ``pytestmark = pytest.mark.usefixtures("skip_unavailable_backend")``."""
    backend = request.node.callspec.params.get("backend") if hasattr(request.node, "callspec") else None
    if backend is not None:
        need_backend(backend)


def result_strides(like, width):
    """The strides torch's attention gives a result of ``like`` (B, H, N, W) with last dim
    ``width``: (B, N, H, width) memory where ``like`` keeps each row's heads together (its head
    stride below its row stride), else contiguous; packed (T, H, W) results are contiguous."""
    if like.dim() == 4 and like.stride(1) < like.stride(2):
        B, H, N = like.shape[:3]
        return torch.empty(B, N, H, width).transpose(1, 2).stride()
    return torch.empty(*like.shape[:-1], width).stride()


# Two fp32 models computing the same function: what their kernels' fp32 error allows at the small
# sizes the model tests use.
MODEL_TOL = dict(atol=1e-5, rtol=1e-4)


def compare_logits_and_grads(ref, ours, inputs):
    """`ours(**inputs).logits` and every parameter gradient (one random upstream gradient) against
    `ref`'s, within MODEL_TOL; a parameter without a gradient in one must have none in the other."""
    out_r = ref(**inputs).logits
    out_o = ours(**inputs).logits
    torch.testing.assert_close(out_o, out_r, **MODEL_TOL)
    dout = torch.randn_like(out_r)
    params_r = [p for p in ref.parameters() if p.requires_grad]
    params_o = [p for p in ours.parameters() if p.requires_grad]
    grads_r = torch.autograd.grad(out_r, params_r, dout, allow_unused=True)
    grads_o = torch.autograd.grad(out_o, params_o, dout, allow_unused=True)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, grads_o, grads_r):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, **MODEL_TOL, msg=lambda m: f"grad of {name}: {m}")


def check_seeded_draw(draw, check, seed, backend="cpp", device="cpu", **kwargs):
    """check(draw(seed, **kwargs), backend, device) for a fuzz module's random call, on the drawn
    backend where `backend` is "cpp" (named, "auto" or a module, as the draw says); a failure names
    the seed and the configuration, so the module's check_draw(seed) reruns it."""
    c = draw(seed, **kwargs)
    c["backend"] = backend = c["backend"] if backend == "cpp" else backend
    torch.manual_seed(seed)
    try:
        check(c, backend, device)
    except AssertionError as e:
        raise AssertionError(f"draw {seed} ({c}): {e}") from e


def check_seeded_draws(draw, check, seeds, *args, **kwargs):
    """check_seeded_draw for every seed; fails naming every failing draw, not only the first."""
    failures = []
    for seed in seeds:
        try:
            check_seeded_draw(draw, check, seed, *args, **kwargs)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} of {len(seeds)} draws failed:\n" + "\n".join(failures)
