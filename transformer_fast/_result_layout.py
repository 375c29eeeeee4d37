"""The memory layout of attention results, as torch's attention lays them out: in the row order of
their input. A (B, H, N, W) input that keeps each row's heads together (stride(1) < stride(2): a
projection's (B, N, H * W) output viewed as heads and transposed, as most models make q, k and v)
gets results in (B, N, H, W) memory seen as (B, H, N, W), so that the model's transpose back to
(B, N, H * W) is a view, not a copy; any other input, and packed (T, H, W) ones, get contiguous
results. The forward's output follows q; the gradients dq, dk, dv follow q, k, v. The C++ kernels
apply the same rule (new_output_in_rows_of in csrc/ops/new_tensors.cpp)."""
from __future__ import annotations

import torch


def heads_inside_rows(t: torch.Tensor) -> bool:
    """Whether the (B, H, N, W) tensor ``t`` keeps each row's heads together in memory."""
    return t.dim() == 4 and t.stride(1) < t.stride(2)


def empty_in_rows_of(like: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty result shaped as ``like`` with last dim ``width``, laid out in ``like``'s row order."""
    dtype = like.dtype if dtype is None else dtype
    if heads_inside_rows(like):
        B, H, N = like.shape[:3]
        return like.new_empty((B, N, H, width), dtype=dtype).transpose(1, 2)
    return like.new_empty((*like.shape[:-1], width), dtype=dtype)


def in_rows_of(like: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` (shaped as ``like`` but for the last dim) in ``like``'s row order: itself where its
    strides already are those, else a copy."""
    laid_out = empty_in_rows_of(like, result.shape[-1], result.dtype)
    return result if result.stride() == laid_out.stride() else laid_out.copy_(result)
