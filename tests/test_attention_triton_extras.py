"""The Triton softmax-attention kernels' extras against the float64 reference: sliding windows,
soft-capping, ALiBi, sinks, packed sequences (seqused_k, paged caches), the Flash-Decoding key
split, and dropout in packed mode.

`triton`-marked tests run under the interpreter on CPU (small shapes: the interpreter uses 32x16
forward and 16x32 backward tiles, so these lengths span several tiles, and the split rule assumes
4 SMs); outputs are NaN-filled before the kernels write them (TRANSFORMER_FAST_POISON=1, set by
conftest), so an element a kernel leaves unwritten fails the comparison. The `gpu` tests run the
same checks at real sizes on a GPU (`pytest -m gpu tests/test_attention_triton_extras.py`).
"""
import itertools

import pytest
import torch

from transformer_fast._attention_call import AttentionBackwardCall, AttentionForwardCall
import transformer_fast as tf
from transformer_fast import reference

from attention_cases import (check_attention, differentiable_attention, flash_gradients, make_qkv, random_attn_mask,
                             random_key_padding, record_launches_and_ops)
from helpers import TRITON_TESTS, assert_close_to_reference, compare_with_reference, kernel_device as _device

pytestmark = TRITON_TESTS


def check_dense(q, k, v, *, window=None, alibi=None, grads=True, **kwargs):
    """tf.scaled_dot_product_attention(backend="triton") with the extras against the float64
    reference (output and the gradients of q, k, v and the sinks; attention_cases.check_attention)."""
    return check_attention("triton", q, k, v, window_size=window, alibi_slopes=alibi, grads=grads, **kwargs)


# ------------------------------------------------------------------------------------------
# Packed sequences
# ------------------------------------------------------------------------------------------
def cu_seq(lengths, device=None):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def make_packed(lengths_q, lengths_k, H, D, Dv=None, *, Hk=None, dtype=torch.float32, device="cpu"):
    """q (Tq, H, D), k (Tk, Hk, D), v (Tk, Hk, Dv), cu_seq_q, cu_seq_k."""
    Hk = H if Hk is None else Hk
    Dv = D if Dv is None else Dv
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    return (torch.randn(Tq, H, D, dtype=dtype, device=device), torch.randn(Tk, Hk, D, dtype=dtype, device=device),
            torch.randn(Tk, Hk, Dv, dtype=dtype, device=device), cu_seq(lengths_q, device), cu_seq(lengths_k, device))


def check_varlen(q, k, v, cu_q, cu_k, *, max_q=None, max_k=None, scale=None, window=(-1, -1), softcap=None,
                 alibi=None, sinks=None, seqused_k=None, block_table=None, num_splits=None, grads=True,
                 what="varlen[triton]"):
    """tf.varlen_attn(backend="triton") against reference.varlen_attention (float64), output and
    (without seqused_k or a block table) the gradients of q, k, v and sinks."""
    lengths_q = (cu_q[1:] - cu_q[:-1]).tolist()
    if block_table is not None:
        lengths_k = seqused_k.tolist()
    else:
        lengths_k = (cu_k[1:] - cu_k[:-1]).tolist()
    max_q = max(lengths_q, default=0) if max_q is None else max_q
    max_k = max(lengths_k, default=0) if max_k is None else max_k
    gqa = k.shape[-2] != q.shape[1]
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

    def kernel(q, k, v, sinks=None):
        return tf.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window, enable_gqa=gqa,
                              seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, softcap=softcap,
                              alibi_slopes=alibi, sinks=sinks, backend="triton")

    def ref(q, k, v, sinks=None):
        return reference.varlen_attention(q, k, v, cu_q, cu_k, scale=scale, window_size=window, softcap=softcap,
                                          alibi_slopes=alibi, sinks=sinks, seqused_k=seqused_k,
                                          block_table=block_table)

    def flash(inputs, dout):
        q, k, v = inputs[:3]
        s = inputs[3] if sinks is not None else None
        grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
        dsinks = torch.zeros_like(s) if s is not None else None
        for b in range(len(lengths_q)):
            rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
            g = flash_gradients(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None],
                                v[rk].transpose(0, 1)[None], dout[rq].transpose(0, 1)[None], s, scale=scale,
                                window_size=window, softcap=softcap, alibi_slopes=slopes)
            for full, part, rows in zip(grads, g, (rq, rk, rk)):
                full[rows] = part[0].transpose(0, 1)
            if s is not None:
                dsinks += g[3]
        return grads + ([dsinks] if s is not None else [])

    return compare_with_reference(kernel, ref, inputs, grad_inputs=tuple(range(len(inputs))) if grads else (),
                                  what=what, gradient_formulation=flash)


def triton_forward(q, k, v, **kwargs):
    """The Triton attention_forward op (the kernel with the op's contract), called directly."""
    from transformer_fast._device_kernels import op_kernel

    args = dict(attn_mask=None, key_padding_mask=None, is_causal=False, scale=q.shape[-1] ** -0.5, dropout_p=0.0,
                seed=None)
    args.update(kwargs)
    return op_kernel("attention_forward", "triton", q.device.type)(
        q, k, v, args.pop("attn_mask"), args.pop("key_padding_mask"), args.pop("is_causal"), args.pop("scale"),
        args.pop("dropout_p"), args.pop("seed"), **args)


def triton_backward(dout, q, k, v, out, lse, **kwargs):
    from transformer_fast._device_kernels import op_kernel

    args = dict(attn_mask=None, key_padding_mask=None, is_causal=False, scale=q.shape[-1] ** -0.5, dropout_p=0.0,
                seed=None, compute_dmask=False)
    args.update(kwargs)
    return op_kernel("attention_backward", "triton", q.device.type)(
        dout, q, k, v, out, lse, args.pop("attn_mask"), args.pop("key_padding_mask"), args.pop("is_causal"),
        args.pop("scale"), args.pop("dropout_p"), args.pop("seed"), args.pop("compute_dmask"), **args)


# ------------------------------------------------------------------------------------------
# Interpreter (CPU) tests: dense extras
# ------------------------------------------------------------------------------------------
_F32, _F16 = torch.float32, torch.float16


@pytest.mark.parametrize("window,is_causal,masks,dtype", [
    ((100, 100), False, False, _F32),  # wider than the sequence: no key excluded
    ((0, 0), False, False, _F32),  # zero width: the one key on the bottom-right diagonal
    ((-1, 2), False, False, _F32),  # right only
    ((3, -1), False, True, _F32),  # left only, with padding and a bool mask
    ((3, -1), False, True, _F16),
    ((30, 0), True, True, _F32),  # bottom-right window intersected with top-left causal, padding, bool mask
    ((30, 0), True, True, _F16),
    ((50, 10), False, False, _F32),  # wide enough that whole key tiles lie inside every row's band
    ((50, 10), False, False, _F16),
])
def test_windows(window, is_causal, masks, dtype):
    """Bottom-right aligned windows (Nk > Nq shifts the band right), with causal and masks."""
    Nq, Nk = (40, 100) if window == (50, 10) else (20, 45)
    q, k, v = make_qkv(2, 2, Nq, Nk, 16, dtype=dtype, device=_device())
    pad = mask = None
    if masks:
        pad = random_key_padding(2, Nk, fully_padded_row=1, device=_device())
        mask = random_attn_mask((2, 1, Nq, Nk), "bool", device=_device())
    check_dense(q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=is_causal, window=window)


def test_window_with_more_queries_than_keys_and_float_mask():
    """Nq > Nk: the band shifts left, early rows see no key (out 0); a float mask's gradient too."""
    q, k, v = make_qkv(1, 2, 45, 20, 16, device=_device())
    mask = random_attn_mask((1, 2, 45, 20), "float", device=_device())
    check_dense(q, k, v, window=(4, 1))

    def kernel(q, k, v, mask):
        return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, window_size=(4, 1), backend="triton")

    def ref(q, k, v, mask):
        return reference.scaled_dot_product_attention(q, k, v, mask, window_size=(4, 1))

    compare_with_reference(kernel, ref, (q, k, v, mask), grad_inputs=(3,), what="window dS")


def test_window_tiles_outside_the_band_are_never_read():
    """NaN in every key of whole tiles outside all rows' bands, and in the queries and output
    gradients of rows whose band is empty: the forward, dQ and dK/dV passes skip those tiles, so
    nothing turns NaN (a visited tile would spread it through P @ V even where P = 0), and the
    result is the reference's on the rest."""
    q, k_clean, v_clean = make_qkv(1, 2, 16, 128, 16, device=_device())
    k, v = k_clean.clone(), v_clean.clone()
    k[:, :, :96], v[:, :, :96] = float("nan"), float("nan")  # band: keys 104 .. 127 (window (8, 0))
    out = tf.scaled_dot_product_attention(q, k, v, window_size=(8, 0), backend="triton")
    ref = reference.scaled_dot_product_attention(q.double(), k_clean.double(), v_clean.double(), window_size=(8, 0))
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max() < 1e-5
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    tf.scaled_dot_product_attention(qq, kk, vv, window_size=(8, 0), backend="triton").backward(torch.ones_like(out))
    for g in (qq.grad, kk.grad[:, :, 96:], vv.grad[:, :, 96:]):
        assert not torch.isnan(g).any()
    assert (kk.grad[:, :, :96] == 0).all() and (vv.grad[:, :, :96] == 0).all()

    # more queries than keys, causal window (-1, 0): rows < 112 see no key
    q, k, v = make_qkv(1, 2, 128, 16, 16, device=_device())
    q[:, :, :96] = float("nan")
    dout = torch.randn(1, 2, 128, 16, device=_device())
    dout[:, :, :96] = float("nan")
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = tf.scaled_dot_product_attention(qq, kk, vv, window_size=(-1, 0), backend="triton")
    out.backward(dout)
    assert (out[:, :, :112] == 0).all() and not torch.isnan(out).any()
    assert not torch.isnan(kk.grad).any() and not torch.isnan(vv.grad).any()
    assert (qq.grad[:, :, :112] == 0).all()


@pytest.mark.parametrize("softcap,magnitude,dtype", [(5.0, 8.0, _F32), (0.5, 0.01, _F32), (0.5, 0.01, _F16)])
def test_softcap(softcap, magnitude, dtype):
    """Scores far beyond the cap (tanh saturated) and far below it (tanh ~ linear, where a careless
    tanh loses its relative precision), with causal and padding."""
    q, k, v = make_qkv(2, 2, 20, 45, 16, dtype=dtype, device=_device())
    q = (q.float() * magnitude).to(dtype)
    pad = random_key_padding(2, 45, device=_device())
    check_dense(q, k, v, key_padding_mask=pad, is_causal=True, softcap=softcap, scale=1.0)


def test_alibi_per_batch_with_window_and_softcap():
    """(B, H) slopes, bottom-right aligned like the window, with GQA and soft-capping."""
    q, k, v = make_qkv(2, 4, 20, 45, 16, Hk=2, device=_device())
    check_dense(q, k, v, alibi=torch.rand(2, 4, device=_device()) * 0.5, window=(9, 3), softcap=4.0)


def test_sinks_with_fully_masked_rows():
    """Rows with no allowed key give 0 and lse = the sink exactly; the sinks get their gradient."""
    q, k, v = make_qkv(2, 2, 20, 45, 16, device=_device())
    sinks = torch.randn(2, device=_device()) * 2
    mask = random_attn_mask((2, 2, 20, 45), "bool", device=_device())
    mask[0, 1, 3] = False
    mask[1, :, 7:9] = False
    pad = random_key_padding(2, 45, device=_device())
    check_dense(q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=True, sinks=sinks)
    out, lse = triton_forward(q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=True, sinks=sinks)
    assert (out[0, 1, 3] == 0).all() and (out[1, :, 7:9] == 0).all()
    assert lse[0, 1, 3] == sinks[1] and torch.equal(lse[1, :, 7], sinks)


# ------------------------------------------------------------------------------------------
# Interpreter tests: packed sequences
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_with_empty_and_one_token_sequences(dtype):
    """Unequal query and key packs: sequences with no query, no key, one of each, and longer
    ones spanning several tiles; GQA; causal windows aligned per sequence."""
    lq, lk = [5, 0, 1, 1, 37, 3], [9, 4, 0, 1, 40, 3]
    q, k, v, cu_q, cu_k = make_packed(lq, lk, 4, 16, Hk=2, dtype=dtype, device=_device())
    if dtype == torch.float32:
        check_varlen(q, k, v, cu_q, cu_k)
    check_varlen(q, k, v, cu_q, cu_k, window=(-1, 0), max_q=40, max_k=64)  # max_q/max_k above the longest


def test_packed_extras_together():
    """Window, soft-capping, per-sequence ALiBi and sinks on a pack, forward and backward."""
    lq, lk = [7, 0, 33, 2], [7, 5, 40, 19]
    q, k, v, cu_q, cu_k = make_packed(lq, lk, 4, 16, Dv=24, Hk=1, device=_device())
    slopes = torch.rand(4, 4, device=_device())
    sinks = torch.randn(4, device=_device())
    check_varlen(q, k, v, cu_q, cu_k, window=(6, 2), softcap=3.0, alibi=slopes, sinks=sinks, scale=0.4)


def test_seqused_k_shorter_than_the_slot():
    lq, lk = [3, 1, 20], [30, 17, 40]
    q, k, v, cu_q, cu_k = make_packed(lq, lk, 2, 16, device=_device())
    used = torch.tensor([11, 0, 33], dtype=torch.int32, device=_device())
    k[11:30] = float("nan")  # unused keys of the first slot
    check_varlen(q, k, v, cu_q, cu_k, seqused_k=used, grads=False, window=(-1, 0))


@pytest.mark.parametrize("page_size", [3, 16])
def test_paged_cache_with_pages_out_of_order(page_size):
    """Keys gathered from a pool of pages listed in any order; unused pages and the unused rows
    of the last page hold NaN; GQA packed into the rows of a program; sinks and a window."""
    H, Hk, D = 4, 2, 16
    lq, used = [1, 4, 2], [37, 5, 0]
    pages_per_seq = -(-max(used) // page_size) + 1
    num_pages = 3 * pages_per_seq + 2
    pool_k = torch.full((num_pages, page_size, Hk, D), float("nan"), device=_device())
    pool_v = torch.full((num_pages, page_size, Hk, D), float("nan"), device=_device())
    table = torch.randperm(num_pages, device=_device())[:3 * pages_per_seq].view(3, pages_per_seq).to(torch.int32)
    for b, n in enumerate(used):
        for j in range(n):
            page, row = table[b, j // page_size], j % page_size
            pool_k[page, row], pool_v[page, row] = torch.randn(Hk, D), torch.randn(Hk, D)
    q = torch.randn(sum(lq), H, D, device=_device())
    cu_q = cu_seq(lq, _device())
    seqused = torch.tensor(used, dtype=torch.int32, device=_device())
    sinks = torch.randn(H, device=_device())
    for splits in (1, 3):
        check_varlen(q, pool_k, pool_v, cu_q, None, seqused_k=seqused, block_table=table, sinks=sinks,
                     window=(20, 0), num_splits=splits, grads=False)


def test_dropout_in_packed_mode_forward_and_backward_agree():
    """The keep mask, read off the forward with v = identity (out = P keep / (1 - p)), gives the
    reference's output and gradients; it is a function of (seed, the row's lse index, key)."""
    lq, lk = [5, 17, 1], [12, 20, 3]
    H, D, p, seed = 2, 16, 0.3, torch.tensor(77 + 2**40)
    q, k, v, cu_q, cu_k = make_packed(lq, lk, H, D, device=_device())
    max_q, max_k = max(lq), max(lk)
    extras = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q, max_k=max_k)
    # v = identity per sequence: out[t, h, j] = P[t, j] keep / (1 - p)
    eye = torch.zeros(sum(lk), H, max_k, device=_device())
    for b in range(len(lk)):
        for j in range(lk[b]):
            eye[int(cu_k[b]) + j, :, j] = 1.0
    kept = triton_forward(q, k, eye, dropout_p=p, seed=seed, **extras)[0] != 0
    allowed = triton_forward(q, k, eye, **extras)[0] != 0
    rate = kept[allowed].float().mean().item()
    assert allowed.sum() > 400 and abs(rate - (1 - p)) < 0.08, rate

    def kernel(q, k, v):
        return differentiable_attention(q, k, v, None, None, False, D ** -0.5, p, seed, "triton", **extras)

    def ref(q, k, v):
        outs = []
        for b in range(len(lq)):
            rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            keep = kept[rq, :, :lk[b]].transpose(0, 1)[None]
            outs.append(reference.scaled_dot_product_attention(
                q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None], v[rk].transpose(0, 1)[None],
                dropout_mask=keep, dropout_p=p)[0].transpose(0, 1))
        return torch.cat(outs)

    compare_with_reference(kernel, ref, (q, k, v), grad_inputs=(0, 1, 2), what="packed dropout")


def test_rows_after_the_last_sequence_are_written():
    """Rows of the packed tensors after cu_seq[-1] belong to no sequence: out 0 and lse +inf (or
    the sink), zero gradients; the outputs start NaN-filled, so an unwritten row fails."""
    lq, lk = [3, 20], [5, 9]
    q, k, v, cu_q, cu_k = make_packed([*lq, 40], [*lk, 37], 2, 16, device=_device())
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]  # 40 query and 37 key rows after the last sequence
    extras = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=20, max_k=9)
    for splits, sinks in ((1, None), (2, torch.randn(2, device=_device()))):
        out, lse = triton_forward(q, k, v, sinks=sinks, num_splits=splits, **extras)
        assert (out[23:] == 0).all()
        expected = float("inf") if sinks is None else sinks[:, None].expand(2, 40)
        assert torch.equal(lse[:, 23:], torch.as_tensor(expected, device=lse.device).expand(2, 40))
        ref = reference.varlen_attention(q[:23].double(), k[:14].double(), v[:14].double(), cu_q, cu_k, sinks=sinks)
        assert (out[:23].double() - ref).abs().max() < 1e-5
    out, lse = triton_forward(q, k, v, **extras)
    dq, dk, dv, _, _ = triton_backward(torch.randn_like(out), q, k, v, out, lse, **extras)
    assert (dq[23:] == 0).all() and (dk[14:] == 0).all() and (dv[14:] == 0).all()
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def _guarded(t, margin=4096):
    """`t` as a view into a NaN buffer with `margin` elements before and after it: a kernel that
    reads outside `t` picks up NaN."""
    flat = torch.full((t.numel() + 2 * margin,), float("nan"), dtype=t.dtype, device=t.device)
    view = flat[margin:margin + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def test_inconsistent_index_values_stay_inside_the_tensors():
    """Offsets past the packed rows or decreasing, negative or huge key counts and page numbers
    outside the pool: the kernels clamp them (the GPU path does not validate them), so every load
    stays inside q, k, v and the pool (NaN guards around them never reach the output)."""
    H, D = 2, 16
    q, k, v = (_guarded(torch.randn(30, H, D, device=_device())) for _ in range(3))
    cu_q = torch.tensor([-4, 12, 7, 45, 50], dtype=torch.int32, device=_device())
    cu_k = torch.tensor([-5, 20, 10, 99, 120], dtype=torch.int32, device=_device())
    used = torch.tensor([-3, 2**30, 8, 5], dtype=torch.int32, device=_device())
    for seqused in (None, used):
        out, lse = triton_forward(q, k, v, cu_seq_q=cu_q, cu_seq_k=cu_k, seqused_k=seqused, max_q=40, max_k=40)
        assert not torch.isnan(out).any()
    pool_k, pool_v = (_guarded(torch.randn(4, 5, H, D, device=_device())) for _ in range(2))
    table = torch.tensor([[3, -1, 7], [2**31 - 1, 0, 1], [1, 2, 3], [0, 0, 0]], dtype=torch.int32, device=_device())
    for splits in (1, 2):
        out, _ = triton_forward(q, pool_k, pool_v, cu_seq_q=cu_q, seqused_k=used, block_table=table, max_q=40,
                                max_k=15, num_splits=splits)
        assert not torch.isnan(out).any()


def test_more_sequences_than_the_grid_holds_are_refused():
    """A pack of 65535 sequences needs a grid column more than CUDA allows: a clear error, before
    any launch or allocation."""
    from transformer_fast.kernels import attention as ka

    q, k, v = (torch.randn(4, 2, 16) for _ in range(3))
    cu = torch.zeros(65536, dtype=torch.int32)
    with pytest.raises(ValueError, match="65534 packed sequences"):
        ka.attention_forward(AttentionForwardCall(q, k, v, None, None, False, 0.25, 0.0, 0, cu_seq_q=cu, cu_seq_k=cu,
                                                  max_q=1, max_k=1))
    with pytest.raises(ValueError, match="65534 packed sequences"):
        ka.attention_backward(AttentionBackwardCall(q, q, k, v, q, torch.zeros(2, 4), None, None, False, 0.25, 0.0, 0,
                                                    False, cu_seq_q=cu, cu_seq_k=cu, max_q=1, max_k=1))


# ------------------------------------------------------------------------------------------
# Interpreter tests: Flash-Decoding
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_equals_unsplit(dtype):
    """Forced splits (also more splits than tiles: empty shares) give the unsplit result to
    rounding, and the reference's within the policy; with GQA packing, ALiBi, softcap, sinks,
    a padding mask and a float mask."""
    q, k, v = make_qkv(2, 4, 3, 100, 16, Hk=2, dtype=dtype, device=_device())
    pad = random_key_padding(2, 100, fully_padded_row=1, device=_device())
    mask = random_attn_mask((2, 1, 3, 100), "float", dtype=dtype, device=_device())
    extras = dict(attn_mask=mask.expand(2, 4, 3, 100), key_padding_mask=pad, softcap=6.0,
                  alibi_slopes=torch.rand(2, 4, device=_device()), sinks=torch.randn(4, device=_device()))
    out1, lse1 = triton_forward(q, k, v, num_splits=1, **extras)
    for splits in (3, 64):
        out, lse = triton_forward(q, k, v, num_splits=splits, **extras)
        assert (out.float() - out1.float()).abs().max() <= (2e-3 if dtype == torch.float16 else 2e-6)
        assert (lse - lse1).abs().max() < 1e-5
    ref, ref_lse = reference.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask.double(), key_padding_mask=pad, softcap=6.0,
        alibi_slopes=extras["alibi_slopes"].double(), sinks=extras["sinks"].double(), return_lse=True)
    lowp = reference.scaled_dot_product_attention(q, k, v, mask, key_padding_mask=pad, softcap=6.0,
                                                  alibi_slopes=extras["alibi_slopes"].to(dtype),
                                                  sinks=extras["sinks"].to(dtype))
    assert_close_to_reference(out, ref, lowp, what="split output")
    assert (lse.double() - ref_lse).abs().max() < 1e-5


def test_decoding_splits_chosen_automatically():
    """One query per sequence against a long cache under-fills the (assumed 4-SM) device: the
    split rule picks several shares, through scaled_dot_product_attention and varlen_attn."""
    from transformer_fast.kernels.attention_decode import plan_splits

    assert plan_splits(0, 1, 600, torch.device(_device()), 0.0) > 1
    assert plan_splits(0, 1, 600, torch.device(_device()), 0.1) == 1  # not with dropout
    assert plan_splits(1, 1, 600, torch.device(_device()), 0.0) == 1
    assert plan_splits(0, 1000, 600, torch.device(_device()), 0.0) == 1  # the device is full anyway
    from transformer_fast.kernels import attention as ka

    merges = []
    combine = ka.launch_combine

    class Counted:
        def run(self, plan, tensors, seed=0):  # a launch plan's (kernels/_launch.py)
            merges.append(plan.grid)
            combine.run(plan, tensors, seed)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ka, "launch_combine", Counted())
        q, k, v = make_qkv(1, 2, 1, 600, 16, dtype=torch.float16, device=_device())
        check_dense(q, k, v, grads=False, window=(400, -1))
        assert len(merges) == 1
        lq, lk = [1, 1], [600, 17]
        q, k, v, cu_q, cu_k = make_packed(lq, lk, 2, 16, Hk=1, dtype=torch.float16, device=_device())
        check_varlen(q, k, v, cu_q, cu_k, grads=False, sinks=torch.randn(2, device=_device()))
        assert len(merges) == 2


def test_launchers_run_no_torch_op_beyond_outputs_and_scratch(monkeypatch):
    """Packed, paged and split calls allocate their outputs and the split scratch, and run no
    other torch op (no host-side bookkeeping that would wait for the device)."""
    q, k, v, cu_q, cu_k = make_packed([3, 5], [40, 9], 4, 16, Hk=2)
    pool = torch.randn(6, 8, 2, 16)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    used = torch.tensor([20, 3], dtype=torch.int32)
    slopes, sinks, lse = torch.rand(2, 4), torch.randn(4), torch.zeros(4, 8)

    def run(ka):
        ka.attention_forward(AttentionForwardCall(q, k, v, None, None, False, 0.25, 0.0, 0, (30, 0), 2.0, slopes, sinks,
                                                  cu_q, cu_k, used, None, 5, 40, 3))  # 3 splits: forward, merge
        ka.attention_forward(AttentionForwardCall(q, pool, pool, None, None, False, 0.25, 0.0, 0, (-1, -1), 0.0, None,
                                                  None, cu_q, None, used, table, 5, 24, 1))
        ka.attention_backward(AttentionBackwardCall(q, q, k, v, q, lse, None, None, False, 0.25, 0.1, 3, False, (8, 0),
                                                    2.0, slopes, cu_q, cu_k, 5, 40))

    launches, ops = record_launches_and_ops(monkeypatch, run)
    assert launches == ["attention_fwd_kernel", "attention_combine_kernel", "attention_fwd_kernel",
                        "attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]
    assert set(ops) <= {"empty", "full"}, ops


# ------------------------------------------------------------------------------------------
# On a GPU: the extras at real sizes
# ------------------------------------------------------------------------------------------
GPU_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_windows_softcap_alibi_sinks(D, dtype):
    """Each extra, and all of them together, over lengths that span several tiles of every table."""
    for i, (Nq, Nk) in enumerate([(300, 300), (129, 1000), (1000, 129), (1, 2000)]):
        B, H, Hk = (2, 4, 2) if i % 2 else (3, 2, 2)
        q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=dtype, layout=("bhnd", "bnhd")[i % 2], device="cuda")
        sinks = torch.randn(H, device="cuda")
        slopes = torch.rand(B, H, device="cuda") * 0.1
        pad = random_key_padding(B, Nk, device="cuda")
        check_dense(q, k, v, window=(127, 0), is_causal=bool(i % 2), key_padding_mask=pad)
        check_dense(q, k, v, window=(64, 33))
        check_dense(q, k, v, softcap=20.0, is_causal=True)
        check_dense(q, k, v, alibi=slopes, window=(200, -1))
        check_dense(q, k, v, sinks=sinks, key_padding_mask=pad)
        check_dense(q, k, v, window=(100, 10), softcap=30.0, alibi=slopes, sinks=sinks, key_padding_mask=pad,
                    attn_mask=random_attn_mask((B, 1, Nq, Nk), "float", dtype=dtype, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_varlen(D, dtype):
    """Packs of 1 to 1000 tokens (queries and keys unequal), GQA, a causal window, soft-capping,
    ALiBi and sinks, forward and backward; seqused_k."""
    g = torch.Generator().manual_seed(D)
    lq = [int(x) for x in torch.randint(0, 600, (9,), generator=g)] + [1, 0, 1000]
    lk = [n + int(x) for n, x in zip(lq, torch.randint(0, 300, (12,), generator=g))]
    q, k, v, cu_q, cu_k = make_packed(lq, lk, 8, D, Hk=2, dtype=dtype, device="cuda")
    check_varlen(q, k, v, cu_q, cu_k)
    check_varlen(q, k, v, cu_q, cu_k, window=(255, 0), softcap=30.0, alibi=torch.rand(12, 8, device="cuda") * 0.1,
                 sinks=torch.randn(8, device="cuda"))
    used = torch.tensor([max(0, n - 7) for n in lk], dtype=torch.int32, device="cuda")
    check_varlen(q, k, v, cu_q, cu_k, seqused_k=used, window=(-1, 0), grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_gpu_paged_decoding_and_splits(page_size, dtype):
    """Decoding (1 to 4 queries per sequence) from a paged cache of up to 8k keys, GQA packed,
    automatic and forced splits against the unsplit kernel and the reference."""
    B, H, Hk, D = 3, 32, 8, 128
    used = [8000, 1, 3000]
    lq = [1, 4, 2]
    pages_per_seq = -(-max(used) // page_size)
    num_pages = B * pages_per_seq
    pool_k, pool_v = (torch.randn(num_pages, page_size, Hk, D, dtype=dtype, device="cuda") for _ in range(2))
    table = torch.randperm(num_pages, device="cuda").view(B, pages_per_seq).to(torch.int32)
    q = torch.randn(sum(lq), H, D, dtype=dtype, device="cuda")
    cu_q = cu_seq(lq, "cuda")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    results = {}
    for splits in (None, 1, 7):
        results[splits] = check_varlen(q, pool_k, pool_v, cu_q, None, seqused_k=seqused, block_table=table,
                                       num_splits=splits, grads=False, window=(-1, 0))
    assert (results[7].float() - results[1].float()).abs().max() < 2e-2
    # dense decoding through scaled_dot_product_attention: one query against 32k keys
    q, k, v = make_qkv(1, 32, 1, 32768, 128, Hk=8, dtype=dtype, device="cuda")
    check_dense(q, k, v, grads=False)
