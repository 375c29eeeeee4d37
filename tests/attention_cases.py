"""Input builders and the check shared by the softmax-attention tests of every backend."""
import torch

import transformer_fast as tf
from transformer_fast import reference

from helpers import compare_with_reference


def make_qkv(B, H, Nq, Nk, D, Dv=None, *, Hk=None, dtype=torch.float32, layout="bhnd", device="cpu"):
    """Fresh random q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv). layout "bhnd" is
    contiguous; "bnhd" returns transposed views of (B, N, H, D) tensors; "qkv" slices q, k, v out
    of one fused projection (B, N, 3, H, D) (needs Nq == Nk, Hk == H, Dv == D). Non-contiguous
    layouts exercise the kernels' stride handling."""
    Dv = D if Dv is None else Dv
    Hk = H if Hk is None else Hk
    if layout == "qkv":
        fused = torch.randn(B, Nq, 3, H, D, dtype=dtype, device=device)
        return tuple(fused[:, :, i].transpose(1, 2) for i in range(3))
    if layout == "bnhd":
        return (torch.randn(B, Nq, H, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Nk, Hk, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Nk, Hk, Dv, dtype=dtype, device=device).transpose(1, 2))
    return (torch.randn(B, H, Nq, D, dtype=dtype, device=device),
            torch.randn(B, Hk, Nk, D, dtype=dtype, device=device),
            torch.randn(B, Hk, Nk, Dv, dtype=dtype, device=device))


def random_key_padding(B, Nk, *, fully_padded_row=None, device="cpu"):
    """(B, Nk) bool, True = padded: random valid lengths; `fully_padded_row` pads every key of that row."""
    lengths = torch.randint(1, Nk + 1, (B,), device=device)
    mask = torch.arange(Nk, device=device)[None, :] >= lengths[:, None]
    if fully_padded_row is not None:
        mask[fully_padded_row] = True
    return mask


def random_attn_mask(shape, kind, *, dtype=torch.float32, device="cpu"):
    """A bool (True = allowed, ~70% allowed) or float (random values with some -inf) mask of `shape`."""
    if kind == "bool":
        return torch.rand(shape, device=device) < 0.7
    mask = torch.randn(shape, dtype=dtype, device=device)
    return mask.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))


def check_attention(backend, q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                    grads=True, atol=None):
    """Output (and q, k, v gradients) of tf.scaled_dot_product_attention on `backend` against the
    float64 reference, with the package's comparison policy."""
    gqa = k.shape[1] != q.shape[1]

    def kernel(q, k, v):
        return tf.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                               enable_gqa=gqa, key_padding_mask=key_padding_mask, backend=backend)

    def ref(q, k, v):
        mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
        return reference.scaled_dot_product_attention(q, k, v, mask, is_causal, scale,
                                                      key_padding_mask=key_padding_mask)

    return compare_with_reference(kernel, ref, (q, k, v), grad_inputs=(0, 1, 2) if grads else (),
                                  what=f"attention[{backend}]", atol=atol)
