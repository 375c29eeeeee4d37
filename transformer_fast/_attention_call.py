"""One call of an attention kernel op as one object: its arguments by name, in the schema's order
(csrc/ops/schemas.cpp), with its defaults; what csrc/ops/attention_call.h is to the C++ kernels.
The fake kernels, the Triton launchers (kernels/attention.py) and the plain-torch kernels take it;
``_device_kernels`` builds it once per call from the op's arguments."""
from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionForwardCall(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    seed: torch.Tensor | None  # a one-element int64 CPU tensor; None without dropout
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    cu_seq_q: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    num_splits: int = 0
    query_offset: int = 0


class AttentionBackwardCall(NamedTuple):
    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    seed: torch.Tensor | None
    compute_dmask: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    cu_seq_q: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    compute_delta: bool = False
    sinks: torch.Tensor | None = None
    query_offset: int = 0
