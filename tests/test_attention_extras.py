"""Sliding windows, soft-capping, ALiBi and attention sinks through the public
``scaled_dot_product_attention`` on every backend, against the float64 reference (outputs and
the gradients of q, k, v and the sinks). The Triton kernels run under the interpreter on small
shapes; each backend's own paths (packed products, splits, tiles) have tests beside its kernels."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import reference

from attention_cases import check_attention, make_qkv, random_attn_mask, random_key_padding
from helpers import BACKENDS, LOW_PRECISION, kernel_device as _device
from helpers import skip_unavailable_backend  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("skip_unavailable_backend")


# (Nq, Nk, window, is_causal): windows aligned to the bottom right when Nq != Nk.
WINDOWS = [
    (17, 17, (4, 0), False),     # causal sliding window
    (17, 40, (3, 5), False),     # two-sided, fewer queries than keys
    (40, 17, (0, 0), False),     # zero width: one key per row, none for the first 23 rows
    (17, 17, (-1, 2), True),     # one-sided, intersected with top-left causality
    (17, 33, (100, 100), False),  # wider than the sequence: full attention
    (1, 40, (7, 0), False),      # one decoding query sees the last 8 keys
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WINDOWS, ids=str)
def test_window(backend, case):
    Nq, Nk, window, is_causal = case
    for dtype in (torch.float32, LOW_PRECISION[backend]):
        q, k, v = make_qkv(2, 2, Nq, Nk, 16, dtype=dtype, device=_device())
        check_attention(backend, q, k, v, window_size=window, is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_with_padding_mask_and_gqa(backend):
    dtype = LOW_PRECISION[backend]
    q, k, v = make_qkv(3, 4, 33, 33, 24, Hk=2, dtype=dtype, device=_device())
    pad = random_key_padding(3, 33, fully_padded_row=2, device=_device())
    mask = random_attn_mask((33, 33), "bool", device=_device())
    check_attention(backend, q, k, v, window_size=(5, 3), key_padding_mask=pad, attn_mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_with_extreme_scores(backend):
    """Scores of a few hundred: the cap, not the scale, decides the softmax; a float mask that
    requires grad gets the gradient of the final score (before the cap's derivative)."""
    for dtype in (torch.float32, LOW_PRECISION[backend]):
        q, k, v = make_qkv(2, 2, 17, 33, 16, dtype=dtype, device=_device())
        q = (q * 20).to(dtype)
        check_attention(backend, q, k, v, softcap=30.0, is_causal=True)
        mask = random_attn_mask((2, 1, 17, 33), "float", dtype=dtype, device=_device()).requires_grad_()
        out = tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, softcap=30.0, backend=backend)
        dmask = torch.autograd.grad(out.float().square().sum(), mask)[0]
        ref_mask = mask.detach().double().requires_grad_()
        ref = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(), ref_mask, softcap=30.0)
        ref_dmask = torch.autograd.grad(ref.square().sum(), ref_mask)[0]
        scale = ref_dmask.abs().max().item()
        tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
        assert (dmask.double() - ref_dmask).abs().max().item() <= tol * scale, "dmask with softcap"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(backend, per_batch):
    for dtype in (torch.float32, LOW_PRECISION[backend]):
        q, k, v = make_qkv(2, 4, 17, 40, 16, dtype=dtype, device=_device())
        slopes = torch.rand(2, 4, device=_device()) if per_batch else 2.0 ** -torch.arange(1, 5, device=_device())
        check_attention(backend, q, k, v, alibi_slopes=slopes, is_causal=not per_batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_fully_masked_rows(backend):
    """A row with no allowed key gives 0 (the sink takes all the probability), never NaN, and
    the sinks get their gradient."""
    for dtype in (torch.float32, LOW_PRECISION[backend]):
        q, k, v = make_qkv(3, 2, 17, 33, 16, dtype=dtype, device=_device())
        pad = random_key_padding(3, 33, fully_padded_row=1, device=_device())
        sinks = torch.randn(2, device=_device()).to(dtype)
        out = check_attention(backend, q, k, v, key_padding_mask=pad, sinks=sinks)
        assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_extras_together(backend):
    dtype = LOW_PRECISION[backend]
    q, k, v = make_qkv(2, 4, 33, 40, 24, Dv=16, Hk=2, dtype=dtype, device=_device())
    pad = random_key_padding(2, 40, device=_device())
    check_attention(backend, q, k, v, key_padding_mask=pad, window_size=(6, 2), softcap=5.0,
                    alibi_slopes=torch.rand(4, device=_device()), sinks=torch.randn(4, device=_device()).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_query_against_a_long_cache(backend):
    """One query per head against many keys (the decoding step), GQA, with a window and sinks."""
    Nk = 64 if backend == "triton" else 700
    q, k, v = make_qkv(2, 8, 1, Nk, 32, Hk=2, dtype=LOW_PRECISION[backend], device=_device())
    check_attention(backend, q, k, v)
    check_attention(backend, q, k, v, window_size=(40, 0), sinks=torch.randn(8, device=_device()))


def test_float64_and_gradcheck():
    """float64 (the plain-torch backend): exact to rounding, and autograd's numerical check of
    every gradient, sinks included."""
    q, k, v = (t.double().requires_grad_() for t in make_qkv(1, 2, 5, 7, 4))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, dtype=torch.float64)

    def attention(q, k, v, sinks):
        return tf.scaled_dot_product_attention(q, k, v, window_size=(2, 1), softcap=2.0, alibi_slopes=slopes,
                                               sinks=sinks)
    assert torch.autograd.gradcheck(attention, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(attention, (q, k, v, sinks))


def test_sinks_gradient_in_the_sinks_dtype():
    q, k, v = make_qkv(1, 2, 5, 7, 8, dtype=torch.bfloat16)
    sinks = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    tf.scaled_dot_product_attention(q, k, v, sinks=sinks).float().sum().backward()
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (2,)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(window_size=(2.5, 0)), TypeError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.int64)), TypeError, "alibi_slopes"),
    (dict(sinks=torch.ones(2, 1)), ValueError, "sinks"),
    (dict(sinks=torch.ones(2, dtype=torch.int32)), TypeError, "sinks"),
])
def test_bad_extras_are_refused(kwargs, error, words):
    q, k, v = make_qkv(1, 2, 5, 5, 8)
    with pytest.raises(error, match=words):
        tf.scaled_dot_product_attention(q, k, v, **kwargs)
