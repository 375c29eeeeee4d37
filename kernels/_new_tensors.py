"""The tensors the launchers make (outputs, scratch, contiguous copies), each added to the
thread's call recording (_call_recording.py), and the row order of new attention results."""
import os

import torch

from ._call_recording import CallRecording, recording

# Read once, here, with the kernels' first import (reading the environment costs ~2 us a lookup).
_POISON = os.environ.get("TRANSFORMER_FAST_POISON") == "1"


def _empty(shape, dtype, device):
    # sizes as separate arguments: torch parses them ~0.7 us faster than one tuple
    return torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)


def new_output(shape, dtype, device):
    """torch.empty, or NaN-filled with TRANSFORMER_FAST_POISON=1 (set before the kernels are first
    used) so tests catch unwritten elements."""
    if _POISON:
        out = torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    else:
        out = _empty(shape, dtype, device)
    rec = recording()
    if rec is not None:
        rec.news.append((CallRecording.OUTPUT, out, None))
    return out


def new_scratch(shape, dtype, device, zero=False):
    """A launch's working tensor: torch.empty (never poisoned: the kernels write what they read), or
    zeros."""
    out = torch.zeros(shape, dtype=dtype, device=device) if zero else _empty(shape, dtype, device)
    rec = recording()
    if rec is not None:
        rec.news.append((CallRecording.ZEROS if zero else CallRecording.SCRATCH, out, None))
    return out


def contiguous(t):
    """t.contiguous(), the copy (where it makes one) recorded."""
    out = t.contiguous()
    if out is not t:
        rec = recording()
        if rec is not None:
            rec.news.append((CallRecording.COPY, out, t))
    return out


def strides_in_rows_of(like):
    """(transposed, strides) of a new attention result in the row order of ``like`` (B, H, N, *)
    (transformer_fast/_result_layout.py): whether it is laid out (B, N, H, W) and viewed as
    (B, H, N, W), and its (batch, head, row) strides counted in rows of W elements, as the kernels
    take them."""
    # transformer_fast/_result_layout.py's rule, restated: this package imports nothing from
    # transformer_fast at import time, as it must also import as a top-level `kernels` (transformers
    # probes for a package of that name, and finds this one wherever the checkout is on sys.path)
    _, H, N, _ = like.shape
    rows_h, rows_n = max(H, 1), max(N, 1)  # as torch lays a new tensor out: a size-0 dim counts as 1
    if like.stride(1) < like.stride(2):
        return True, (rows_n * rows_h, 1, rows_h)
    return False, (rows_h * rows_n, rows_n, 1)


def _in_rows_of(like, width, new):
    """new(shape) as a (B, H, N, width) tensor in the row order of ``like`` (strides_in_rows_of)."""
    B, H, N, _ = like.shape
    if strides_in_rows_of(like)[0]:
        return new((B, N, H, width)).transpose(1, 2)
    return new((B, H, N, width))


def new_output_in_rows_of(like, width):
    """new_output for an attention result of width ``width`` in the row order of ``like`` (B, H, N, *)."""
    return _in_rows_of(like, width, lambda shape: new_output(shape, like.dtype, like.device))


def new_scratch_in_rows_of(like, width, dtype, zero=False):
    """new_scratch laid out as new_output_in_rows_of(like, width) would be."""
    return _in_rows_of(like, width, lambda shape: new_scratch(shape, dtype, like.device, zero))


def row_strides(t):
    """The (batch, head, row) strides of a (B, H, N, W) tensor in rows of W elements, or None where
    they are not whole rows (a last-dim stride other than 1, or a stride not a multiple of W)."""
    width, strides = max(t.shape[-1], 1), t.stride()[:3]
    if (width > 1 and t.stride(-1) != 1) or any(s % width for s in strides):
        return None
    return tuple(s // width for s in strides)
