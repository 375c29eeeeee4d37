"""Input checks shared by the public functions. Each raises TypeError (wrong type or dtype) or
ValueError (wrong shape or value) naming the argument, what was expected and what was given."""
from __future__ import annotations

import torch

MAX_HEAD_DIM = 256


def check_tensor(name, t, *, ndim=None, floating=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_same(name, t, ref_name, ref, *, dtype=True):
    """`t` must share `ref`'s device (and dtype)."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


def check_dim(name, t, dim, expected, what):
    if t.shape[dim] != expected:
        raise ValueError(f"{name}.shape[{dim}] ({what}) must be {expected}, got {t.shape[dim]} "
                         f"(shape {tuple(t.shape)})")


def check_head_dim(name, size):
    if not 1 <= size <= MAX_HEAD_DIM:
        raise ValueError(f"{name} head dim must be between 1 and {MAX_HEAD_DIM}, got {size}")


def check_key_padding_mask(mask, batch, nk, ref):
    """(B, Nk) bool, True = padded key."""
    if mask is None:
        return None
    check_tensor("key_padding_mask", mask, floating=False)
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padded key), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, nk):
        raise ValueError(f"key_padding_mask must have shape (batch, key_len) = {(batch, nk)}, got {tuple(mask.shape)}")
    check_same("key_padding_mask", mask, "query", ref, dtype=False)
    return mask


def broadcast_attn_mask(mask, shape, ref):
    """A bool (True = allowed) or float (added) mask that broadcasts to `shape` = (B, H, Nq, Nk),
    returned as an expanded view of that shape: broadcast dims get stride 0, nothing is copied."""
    if mask is None:
        return None
    check_tensor("attn_mask", mask, floating=False)
    if mask.dtype != torch.bool and mask.dtype != ref.dtype:
        raise TypeError(f"attn_mask must be bool (True = attend) or have the query's dtype {ref.dtype}, "
                        f"got {mask.dtype}")
    check_same("attn_mask", mask, "query", ref, dtype=False)
    if mask.dim() > len(shape) or any(
            m not in (1, s) for m, s in zip(reversed(mask.shape), reversed(shape))):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(batch, heads, query_len, key_len) = {tuple(shape)}")
    return mask.expand(shape)


def as_rows(t, width):
    """`t` as a 2-D (rows, width) tensor with unit stride along the width: a view when the strides
    allow it (a slice along a leading dim does), otherwise a contiguous copy."""
    if t.dim() == 2 and t.shape[1] == width and (width <= 1 or t.stride(1) == 1):
        return t
    try:
        rows = t.view(-1, width)
    except RuntimeError:
        return t.reshape(-1, width).contiguous()
    return rows if width <= 1 or rows.stride(1) == 1 else rows.contiguous()
