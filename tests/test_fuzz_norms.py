"""Random LayerNorm/RMSNorm calls against the float64 reference with the package's comparison policy
(tests/helpers.py: at most 2x the error of the reference evaluated in the call's dtype, or of torch's
own F.layer_norm / F.rms_norm in that dtype, or for gradients of the kernels' fused equations in
that dtype, whichever errs most: `_torch_norm`, `_kernel_form_gradients`): dtypes,
0-129 rows in 1-3 leading dims, odd and non-power-of-two widths (and 2-dim normalized shapes),
row-sliced, every-other-row, transposed, expanded (stride 0) and row-stride-2 inputs and
residuals, weight/bias present or not (float32 parameters with half inputs, strided parameters),
residuals of the input's or another dtype (the add promotes), eps values (rms_norm's None = the
dtype's epsilon), large and small magnitudes, large offsets (cancellation of the mean) and
constant or zero rows (zero variance). The functions on the C++ backend (named, and through the
dispatcher with backend="auto"), the LayerNorm/RMSNorm modules, and the Triton backend (under
the interpreter without a GPU). Checked: y, the pre-norm sum h, and the gradients of x, the
residual, weight and bias, their dtypes and shapes; refused combinations (LayerNorm parameters of a
third dtype, a negative eps) must raise TypeError/ValueError (RMSNorm takes a weight of any dtype, as
torch's does). Draws are seeded: a failure names its
seed and configuration, and `check_draw(seed)` reruns it.

Slow: about 15 s for the C++ backend's 8,000 draws, 40 s for the Triton backend's 800 under the
interpreter (fp32/fp16 inputs: it refuses bfloat16, whose conversion it truncates)."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from helpers import TRITON_TESTS, assert_close_to_reference, check_seeded_draw, check_seeded_draws, kernel_device

pytestmark = pytest.mark.slow

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIDTHS = (1, 2, 3, 7, 17, 64, 100, 129, 768, 1000, 4097)
ROWS = (0, 1, 2, 3, 17, 129)
LAYOUTS = ("contiguous", "contiguous", "row-sliced", "every-other-row", "transposed", "expanded", "row-stride-2")


def _split(rows, rnd):
    """rows as 1-3 leading dims."""
    ndim = rnd.choice([1, 1, 2, 3])
    if ndim == 1:
        return (rows,)
    a = rnd.choice([d for d in range(1, rows + 1) if rows % d == 0]) if rows else rnd.choice([0, 2])
    rest = rows // a if a else rnd.choice([0, 3])
    return (a, rest) if ndim == 2 else (a, 1, rest) if rnd.random() < 0.5 else (1, a, rest)


def draw(seed, dtypes=DTYPES, widths=WIDTHS, max_elements=40_000, modules=True):
    rnd = random.Random(seed)
    dtype = rnd.choice(dtypes)
    is_rms = rnd.random() < 0.5
    width = rnd.choice(widths)
    normalized = (width,)
    if rnd.random() < 0.15 and width > 1:  # a 2-dim normalized shape
        first = rnd.choice([d for d in range(1, width + 1) if width % d == 0])
        normalized = (first, width // first)
    rows = rnd.choice([r for r in ROWS if r * width <= max_elements] or [1])
    lead = _split(rows, rnd)
    residual = rnd.choice([None, None, "same", "same", "other"])
    # the add promotes, as x + r does: bf16 + fp32 -> fp32, fp16 + bf16 -> fp32
    other = {torch.float32: torch.bfloat16, torch.bfloat16: rnd.choice([torch.float32, torch.float16]),
             torch.float16: rnd.choice([torch.float32, torch.bfloat16])}[dtype]
    compute = dtype if residual != "other" else torch.promote_types(dtype, other)
    has_weight = rnd.random() < 0.7
    has_bias = not is_rms and rnd.random() < 0.6
    # parameters: the compute dtype, float32, or a third dtype (refused by LayerNorm)
    param_dtype = rnd.choice([compute, compute, torch.float32, rnd.choice([d for d in DTYPES if d != compute])])
    magnitude = rnd.choice(["unit", "unit", "unit", "large", "small", "offset", "offset", "constant", "zero"])
    if magnitude == "zero" and not is_rms:
        magnitude = "constant"
    scale, offset = 1.0, 0.0
    if magnitude == "large":
        scale = rnd.choice([1e2, 1e4]) if compute != torch.float16 else 30.0
    elif magnitude == "small":
        scale = rnd.choice([1e-3, 1e-5])
    elif magnitude == "offset":
        offset = rnd.choice([-1e3, 1e3, 1e4]) if compute != torch.float16 else rnd.choice([-100.0, 100.0])
        scale = rnd.choice([1.0, 0.1]) if compute != torch.float16 else 1.0
    eps_choices = [1e-5, 1e-6, 1e-3, 0.1] + ([None, None] if is_rms else [])
    if compute == torch.float16 and magnitude in ("small", "constant", "zero"):
        # var + eps ~ 1e-6 overflows the fp16 reference's gradient ((var + eps)^-1.5 > 65504): no test at all
        eps_choices = [1e-3, 0.1]
    if width >= 3 and magnitude in ("unit", "large"):  # eps 0 where no row is constant
        eps_choices.append(0.0)
    eps = rnd.choice(eps_choices) if rnd.random() > 0.02 else -1e-5  # refused: ValueError
    module = modules and param_dtype == compute and (has_weight or not has_bias)
    backend = rnd.choice(["cpp", "cpp", "auto"] + (["module"] if module else []))
    return dict(dtype=dtype, is_rms=is_rms, normalized=normalized, lead=lead, residual=residual,
                residual_dtype=other if residual == "other" else dtype if residual else None, compute=compute,
                weight=has_weight, bias=has_bias, param_dtype=param_dtype, magnitude=magnitude, scale=scale,
                offset=offset, eps=eps, backend=backend, x_layout=rnd.choice(LAYOUTS), r_layout=rnd.choice(LAYOUTS),
                strided_params=rnd.random() < 0.2, loss_on_h=rnd.random() < 0.7,
                int_shape=len(normalized) == 1 and rnd.random() < 0.2)


def laid_out(values, layout, device):
    """`values` copied into a view of the given layout on `device` (with NaN around it, so that a
    kernel reading outside the view picks up NaN)."""
    shape = values.shape

    def nan(*s):
        return torch.full(s, float("nan"), dtype=values.dtype, device=device)

    if layout == "row-sliced":  # each row a slice of a wider one
        view = nan(*shape[:-1], shape[-1] + 5)[..., 2:2 + shape[-1]]
    elif layout == "every-other-row" and len(shape) >= 2:
        view = nan(shape[0] * 2, *shape[1:])[::2]
    elif layout == "transposed" and len(shape) >= 3:  # the first two dims swapped in memory
        view = nan(shape[1], shape[0], *shape[2:]).transpose(0, 1)
    elif layout == "row-stride-2":  # no unit stride along the row: the op copies
        view = nan(*shape, 2)[..., 0]
    elif layout == "expanded" and len(shape) >= 2 and shape[0] > 0:  # stride 0: the rows repeat
        return values[:1].to(device).expand(shape)
    else:
        return values.to(device)
    view.copy_(values)
    return view


def make_inputs(c, device="cpu"):
    shape = (*c["lead"], *c["normalized"])

    def values(dt, scale, offset):
        t = torch.randn(shape) * scale + offset
        if c["magnitude"] in ("constant", "zero") and t.numel():
            # every other row of one value (zero variance; zero for "zero"), the same rows in x and
            # the residual, so that their sum h has them too
            rows = t.reshape(-1, math.prod(c["normalized"]))
            const = rows[:, :1].clone() if c["magnitude"] == "constant" else torch.zeros_like(rows[:, :1])
            rows[::2] = const[::2].expand_as(rows[::2])
            t = rows.reshape(shape)
        return t.to(dt)

    x = laid_out(values(c["dtype"], c["scale"], c["offset"]), c["x_layout"], device)
    r = None
    if c["residual"]:
        r_scale = c["scale"] if c["magnitude"] != "offset" else 1.0
        r = laid_out(values(c["residual_dtype"], r_scale, 0.0), c["r_layout"], device)

    def param(t):
        t = t.to(device, c["param_dtype"])
        if c["strided_params"]:
            big = torch.full((*c["normalized"], 3), float("nan"), dtype=t.dtype, device=device)
            big[..., 1] = t
            t = big[..., 1]
        return t

    w = param(torch.randn(c["normalized"]) * 0.5 + 1.0) if c["weight"] else None
    b = param(torch.randn(c["normalized"])) if c["bias"] else None
    return x, r, w, b


def _norm(backend, c):
    normalized = c["normalized"][0] if c["int_shape"] else c["normalized"]

    def run(x, r, w, b):
        if backend == "module":
            if c["is_rms"]:
                m = tf.RMSNorm(c["normalized"], eps=c["eps"], elementwise_affine=w is not None)
            else:
                m = tf.LayerNorm(c["normalized"], eps=c["eps"], elementwise_affine=w is not None, bias=b is not None)
            params = {n: t for n, t in (("weight", w), ("bias", b)) if t is not None}
            return torch.func.functional_call(m, params, (x,), {"residual": r})
        if c["is_rms"]:
            return tf.rms_norm(x, normalized, w, c["eps"], residual=r, backend=backend)
        return tf.layer_norm(x, normalized, w, b, c["eps"], residual=r, backend=backend)
    return run


def _reference(c):
    """The reference. h = x + residual is rounded to the compute dtype, as the package specifies
    (layer_norm.py: the statistics are those of the rounded h), in float64 too (gradients pass
    the rounding unchanged): the float64 reference computes the call's own function, rather than
    crediting the kernel and the low-precision reference with a rounding of h they share."""
    eps = c["eps"] if c["eps"] is not None else torch.finfo(c["compute"]).eps

    def run(x, r, w, b):
        if r is not None and x.dtype == torch.float64:
            rounded = (x.detach().to(c["compute"]) + r.detach().to(c["compute"])).double()
            x = x + (rounded - (x + r)).detach()  # then x + r is the rounded h
        if c["is_rms"]:
            return reference.rms_norm(x, c["normalized"], w, eps, residual=r)
        return reference.layer_norm(x, c["normalized"], w, b, eps, residual=r)
    return run


def _torch_norm(c):
    """torch's own fused F.layer_norm / F.rms_norm on h = x + residual, in the call's dtype: the
    "plain torch in the same dtype" of the 2x rule, a second yardstick beside the reference run in
    that dtype. Both fail the rule where fp32 statistics meet a cancellation (rows of 1-3 elements,
    zero variance with a small eps, means of 1e3-1e4 with a small spread), each by chance where the
    other's roundings happen to cancel."""
    def run(x, r, w, b):
        h = x if r is None else x + r
        if c["is_rms"]:
            y = F.rms_norm(h, c["normalized"], w, c["eps"])
        else:
            y = F.layer_norm(h, c["normalized"], w, b, c["eps"])
        return y if r is None else (y, h)
    return run


def _kernel_form_gradients(c, tensors, upstream):
    """The gradients by the kernels' equations (csrc/cpu/layer_norm.cpp), in plain torch in the compute
    dtype: the statistics of the rounded h summed in float64 and rounded once (mean, rstd =
    1 / sqrt(var + eps)), xhat = (h - mean) rstd (RMSNorm: h rstd), g = dy * w and dh = rstd (g -
    mean(g) - xhat mean(g xhat)) (RMSNorm: without mean(g)), plus the gradient reaching h; dw =
    sum dy xhat, db = sum dy over the rows. Where rows of 1-3 elements or zero variance make dh a
    cancellation, these equations in fp32 can miss the rule against the per-op reference."""
    compute, dims = c["compute"], tuple(range(-len(c["normalized"]), 0))
    x, r, w, b = (None if t is None else t.detach().to(compute) for t in tensors)
    h = x if r is None else x + r
    eps = c["eps"] if c["eps"] is not None else torch.finfo(compute).eps
    h64 = h.double()
    mean = torch.zeros_like(h64.sum(dims, keepdim=True)) if c["is_rms"] else h64.mean(dims, keepdim=True)
    var = ((h64 - mean) ** 2).mean(dims, keepdim=True)
    rstd = (1.0 / torch.sqrt(var + torch.tensor(eps, dtype=torch.float32).double())).to(compute)
    xhat = (h - mean.to(compute)) * rstd
    dy, dh_up = (u.to(h.device, compute) for u in upstream)
    g = dy if w is None else dy * w.to(compute)
    inner = g - xhat * (g * xhat).mean(dims, keepdim=True)
    if not c["is_rms"]:
        inner = inner - g.mean(dims, keepdim=True)
    dh = rstd * inner + (dh_up if r is not None and c["loss_on_h"] else 0.0)
    rows = tuple(range(h.dim() - len(c["normalized"])))
    return [dh, None if r is None else dh, None if w is None else (dy * xhat).sum(rows),
            None if b is None else dy.sum(rows)]


def _outputs_and_grads(fn, leaves, upstream, loss_on_h):
    out = fn(*leaves)
    y, h = out if isinstance(out, tuple) else (out, None)
    outs = [y] + ([h] if h is not None and loss_on_h else [])
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(outs, used, [g.to(o.device, o.dtype) for o, g in zip(outs, upstream)]))
    return y, h, [None if t is None else next(grads) for t in leaves]


def check(c, backend, device="cpu"):
    """The call of draw `c` on `backend` against the float64 reference, with the error of the
    reference run in the call's compute dtype as the yardstick (inputs and parameters cast to it,
    as tests/test_layer_norm.py does for float32 parameters; its outputs and gradients then
    rounded to the dtypes the call returns)."""
    x, r, w, b = tensors = make_inputs(c, device)
    if not c["is_rms"] and c["param_dtype"] not in (c["compute"], torch.float32) and (w is not None or b is not None):
        with pytest.raises(TypeError, match=r"must have the input's dtype"):
            _norm(backend, c)(x, r, w, b)
        return
    if c["eps"] is not None and c["eps"] < 0:
        with pytest.raises(ValueError, match=r"eps must be >= 0"):
            _norm(backend, c)(x, r, w, b)
        return
    compute = c["compute"]
    leaves_k = [None if t is None else t.detach().requires_grad_() for t in tensors]
    leaves_64 = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    leaves_lp = [None if t is None else t.detach().to(compute).requires_grad_() for t in tensors]
    shape = x.shape
    # upstream gradients as the call's outputs take them (drawn in float64, rounded to its dtype)
    upstream = [torch.randn(shape, dtype=torch.float64).to(compute).double() for _ in range(2)]
    y, h, g = _outputs_and_grads(_norm(backend, c), leaves_k, upstream, c["loss_on_h"])
    y64, h64, g64 = _outputs_and_grads(_reference(c), leaves_64, upstream, c["loss_on_h"])
    ylp, hlp, glp = _outputs_and_grads(_reference(c), leaves_lp, upstream, c["loss_on_h"])
    leaves_torch = [None if t is None else t.detach().to(compute).requires_grad_() for t in tensors]
    yt, ht, gt = _outputs_and_grads(_torch_norm(c), leaves_torch, upstream, c["loss_on_h"])
    assert y.dtype == compute and y.shape == shape, f"y: {y.dtype} {tuple(y.shape)}"
    checks = [("y", y, y64, ylp.to(y.dtype), yt)]
    if r is not None:
        assert h.dtype == compute and h.shape == shape, f"h: {h.dtype} {tuple(h.shape)}"
        checks.append(("h", h, h64, hlp.to(h.dtype), ht))
    formulation = _kernel_form_gradients(c, tensors, upstream)
    for name, t, got, exact, lowp, by_torch, form in zip(("x", "residual", "weight", "bias"), tensors, g, g64, glp,
                                                          gt, formulation):
        if t is not None:
            assert got.dtype == t.dtype and got.shape == t.shape, f"grad of {name}: {got.dtype} {tuple(got.shape)}"
            checks.append((f"grad of {name}", got, exact, lowp.to(got.dtype), by_torch, form))
    for what, got, exact, lowp, *others in checks:
        # a draw whose references overflow (or divide 0 by 0) would test nothing
        assert torch.isfinite(exact).all() and torch.isfinite(lowp).all(), f"{what}: the draw's reference is not finite"
        lowps = [lowp] + [o.to(got.device, got.dtype) for o in others if torch.isfinite(o).all()]
        assert_close_to_reference(got, exact, lowps, what=what)  # no NaN in got, and within 2x


def check_draw(seed, backend="cpp", device="cpu", **kwargs):
    """Draw `seed` on the C++ backend (named, "auto" or a module, as drawn) or on `backend`."""
    check_seeded_draw(draw, check, seed, backend, device, **kwargs)


def check_draws(seeds, *args, **kwargs):
    check_seeded_draws(draw, check, seeds, *args, **kwargs)


@pytest.mark.parametrize("block", range(40))
def test_cpp_norm_random_calls(block):
    check_draws(range(block * 200, (block + 1) * 200))


@pytest.mark.parametrize("block", range(8))
@TRITON_TESTS[0]
@TRITON_TESTS[1]
def test_triton_norm_random_calls(block):
    device = kernel_device()
    # the interpreter refuses bf16 norms: its float32 -> bfloat16 conversion truncates (docs/design.md).
    # (bf16 residuals with fp16/fp32 inputs still run: they compute in fp32.)
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if device == "cuda" else ())
    # 9000: wider than one 8192-column tile, the looped path
    check_draws(range(block * 100, (block + 1) * 100), "triton", device, dtypes=dtypes, widths=WIDTHS + (9000,),
                modules=False)
