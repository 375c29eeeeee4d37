"""The Triton attention backward with ATOMIC_DQ (TRANSFORMER_FAST_ATOMIC_DQ=1): the dK/dV kernel
adds each tile's dQ into a float32 sum and the dQ kernel is not launched. Against the float64
reference with the package's policy, over the features whose dS reaches dQ (masks, padding,
windows, softcap, ALiBi, dropout, GQA, packed sequences); and which kernels each call launches.
"""
import pytest
import torch

from transformer_fast._attention_call import AttentionBackwardCall
import transformer_fast as tf

from transformer_fast.kernels import attention as ka

from attention_cases import (check_attention, dropout_keep_mask, make_qkv, random_attn_mask, random_key_padding,
                             record_launches)
from helpers import TRITON_TESTS, kernel_device as _device
from varlen_cases import check_varlen, make_pack

pytestmark = TRITON_TESTS


@pytest.fixture
def atomic_dq(monkeypatch):
    """Backward plans made with TRANSFORMER_FAST_ATOMIC_DQ=1 (and dropped after, so that other
    tests plan without it)."""
    monkeypatch.setenv("TRANSFORMER_FAST_ATOMIC_DQ", "1")
    ka._backward_plans.clear()
    yield
    ka._backward_plans.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Nq,Nk,D", [(17, 40, 16), (40, 17, 40), (1, 17, 16), (33, 33, 24)])
def test_lengths_causal_and_padding(atomic_dq, Nq, Nk, D, is_causal, dtype):
    q, k, v = make_qkv(2, 2, Nq, Nk, D, dtype=dtype, device=_device())
    pad = random_key_padding(2, Nk, fully_padded_row=1, device=_device())
    check_attention("triton", q, k, v, is_causal=is_causal)
    check_attention("triton", q, k, v, is_causal=is_causal, key_padding_mask=pad)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_gqa_and_extras(atomic_dq, kind):
    """A mask (a float one with -inf rows and huge values), GQA, a two-sided window, softcap and
    per-head ALiBi in one call: every term of dS before it meets K."""
    q, k, v = make_qkv(2, 4, 23, 40, 16, Hk=2, device=_device())
    mask = random_attn_mask((2, 4, 23, 40), kind, device=_device())
    check_attention("triton", q, k, v, attn_mask=mask)
    check_attention("triton", q, k, v, attn_mask=mask, window_size=(9, 3), softcap=2.5,
                    alibi_slopes=torch.rand(4, device=_device()))


def test_padded_keys_with_nan_mask_values(atomic_dq):
    """NaN in a float mask where keys are padded: the dK/dV kernel leaves padded keys to its store
    (their P is NaN there), so their dS must be dropped before it meets K. Against the reference
    on the same mask with 0 there (a padded key's mask value is never used)."""
    q, k, v = make_qkv(2, 2, 19, 40, 16, device=_device())
    pad = random_key_padding(2, 40, device=_device())
    pad[:, 7] = True
    mask = torch.randn(2, 2, 19, 40, device=_device()).masked_fill(pad[:, None, None, :], 0.0)

    def poisoned(q, k, v, attn_mask, **kwargs):
        return tf.scaled_dot_product_attention(q, k, v, attn_mask.masked_fill(pad[:, None, None, :], float("nan")),
                                               backend="triton", **kwargs)

    check_attention("triton", q, k, v, attn_mask=mask, key_padding_mask=pad, attention=poisoned)


def test_dropout(atomic_dq):
    q, k, v = make_qkv(1, 2, 20, 36, 16, device=_device())
    keep = dropout_keep_mask("triton", q, k, 0.3, 11)
    check_attention("triton", q, k, v, dropout=(0.3, 11, keep))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_sequences(atomic_dq, dtype):
    """Empty and one-token sequences, GQA and a causal window: the rows after the last sequence
    and those of query-less sequences stay zero in the float32 sum."""
    q, k, v, cu_q, cu_k = make_pack([5, 0, 1, 37, 3], [9, 4, 1, 40, 3], H=4, Hk=2, D=16, dtype=dtype)
    check_varlen("triton", q, k, v, cu_q, cu_k)
    check_varlen("triton", q, k, v, cu_q, cu_k, window_size=(6, 0), softcap=3.0)


def _backward_launches(monkeypatch, **call):
    q, k, v = make_qkv(1, 2, 20, 20, 16)
    lse, dout = torch.zeros(1, 2, 20), torch.randn(1, 2, 20, 16)
    launches = record_launches(monkeypatch)
    ka.attention_backward(AttentionBackwardCall(dout, q, k, v, dout, lse, call.get("attn_mask"), None, False, 0.25,
                                                0.0, 0, call.get("compute_dmask", False),
                                                compute_delta=call.get("compute_delta", False)))
    return launches


def test_launches(atomic_dq, monkeypatch):
    """With ATOMIC_DQ: dK/dV and the conversion, no dQ kernel; where dS or sum P dP is wanted (only
    the dQ kernel writes them) and under torch.use_deterministic_algorithms, the dQ kernel."""
    with_atomics = ["attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_convert_kernel"]
    separate = ["attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]
    assert _backward_launches(monkeypatch) == with_atomics
    assert _backward_launches(monkeypatch, attn_mask=torch.zeros(20, 20), compute_dmask=True) == separate
    assert _backward_launches(monkeypatch, compute_delta=True) == separate
    deterministic = torch.are_deterministic_algorithms_enabled()
    ka._backward_plans.clear()
    torch.use_deterministic_algorithms(True)
    try:
        assert _backward_launches(monkeypatch) == separate
    finally:
        torch.use_deterministic_algorithms(deterministic)
        ka._backward_plans.clear()


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("TRANSFORMER_FAST_ATOMIC_DQ", raising=False)
    ka._backward_plans.clear()
    try:
        assert "attention_bwd_dq_kernel" in _backward_launches(monkeypatch)
    finally:
        ka._backward_plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_atomic_dq(atomic_dq, D, is_causal, dtype):
    """At sizes where many key blocks add into each dQ row (and the autotuner times the tiles,
    zeroing the sum between its runs), with key padding."""
    q, k, v = make_qkv(2, 4, 1000, 1100, D, dtype=dtype, device="cuda")
    pad = random_key_padding(2, 1100, device="cuda")
    check_attention("triton", q, k, v, is_causal=is_causal, key_padding_mask=pad)
