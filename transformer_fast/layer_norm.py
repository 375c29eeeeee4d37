"""LayerNorm and RMSNorm with the residual add fused in: the public functions and the fake kernels
of their ops (the ``LayerNorm``/``RMSNorm`` modules are in ``nn/normalization.py``).

The kernel ops normalise the last dim:

    layer_norm_forward(x, residual, weight, bias, eps, is_rms) -> (y, h, mean, rstd)
    layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms) -> (dx, dweight, dbias)

x, residual, dy, dh are (..., N) with unit stride along N (the ops take the caller's shape, so
that autograd records no reshape around them; the kernels, ``kernels/layer_norm.py`` and
``csrc/cpu/layer_norm.cpp``, see the M = numel / N rows); y, h and dx have x's shape; weight and
bias (N,) or None. h = x + residual (rounded to x's dtype; None without a residual) is the input the
statistics are taken of; y = (h - mean) * rstd * weight + bias (RMSNorm: mean is None and
y = h * rstd * weight). mean and rstd are (M,) float32 (float64 for float64 inputs, which only the
reference backend takes). In the backward, `h` is the normalised
input (x itself without a residual) and dh the gradient arriving at the h output (or None); dx
is then also the residual's gradient. dweight/dbias are None when weight/bias are.
"""
from __future__ import annotations

import numbers

import torch

from . import _backends, _build, _transforms
from ._backends import KERNEL_DTYPES
from ._fast_path import direct, dynamo_compiling
from ._validation import check_optional_tensors, check_tensors, real_scalar

_C, _ = _build.load()
_promote = torch.promote_types
_SHAPE_SEQUENCES = (tuple, list, torch.Size)  # the types the binding's fast path takes as it is


def _normalized_shape(name, value):
    """``normalized_shape`` as torch takes it (an integer, or a sequence of integers) as a tuple."""
    def integral(s):
        return isinstance(s, (numbers.Integral, torch.SymInt)) and not isinstance(s, bool)

    if integral(value):
        return (value,) if isinstance(value, torch.SymInt) else (int(value),)
    if isinstance(value, (tuple, list)) and all(integral(s) for s in value):
        return tuple(s if isinstance(s, torch.SymInt) else int(s) for s in value)
    got = type(value).__name__
    if isinstance(value, (tuple, list)):
        got += " of " + ", ".join(sorted({type(s).__name__ for s in value}))
    raise TypeError(f"{name}: normalized_shape must be an int or a sequence of ints, got {got}")


def _fused(name, input, normalized_shape, weight, bias, eps, residual, is_rms):
    """The binding's eager call; a normalized_shape it cannot take is named in the error."""
    try:
        return _C.layer_norm(input, normalized_shape, weight, bias, eps, residual, is_rms)
    except TypeError:
        _normalized_shape(name, normalized_shape)
        raise


def _stats_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


@torch.library.register_fake("transformer_fast::layer_norm_forward")
def _(x, residual, weight, bias, eps, is_rms):
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0 if is_rms else M, dtype=_stats_dtype(x))
    return x.new_empty(x.shape), h, mean, x.new_empty(M, dtype=_stats_dtype(x))


@torch.library.register_fake("transformer_fast::layer_norm_backward")
def _(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    return (h.new_empty(h.shape), torch.empty_like(weight) if weight is not None else h.new_empty(0),
            torch.empty_like(bias) if bias is not None else h.new_empty(0))


def _normalize(x, normalized_shape, weight, bias, eps, residual, is_rms, backend):
    """Every call but the eager one on plain tensors (see layer_norm)."""
    normalized_shape = _normalized_shape("rms_norm" if is_rms else "layer_norm", normalized_shape)
    check_tensors(input=x)
    check_optional_tensors(weight=weight, bias=bias, residual=residual)
    # the residual add promotes (x + r): the kernels run in the promoted dtype
    dtype = x.dtype if not isinstance(residual, torch.Tensor) else torch.promote_types(x.dtype, residual.dtype)
    if _transforms.active():
        return _transforms.layer_norm(x, list(normalized_shape), weight, bias, eps, residual, is_rms)
    with _backends.named(_backends.explicit_backend(backend, x.device, dtype, "layer_norm")):
        y, h = torch.ops.transformer_fast.layer_norm(x, list(normalized_shape), weight, bias, eps, residual, is_rms)
    return y if residual is None else (y, h)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None, backend="auto"):
    """Fused LayerNorm, a drop-in for ``torch.nn.functional.layer_norm``.

    With ``residual``, computes ``h = input + residual`` and ``layer_norm(h)`` in one pass and
    returns ``(layer_norm(h), h)`` (the pre-norm residual stream); ``h`` has the dtype
    ``input + residual`` has. Statistics are float32 (float64 for float64 inputs). Under
    ``torch.autocast`` it follows torch's rule for ``layer_norm``: float32 on CUDA, the input's
    dtype on the CPU.
    """
    if type(eps) is not float:  # None too: torch's layer_norm has no default for it
        eps = real_scalar("eps", eps, optional=False)
    if (backend == "auto" and not dynamo_compiling() and direct(1, input, residual, weight, bias)
            and type(normalized_shape) in _SHAPE_SEQUENCES
            and (residual is None or residual.dtype == input.dtype
                 or _promote(input.dtype, residual.dtype) in KERNEL_DTYPES)):
        y, h = _fused("layer_norm", input, normalized_shape, weight, bias, eps, residual, False)
        return y if residual is None else (y, h)
    return _normalize(input, normalized_shape, weight, bias, eps, residual, False, backend)


def rms_norm(input, normalized_shape, weight=None, eps=None, *, residual=None, backend="auto"):
    """Fused RMSNorm, a drop-in for ``torch.nn.functional.rms_norm``: ``h / sqrt(mean(h^2) + eps)
    * weight`` with ``h = input (+ residual)``; ``eps=None`` means the machine epsilon of the type
    it computes in, as torch's does (float32's for bfloat16/float16 h, not h's own as torch's
    documentation says). As torch's, it takes a weight of any floating dtype (a bfloat16
    ``nn.RMSNorm`` on float32 activations): y has h's dtype, and the weight is multiplied in
    float32 (float64 for float64 h)."""
    if eps is not None and type(eps) is not float:
        eps = real_scalar("eps", eps)
    if (backend == "auto" and not dynamo_compiling() and direct(1, input, residual, weight)
            and type(normalized_shape) in _SHAPE_SEQUENCES
            and (residual is None or residual.dtype == input.dtype
                 or _promote(input.dtype, residual.dtype) in KERNEL_DTYPES)):
        y, h = _fused("rms_norm", input, normalized_shape, weight, None, eps, residual, True)
        return y if residual is None else (y, h)
    return _normalize(input, normalized_shape, weight, None, eps, residual, True, backend)
