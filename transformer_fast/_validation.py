"""Input checks of the functions written in Python (linear_attention_step); the ops check their
arguments in C++ (csrc/op_utils.h) with the same messages. Each raises TypeError (wrong type or
dtype) or ValueError (wrong shape or value) naming the argument, what was expected and what was given."""
from __future__ import annotations

import torch

MAX_HEAD_DIM = 256  # the widest head the kernels take (csrc/op_utils.h: kMaxHeadDim)


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
