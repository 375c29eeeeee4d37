"""Builders of packed (variable-length) attention inputs and the check of ``varlen_attn`` against
the float64 reference, shared by the packed-attention tests."""
import torch

import transformer_fast as tf
from transformer_fast import reference

from attention_cases import flash_gradients
from helpers import compare_with_reference, kernel_device as _device


def offsets(lengths):
    return torch.tensor([0] + lengths, device=_device()).cumsum(0).to(torch.int32)


def make_pack(q_lens, k_lens, H=2, Hk=2, D=16, Dv=None, dtype=torch.float32):
    Dv = D if Dv is None else Dv
    q = torch.randn(sum(q_lens), H, D, dtype=dtype, device=_device())
    k = torch.randn(sum(k_lens), Hk, D, dtype=dtype, device=_device())
    v = torch.randn(sum(k_lens), Hk, Dv, dtype=dtype, device=_device())
    return q, k, v, offsets(q_lens), offsets(k_lens)


def check_varlen(backend, q, k, v, cu_q, cu_k, *, sinks=None, grads=True, **kwargs):
    """Output and (grads) the gradients of q, k, v (and sinks) of varlen_attn against the
    reference's per-sequence attention, with the package's comparison policy; gradients also admit
    FlashAttention-2's delta (attention_cases.flash_gradients), sequence by sequence."""
    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist() if cu_k is not None else [0]
    max_q, max_k = max(q_lens, default=0), max(k_lens, default=0)
    if kwargs.get("seqused_k") is not None:
        max_k = int(kwargs["seqused_k"].max())
    enable_gqa = k.shape[-2] != q.shape[1]

    def kernel(q, k, v, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks}
        return tf.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=enable_gqa, backend=backend,
                              **kwargs, **extra)

    ref_kwargs = {name: kwargs[name] for name in ("scale", "window_size", "softcap", "alibi_slopes", "seqused_k",
                                                 "block_table") if name in kwargs}

    def ref(q, k, v, sinks=None):
        return reference.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, **ref_kwargs)

    def flash(inputs, dout):
        q, k, v = inputs[:3]
        grads = [torch.zeros_like(t) for t in inputs]
        for b in range(len(q_lens)):
            rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            slopes = ref_kwargs.get("alibi_slopes")
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b]
            g = flash_gradients(*(t[r].transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk))),
                                dout[rq].transpose(0, 1)[None], *inputs[3:], scale=kwargs.get("scale"),
                                window_size=kwargs.get("window_size"), softcap=kwargs.get("softcap"),
                                alibi_slopes=slopes)
            for grad, part, rows in zip(grads, g, (rq, rk, rk)):
                grad[rows] = part[0].transpose(0, 1)
            if len(g) == 4:
                grads[3] += g[3]
        return grads

    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    return compare_with_reference(kernel, ref, inputs, grad_inputs=tuple(range(len(inputs))) if grads else (),
                                  what=f"varlen_attn[{backend}]", gradient_formulation=flash)


def paged(k_lens, page_size, H=2, D=16, dtype=torch.float32, spare=3, Dv=None):
    """A pool of pages holding sequences of k_lens keys, in shuffled page order, and its block table."""
    pages_per_seq = max(1, max(-(-n // page_size) for n in k_lens))
    n_pages = pages_per_seq * len(k_lens) + spare
    order = torch.randperm(n_pages)[:pages_per_seq * len(k_lens)]
    table = order.view(len(k_lens), pages_per_seq).to(torch.int32).to(_device())
    k = torch.randn(n_pages, page_size, H, D, dtype=dtype, device=_device())
    v = torch.randn(n_pages, page_size, H, D if Dv is None else Dv, dtype=dtype, device=_device())
    return k, v, table, torch.tensor(k_lens, dtype=torch.int32, device=_device())
