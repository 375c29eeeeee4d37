"""Input checks made in Python (that the public functions' tensor arguments are strided tensors,
their flags, linear_attention_step's tensors); the ops check their arguments in C++
(csrc/ops/op_utils.h) with the same messages. Each raises TypeError (wrong type or dtype) or
ValueError (wrong shape or value) naming the argument, what was expected and what was given."""
from __future__ import annotations

import math
import numbers

import torch

MAX_HEAD_DIM = 256  # the widest head the kernels take (csrc/ops/op_utils.h: kMaxHeadDim)


def check_bools(**flags):
    """Flags must be bools, as torch's functions require of theirs (bool("False") would be True)."""
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _refuse_nested(name, t):
    if t.is_nested:  # the ops have no nested-tensor kernels: say so instead of the dispatcher's NotImplementedError
        raise TypeError(f"{name} must be a strided tensor, got a nested tensor (the kernels take padded batches "
                        f"with a key_padding_mask, or packed ones through varlen_attn; the LayerNorm/RMSNorm "
                        f"modules run torch's own norm on nested tensors)")


def check_tensors(**tensors):
    """TypeError naming the first argument that is not a (strided) tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _refuse_nested(name, t)


def check_optional_tensors(**tensors):
    """TypeError naming the first argument that is neither a (strided) tensor nor None."""
    for name, t in tensors.items():
        if t is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
            _refuse_nested(name, t)


def check_tensor(name, t, *, ndim=None, floating=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_same(name, t, ref_name, ref):
    """`t` must share `ref`'s device and dtype."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


INT64_RANGE = (-2**63, 2**63 - 1)  # what the ops' int arguments hold


def check_int64(name, value, what=None):
    """An int argument the ops take as int64 must fit it (pybind would refuse it with its
    signature list, naming no argument)."""
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError(f"{name} must fit in int64, [-2**63, 2**63 - 1], got {what if what is not None else value}")


def check_float32_range(name, t, query):
    """A float64 tensor the kernels read in float32 (with inputs other than float64) must hold no
    value beyond float32's range: it would become inf there (ALiBi: inf * 0 = NaN scores)."""
    if (isinstance(t, torch.Tensor) and t.dtype == torch.float64 and isinstance(query, torch.Tensor)
            and query.dtype != torch.float64):
        largest = float(t.detach().abs().max()) if t.numel() else 0.0
        if largest > torch.finfo(torch.float32).max:
            raise ValueError(f"{name} must be within float32's range, |value| <= {torch.finfo(torch.float32).max:.8g}, "
                             f"for {query.dtype} inputs (the kernels take it in float32), got {largest:g}")


def real_scalar(name, value, optional=True):
    """Any real scalar (a Python or NumPy number, a one-element tensor) as a float; None passes
    where ``optional``."""
    expected = "a real scalar or None" if optional else "a real scalar"
    if value is None and optional:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name} must be {expected}, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        value = value.item()
    elif not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value
