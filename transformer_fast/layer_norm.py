"""LayerNorm and RMSNorm with the residual add fused in: the public functions and their custom
ops (the ``LayerNorm``/``RMSNorm`` modules are in ``modules.py``).

The kernels (``kernels/layer_norm.py``, ``csrc/layer_norm.cpp``) work on rows:

    layer_norm_forward(x, residual, weight, bias, eps, is_rms) -> (y, h, mean, rstd)
    layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms) -> (dx, dweight, dbias)

x, residual, dy, dh are (M, N) with unit stride along N and any row stride; weight and bias
(N,) or None. h = x + residual (rounded to x's dtype; None without a residual) is the input the
statistics are taken of; y = (h - mean) * rstd * weight + bias (RMSNorm: mean is None and
y = h * rstd * weight). mean and rstd are (M,) float32 (float64 for float64 inputs, which only the
reference backend takes). In the backward, `h` is the normalised
input (x itself without a residual) and dh the gradient arriving at the h output (or None); dx
is then also the residual's gradient. dweight/dbias are None when weight/bias are.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import _composite, _dispatch
from ._validation import as_rows, check_same, check_tensor


# Custom ops cannot return None, so absent tensors travel as empty 1-D tensors.
def _empty(ref):
    return ref.new_empty(0)


def _stats_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _layer_norm_forward(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], eps: float, is_rms: bool,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.shape[0] == 0:
        return (x.new_empty(x.shape), (x.new_empty(x.shape) if residual is not None else _empty(x)),
                x.new_empty(0, dtype=_stats_dtype(x)), x.new_empty(0, dtype=_stats_dtype(x)))
    y, h, mean, rstd = _dispatch.kernel("layer_norm_forward", backend)(x, residual, weight, bias, eps, is_rms)
    return y, (_empty(x) if h is None else h), (_empty(rstd) if mean is None else mean), rstd


_layer_norm_forward_op = torch.library.custom_op(
    "transformer_fast::layer_norm_forward", _layer_norm_forward, mutates_args=())


@_layer_norm_forward_op.register_fake
def _(x, residual, weight, bias, eps, is_rms, backend):
    M = x.shape[0]
    h = x.new_empty(x.shape) if residual is not None else _empty(x)
    mean = x.new_empty(0 if is_rms else M, dtype=_stats_dtype(x))
    return x.new_empty(x.shape), h, mean, x.new_empty(M, dtype=_stats_dtype(x))


def _layer_norm_backward(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
                         weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], mean: torch.Tensor,
                         rstd: torch.Tensor, eps: float, is_rms: bool,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if h.shape[0] == 0:
        dw = torch.zeros_like(weight) if weight is not None else _empty(h)
        db = torch.zeros_like(bias) if bias is not None else _empty(h)
        return torch.zeros_like(h), dw, db
    dx, dweight, dbias = _dispatch.kernel("layer_norm_backward", backend)(
        dy, dh, h, weight, bias, None if is_rms else mean, rstd, eps, is_rms)
    return dx, (_empty(h) if dweight is None else dweight), (_empty(h) if dbias is None else dbias)


_layer_norm_backward_op = torch.library.custom_op(
    "transformer_fast::layer_norm_backward", _layer_norm_backward, mutates_args=())


@_layer_norm_backward_op.register_fake
def _(dy, dh, h, weight, bias, mean, rstd, eps, is_rms, backend):
    return (h.new_empty(h.shape), torch.empty_like(weight) if weight is not None else _empty(h),
            torch.empty_like(bias) if bias is not None else _empty(h))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms, backend = inputs
    _, h, mean, rstd = output
    # Only the statistics are saved besides the input (never a normalised copy of it).
    ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd)
    ctx.args = (eps, is_rms, backend)
    ctx.has_residual = residual is not None
    ctx.mark_non_differentiable(mean, rstd)


def _unit_row_stride(t):
    """Incoming gradients may have any strides (an expanded dy has stride 0); the kernels take
    unit stride along the row."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a second derivative will be taken
        return _differentiable_backward(ctx, dy, dh, h, weight, bias)
    dy = _unit_row_stride(dy)
    dh = _unit_row_stride(dh) if ctx.has_residual else None
    dx, dweight, dbias = _dispatch.run_op(_layer_norm_backward_op, _layer_norm_backward, dy, dh, h, weight, bias,
                                          mean, rstd, *ctx.args)
    return (dx, dx if ctx.has_residual else None, dweight if weight is not None else None,
            dbias if bias is not None else None, None, None, None)


def _differentiable_backward(ctx, dy, dh, h, weight, bias):
    """The gradients as a graph torch can differentiate again, from the composite form applied to
    the saved normalised input h (x + residual, itself this op's output: torch differentiates
    through it back to x and the residual)."""
    args = (h, None, weight, bias, *ctx.args)
    dx, _, dweight, dbias = _composite.backward(_composite.layer_norm_forward, args, (0, 2, 3),
                                                (dy, None, None, None))[:4]
    if ctx.has_residual and dh is not None:
        dx = dh if dx is None else dx + dh
    return dx, dx if ctx.has_residual else None, dweight, dbias, None, None, None


_layer_norm_forward_op.register_autograd(_backward, setup_context=_setup_context)
_layer_norm_forward_eager = _dispatch.eager_autograd(_layer_norm_forward, _setup_context, _backward)
_dispatch.register_autocast(_layer_norm_forward_op, "layer_norm_forward", "norm", cast_args=(0, 1, 2, 3))
_dispatch.register_autocast(_layer_norm_backward_op, "layer_norm_backward", "norm")


def _normalize(x, normalized_shape, weight, bias, eps, residual, is_rms, backend):
    name = "rms_norm" if is_rms else "layer_norm"
    check_tensor("input", x)
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (int(normalized_shape),)
    normalized_shape = tuple(normalized_shape)
    if len(normalized_shape) == 0 or x.dim() < len(normalized_shape) or \
            tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} does not end with normalized_shape "
                         f"{normalized_shape}")
    if residual is not None:
        check_tensor("residual", residual)
        check_same("residual", residual, "input", x, dtype=False)
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual must have the input's shape {tuple(x.shape)}, "
                             f"got {tuple(residual.shape)}")
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_tensor(pname, p)
    x, residual, weight, bias = _dispatch.autocast_inputs("norm", x, residual, weight, bias)
    if residual is not None and residual.dtype != x.dtype:  # the add promotes, as input + residual does
        common = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(common), residual.to(common)
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if tuple(p.shape) != normalized_shape:
            raise ValueError(f"{name}: {pname} must have shape normalized_shape = {normalized_shape}, "
                             f"got {tuple(p.shape)}")
        check_same(pname, p, "input", x, dtype=False)
        if p.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{name}: {pname} must have the input's dtype {x.dtype} or float32, got {p.dtype}")
    if eps is None:  # rms_norm's default: the machine epsilon of the dtype it computes in
        eps = torch.finfo(x.dtype).eps
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")

    width = 1
    for s in normalized_shape:
        width *= s
    if width == 0:  # rows of no elements: empty outputs, as torch.nn.functional.layer_norm gives
        h = x if residual is None else x + residual
        y = h.clone()
        return y if residual is None else (y, h)
    backend = _dispatch.select_backend(x.device, x.dtype, backend, "layer_norm")
    if len(normalized_shape) > 1:
        weight = None if weight is None else weight.reshape(width)
        bias = None if bias is None else bias.reshape(width)
    y, h, _, _ = _dispatch.run_op(_layer_norm_forward_op, _layer_norm_forward,
                                  as_rows(x, width), None if residual is None else as_rows(residual, width),
                                  weight, bias, float(eps), is_rms, backend,
                                  autograd=_layer_norm_forward_eager, composite=_composite.layer_norm_forward)
    if y.shape != x.shape:
        y = y.view(x.shape)
        h = h.view(x.shape) if residual is not None else h
    return y if residual is None else (y, h)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None, backend="auto"):
    """Fused LayerNorm, a drop-in for ``torch.nn.functional.layer_norm``.

    With ``residual``, computes ``h = input + residual`` and ``layer_norm(h)`` in one pass and
    returns ``(layer_norm(h), h)`` (the pre-norm residual stream); ``h`` has the dtype
    ``input + residual`` has. Statistics are float32 (float64 for float64 inputs). Under
    ``torch.autocast`` it follows torch's rule for ``layer_norm``: float32 on CUDA, the input's
    dtype on the CPU.
    """
    return _normalize(input, normalized_shape, weight, bias, eps, residual, False, backend)


def rms_norm(input, normalized_shape, weight=None, eps=None, *, residual=None, backend="auto"):
    """Fused RMSNorm, a drop-in for ``torch.nn.functional.rms_norm``: ``h / sqrt(mean(h^2) + eps)
    * weight`` with ``h = input (+ residual)``; ``eps=None`` means ``torch.finfo(dtype).eps``."""
    return _normalize(input, normalized_shape, weight, None, eps, residual, True, backend)
