"""Softmax attention on the CPU backends (the C++ kernel, and the reference backend that shares
the kernel-level contract) against the float64 reference. The Triton kernels have their own file,
and so do the C++ backend's CUDA kernels (test_attention_cuda.py; emulated on the CPU:
test_attention_cuda_emulated.py)."""
import functools

import pytest
import torch

import transformer_fast as tf
from transformer_fast._attention_call import AttentionBackwardCall, AttentionForwardCall
from transformer_fast import _build, reference
from transformer_fast._device_kernels import op_kernel

from attention_cases import (check_attention, check_garbage_does_not_leak, check_value_gradient, dropout_keep_mask,
                             inside_nan, make_qkv, random_attn_mask, random_key_padding)
from helpers import compare_with_reference, need_backend, result_strides

BACKENDS = ["reference", "cpp"]


def _dtypes(backend):
    return [torch.float32, torch.bfloat16] if backend == "cpp" else [torch.float32]


# The C++ backend has two product paths: packed blocks (bf16: PyTorch's AMX products; fp32: K^T
# and V^T in panels for the score products) where enough query rows share each packed block,
# MKL otherwise. The tests' small shapes run both by moving that threshold (read per call).
PACK_MIN_ROWS = {"packed": "0", "unpacked": "1000000000"}


@pytest.fixture
def products():
    """Which C++ product path to force; parametrized below where it applies."""
    return None


@pytest.fixture(autouse=True)
def _force_products(products, monkeypatch):
    if products is not None:
        monkeypatch.setenv("TRANSFORMER_FAST_PACK_MIN_ROWS", PACK_MIN_ROWS[products])


CPP_DTYPES_AND_PATHS = [(d, path) for d in (torch.float32, torch.bfloat16) for path in PACK_MIN_ROWS]


def _backend_dtype_params():
    params = []
    for b in BACKENDS:
        for d in _dtypes(b):
            name = f"{b}-{str(d)[6:]}"
            if b == "cpp":
                params += [pytest.param(b, d, path, id=f"{name}-{path}") for path in PACK_MIN_ROWS]
            else:
                params.append(pytest.param(b, d, None, id=name))
    return params


# ---------------------------------------------------------------------------------------------
# Shapes, head dims, layouts, causality, GQA
# ---------------------------------------------------------------------------------------------
# (B, H, Hk, Nq, Nk, D, Dv, is_causal, layout)
SHAPES = [
    (1, 1, 1, 1, 1, 16, 16, False, "bhnd"),
    (1, 1, 1, 1, 300, 64, 64, True, "bhnd"),  # one causal query sees one key
    (1, 4, 4, 17, 17, 40, 40, True, "bhnd"),
    (3, 4, 4, 64, 129, 64, 80, False, "bnhd"),
    (3, 1, 1, 129, 64, 80, 64, True, "bhnd"),  # causal with Nq > Nk
    (1, 4, 4, 300, 300, 128, 128, True, "qkv"),
    (1, 4, 4, 129, 129, 96, 96, False, "qkv"),
    (1, 4, 2, 17, 300, 256, 16, False, "bhnd"),  # GQA, Dv != D
    (3, 4, 1, 300, 17, 16, 40, True, "bnhd"),  # multi-query, causal, Nq > Nk
    (1, 4, 2, 64, 300, 160, 160, True, "bnhd"),  # GQA, causal with Nq < Nk
    (2, 2, 2, 33, 65, 17, 24, True, "bhnd"),  # odd head dim: bf16 C++ cannot use the packed products
]


@pytest.mark.parametrize("backend,dtype,products", _backend_dtype_params())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hk{}q{}k{}D{}Dv{}{}{}".format(
    *s[:7], "-causal" if s[7] else "", "-" + s[8]))
def test_shapes_and_layouts(backend, dtype, shape):
    need_backend(backend)
    B, H, Hk, Nq, Nk, D, Dv, is_causal, layout = shape
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype, layout=layout)
    check_attention(backend, q, k, v, is_causal=is_causal)


# ---------------------------------------------------------------------------------------------
# Masks: key padding (with a fully padded sequence), bool and float attn_mask with broadcast
# dims, causality, and their combinations
# ---------------------------------------------------------------------------------------------
# (mask kind or None, mask shape spec, key padding, causal, B, H, Nq, Nk, D, Dv)
MASKS = [
    (None, None, True, False, 3, 4, 129, 300, 64, 64),
    (None, None, True, True, 3, 1, 300, 129, 40, 80),
    ("bool", "qk", False, False, 1, 4, 64, 129, 64, 64),
    ("float", "qk", False, True, 3, 4, 17, 64, 80, 80),
    ("bool", "b1qk", True, False, 3, 4, 129, 129, 64, 40),
    ("float", "b1qk", True, True, 3, 1, 129, 17, 16, 16),
    ("bool", "1h1k", True, True, 3, 4, 300, 300, 40, 40),
    ("float", "1h1k", False, False, 1, 4, 1, 129, 128, 128),
    ("bool", "bhqk", True, True, 1, 4, 129, 64, 256, 64),
    ("float", "bhqk", True, False, 3, 4, 64, 1, 64, 64),  # one key: most rows fully masked
]


def _mask_shape(spec, B, H, Nq, Nk):
    return {"qk": (Nq, Nk), "b1qk": (B, 1, Nq, Nk), "1h1k": (1, H, 1, Nk), "bhqk": (B, H, Nq, Nk)}[spec]


@pytest.mark.parametrize("backend,dtype,products", _backend_dtype_params())
@pytest.mark.parametrize("case", MASKS, ids=lambda c: "{}-{}{}{}-B{}H{}q{}k{}D{}Dv{}".format(
    c[0], c[1], "-pad" if c[2] else "", "-causal" if c[3] else "", *c[4:]))
def test_masks(backend, dtype, case):
    need_backend(backend)
    kind, spec, padded, is_causal, B, H, Nq, Nk, D, Dv = case
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, dtype=dtype)
    attn_mask = None if kind is None else random_attn_mask(_mask_shape(spec, B, H, Nq, Nk), kind, dtype=dtype)
    pad = random_key_padding(B, Nk, fully_padded_row=B - 1 if B > 1 else None) if padded else None
    check_attention(backend, q, k, v, attn_mask=attn_mask, key_padding_mask=pad, is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale_and_non_contiguous_mask(backend):
    need_backend(backend)
    q, k, v = make_qkv(2, 3, 33, 47, 24, 40, layout="bnhd")
    mask = random_attn_mask((2, 3, 47, 33), "float").transpose(-2, -1)  # strided along keys
    check_attention(backend, q, k, v, attn_mask=mask, scale=0.37)


# Peaked softmaxes (logits with a standard deviation of 4 to 20), in shapes where the C++
# forward's tiles are larger than the backward's. The backward turns recomputed scores into
# probabilities with the forward's log-sum-exp, so a score summed in another order than in the
# forward skews them: that tripled the fp32 gradient error here before the forward computed its
# scores in the backward's tiles.
PEAKED = [  # (B, H, Hk, Nq, Nk, D, Dv, is_causal, scale)
    (3, 1, 1, 129, 129, 128, 128, False, 0.3),
    (1, 2, 2, 300, 600, 64, 64, False, 0.5),
    (3, 2, 1, 65, 17, 80, 128, False, 2.0),
    (1, 2, 2, 300, 300, 80, 80, True, 2.0),
]


@pytest.mark.parametrize("backend,dtype,products", _backend_dtype_params())
@pytest.mark.parametrize("case", PEAKED, ids=str)
def test_peaked_softmax(backend, dtype, case):
    need_backend(backend)
    B, H, Hk, Nq, Nk, D, Dv, is_causal, scale = case
    for _ in range(3):  # fresh inputs each time: the error of one draw may be small by chance
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype)
        check_attention(backend, q, k, v, is_causal=is_causal, scale=scale)


SMALL_PRODUCTS = [  # (B, H, Hk, Nq, Nk, D, Dv, is_causal, scale)
    (2, 1, 1, 9, 17, 256, 128, False, 2.0),
    (2, 3, 1, 2, 1, 256, 256, False, 2.0),
]


@pytest.mark.parametrize("products", ["packed"])
@pytest.mark.parametrize("case", SMALL_PRODUCTS, ids=str)
def test_few_queries_with_wide_heads(case):
    """fp32 scores of a few queries (or a few keys) against wide heads: the C++ backend makes
    products with fewer than 16 rows or columns through MKL, which sums each as a dot product.
    The register tiles' one FMA chain per element gave the output and dQ of such shapes 2-9x the
    reference's error under a peaked softmax (fuzzing; docs/design.md); both cases fail
    with them. Packed products forced: the path where the scores would use register tiles."""
    need_backend("cpp")
    B, H, Hk, Nq, Nk, D, Dv, is_causal, scale = case
    for _ in range(6):
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, layout="bnhd")
        check_attention("cpp", q, k, v, is_causal=is_causal, scale=scale)


RAGGED_KEY_BLOCKS = [  # (B, H, Hk, Nq, Nk, D, Dv, is_causal, softcap): key blocks whose width is not a multiple of 16
    (1, 2, 1, 246, 246, 64, 64, False, None),
    (1, 2, 2, 131, 250, 32, 48, True, 20.0),
    (2, 1, 1, 200, 133, 64, 64, False, 5.0),
]


@pytest.mark.parametrize("products", ["packed"])
@pytest.mark.parametrize("case", RAGGED_KEY_BLOCKS, ids=str)
def test_packed_bf16_products_over_ragged_key_blocks(case):
    """The packed bf16 score and dP products run over the block's keys rounded up to 16 (the
    width of an AMX tile; score_columns in csrc/cpu/attention_tiles.h), K^T and V^T packed with zero
    columns there, so those products write scores past the block's keys, which nothing may read
    (the softcap's tanh tile shares their row length). Forward and backward against float64, with
    k and v views into NaN-filled storage, so a read past their rows would show."""
    need_backend("cpp")
    B, H, Hk, Nq, Nk, D, Dv, is_causal, softcap = case
    torch.manual_seed(Nk)
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=torch.bfloat16)
    k, v = inside_nan(k), inside_nan(v)
    check_attention("cpp", q, k, v, is_causal=is_causal, softcap=softcap)


SHORT_REDUCTIONS = [  # (B, H, Hk, Nq, Nk, D, Dv): every tile product over at most 16 terms
    (2, 2, 2, 1, 16, 64, 48),
    (1, 4, 2, 3, 5, 80, 80),
    (2, 2, 1, 9, 3, 40, 16),
    (1, 2, 2, 2, 16, 128, 48),
]


@pytest.mark.parametrize("products", ["unpacked"])
@pytest.mark.parametrize("case", SHORT_REDUCTIONS, ids=str)
def test_bf16_short_reductions_match_the_reference(case):
    """bf16 tile products over a few queries or keys: rounding P and dS to bf16 before them made
    gradients of 1-9 queries up to 2-4x the reference's error in fuzzing. The C++ backend makes
    such products in fp32 (kShortReduction in csrc/cpu/attention_tiles.h), as the reference does, so this
    asserts 1.25x the reference's error with no absolute slack (with bf16 products all four
    shapes failed 1.1x). Not 1.1x: these rows fit one key tile, where the kernel takes delta from
    P and dP rather than from the rounded output (test_attention_precision_tail.py), so it follows
    neither reference formulation exactly: over 20 draws of each shape its dQ/dK errors are a
    median 0.5-0.64x the reference's, 1.2x at most. Non-causal with 2 or more keys: a single key
    makes dS an exact cancellation whose rounding no bound relative to the reference fits."""
    need_backend("cpp")
    B, H, Hk, Nq, Nk, D, Dv = case
    for _ in range(20):
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=torch.bfloat16)
        check_attention("cpp", q, k, v, factor=1.25, atol=0.0)


@pytest.mark.parametrize("pad_to_one_key", [False, True], ids=["Nk1", "padded-to-1"])
def test_value_gradient_of_one_key_summed_over_many_rows(pad_to_one_key):
    """Where every query of a GQA group has one usable key, that key's dV is the sum of dO over
    all 900 rows of the group. MKL makes a product with one row of output as a gemv that adds
    its terms one after another; through that, fp32 dV had 1.4x the reference's error in the
    median draw (2x at worst, more in fuzzing). The C++ products with one or two output rows sum
    in chunks (csrc/cpu/cpu_blas.h): 0.3x, 0.5x at worst. So this asserts 1x, not the usual 2x."""
    need_backend("cpp")
    B, H, Hk, Nq, D = 2, 6, 2, 300, 64
    Nk = 3 if pad_to_one_key else 1
    pad = torch.tensor([[False, True, True], [True, False, True]]) if pad_to_one_key else None
    attention = functools.partial(tf.scaled_dot_product_attention, backend="cpp")
    for _ in range(3):
        q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk)
        check_value_gradient(attention, q, k, v, key_padding_mask=pad, factor=1.0, what="dV of one key")


# Not the reference backend: it materialises P @ V, so 0 * NaN leaks there by design.
@pytest.mark.parametrize("backend", ["cpp"])
@pytest.mark.parametrize("dtype,products", CPP_DTYPES_AND_PATHS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_garbage_in_masked_keys_does_not_leak(backend, dtype, is_causal):
    """NaN/inf stored in padded keys and values (and in keys right of the causal diagonal, when
    every query is left of them) must not reach the output or the gradients. (The packed bf16
    products pack V blocks ahead; an odd Nk gives them a zero pad row.)"""
    need_backend(backend)
    B, H, Nq, Nk, D = 3, 2, 40, 151, 64
    q, k, v = make_qkv(B, H, Nq, Nk, D, dtype=dtype)
    pad = random_key_padding(B, Nk, fully_padded_row=1)
    pad[0, 5] = True  # a padded key in the middle of the row: a hole in a tile
    pad[2, :3] = True
    garbage = pad[:, None, :, None].clone()
    if is_causal:
        garbage[:, :, Nq:] = True  # keys no query may see
    out = check_garbage_does_not_leak(q, k, v, pad, garbage, "poisoned", is_causal=is_causal, backend=backend)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the fully padded sequence gives 0


@pytest.mark.parametrize("dtype,products", CPP_DTYPES_AND_PATHS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_garbage_after_the_last_key_does_not_leak(dtype, is_causal):
    """Right padding (no holes): the C++ forward ends a key tile at the sequence's last unpadded
    key, so the padded keys are neither masked nor used; the packed bf16 value product still runs
    over the whole packed block, whose padded rows must then be zeros. NaN/inf in the padded keys
    and values, sequences ending inside a tile after an odd and an even number of its keys, at a
    tile's start and in the first of two tiles (512 keys a tile)."""
    need_backend("cpp")
    B, H, Nq, Nk, D = 6, 2, 33, 600, 64
    q, k, v = make_qkv(B, H, Nq, Nk, D, dtype=dtype)
    lengths = torch.tensor([600, 513, 518, 300, 7, 512])
    pad = torch.arange(Nk)[None, :] >= lengths[:, None]
    check_garbage_does_not_leak(q, k, v, pad, pad[:, None, :, None], "garbage after the last key", is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,products", CPP_DTYPES_AND_PATHS, ids=str)
def test_nan_in_a_query_shows_in_its_row_only(backend, dtype):
    """A NaN in an (unmasked) query makes that query's output NaN, as in PyTorch, and leaves the
    other rows alone: a NaN score must not turn into a zero probability."""
    need_backend(backend)
    B, H, Nq, Nk, D = 2, 2, 70, 300, 64
    q, k, v = make_qkv(B, H, Nq, Nk, D, dtype=dtype)
    q[1, 0, 33, 7] = float("nan")
    out = tf.scaled_dot_product_attention(q, k, v, backend=backend)
    row_has_nan = torch.isnan(out).any(-1)
    expected = torch.zeros_like(row_has_nan)
    expected[1, 0, 33] = True
    assert torch.equal(row_has_nan, expected)
    assert torch.isnan(out[1, 0, 33]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_sum_exp(backend):
    """The kernel-level lse: the row's log-sum-exp of the scaled masked scores, +inf for rows
    with no allowed key."""
    need_backend(backend)
    B, H, Nq, Nk, D = 2, 3, 37, 70, 32
    q, k, v = make_qkv(B, H, Nq, Nk, D)
    pad = random_key_padding(B, Nk, fully_padded_row=1)
    mask = random_attn_mask((Nq, Nk), "bool").expand(B, H, Nq, Nk)
    out, lse = op_kernel("attention_forward", backend)(q, k, v, mask, pad, True, 0.2, 0.0, None)
    bias = reference.attention_bias(Nq, Nk, batch=B, heads=H, attn_mask=mask, key_padding_mask=pad,
                                    is_causal=True, dtype=torch.float64)
    expected = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) * 0.2 + bias, dim=-1)
    expected = torch.where(torch.isneginf(expected), float("inf"), expected)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Nq)
    assert torch.equal(torch.isinf(lse), torch.isinf(expected))
    assert torch.isinf(lse[1]).all()
    finite = torch.isfinite(expected)
    assert (lse.double()[finite] - expected[finite]).abs().max() < 1e-5
    assert out.is_contiguous() and out.shape == (B, H, Nq, D)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Nq,Nk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(backend, Nq, Nk):
    need_backend(backend)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, Nq, Nk, 16, 24))
    out = tf.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.zeros(2, Nk, dtype=torch.bool),
                                          backend=backend)
    assert out.shape == (2, 3, Nq, 24) and (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("backend,dtype,products", _backend_dtype_params())
def test_deterministic(backend, dtype):
    need_backend(backend)
    q, k, v = make_qkv(2, 4, 130, 250, 64, dtype=dtype, Hk=2)
    pad = random_key_padding(2, 250)

    def run():
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = tf.scaled_dot_product_attention(qq, kk, vv, is_causal=True, key_padding_mask=pad,
                                              enable_gqa=True, backend=backend)
        out.backward(torch.ones_like(out))
        return out, qq.grad, kk.grad, vv.grad

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------
def _sdpa_seeded(backend, seed, **kwargs):
    def fn(q, k, v):
        torch.manual_seed(seed)
        return tf.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
    return fn


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_same_seed_same_result(backend):
    need_backend(backend)
    q, k, v = make_qkv(2, 3, 45, 77, 32)
    a = _sdpa_seeded(backend, 1, dropout_p=0.3)(q, k, v)
    b = _sdpa_seeded(backend, 1, dropout_p=0.3)(q, k, v)
    c = _sdpa_seeded(backend, 2, dropout_p=0.3)(q, k, v)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_unbiased(backend):
    """The mean over many seeds approaches the output without dropout, and about 1 - p of the
    probabilities are kept."""
    need_backend(backend)
    p, runs = 0.25, 400
    q, k, v = make_qkv(2, 2, 16, 16, 16)
    expected = tf.scaled_dot_product_attention(q, k, v, backend=backend)
    mean = sum(_sdpa_seeded(backend, s, dropout_p=p)(q, k, v) for s in range(runs)) / runs
    assert (mean - expected).abs().max() < 0.06
    eye = torch.eye(16).expand(2, 2, 16, 16)
    kept = torch.stack([_sdpa_seeded(backend, s, dropout_p=p)(q, k, eye) != 0 for s in range(50)])
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02


@pytest.mark.parametrize("backend,dtype,products", _backend_dtype_params())
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Hk", [3, 1])
def test_dropout_gradients_match_reference_with_the_same_mask(backend, dtype, is_causal, Hk):
    """The keep mask is recovered by running with v = identity (out = P * mask / (1 - p), and
    P > 0 wherever a key is allowed); output and gradients for a random v must then match the
    reference given that mask, so the backward regenerates the forward's mask exactly."""
    need_backend(backend)
    B, H, Nq, Nk, D, Dv, p, seed = 2, 3, 37, 70, 24, 72, 0.3, 1234
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype)
    pad = random_key_padding(B, Nk)
    kwargs = dict(dropout_p=p, is_causal=is_causal, key_padding_mask=pad, enable_gqa=Hk != H)
    keep = dropout_keep_mask(backend, q, k, p, seed, is_causal=is_causal, key_padding_mask=pad)
    allowed = ~pad[:, None, None, :] & (torch.ones(Nq, Nk, dtype=torch.bool).tril() if is_causal else True)
    kept_fraction = keep[allowed.expand_as(keep)].float().mean().item()
    assert abs(kept_fraction - (1 - p)) < 0.03

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, is_causal=is_causal, key_padding_mask=pad,
                                                      dropout_mask=keep, dropout_p=p)

    compare_with_reference(_sdpa_seeded(backend, seed, **kwargs), ref, (q, k, v), grad_inputs=(0, 1, 2),
                           what=f"dropout[{backend}]")


# ---------------------------------------------------------------------------------------------
# torch.compile and the op registration with the C++ backend
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph():
    need_backend("cpp")
    q, k, v = make_qkv(2, 4, 33, 50, 40)
    pad = random_key_padding(2, 50)
    mask = random_attn_mask((33, 50), "float")

    def fn(q, k, v):
        return tf.scaled_dot_product_attention(q * 2, k, v, attn_mask=mask, is_causal=True,
                                               key_padding_mask=pad, backend="cpp").sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    args_eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got, expected = compiled(*args), fn(*args_eager)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    expected.sum().backward()
    for a, b in zip(args, args_eager):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cpp(dtype):
    need_backend("cpp")
    B, H, Nq, Nk = 2, 4, 9, 13
    q = torch.randn(B, H, Nq, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(B, 2, Nk, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(B, 2, Nk, 24, dtype=dtype, requires_grad=True)
    pad = random_key_padding(B, Nk)
    mask = random_attn_mask((1, H, Nq, Nk), "bool").expand(B, H, Nq, Nk)
    ops = torch.ops.transformer_fast
    torch.library.opcheck(ops.attention_forward, (q, k, v, mask, pad, True, 0.3, 0.0, None))
    torch.library.opcheck(ops.attention_forward, (q, k, v, None, None, False, 0.25, 0.2, torch.tensor(7)))
    out, lse = ops.attention_forward(q, k, v, mask, pad, True, 0.3, 0.0, None)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.attention_backward,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, mask, pad, True, 0.3,
                           0.0, None, False))


def test_float16_cpp():
    """fp16 runs the same kernel (tile products in fp32 through the fallback product)."""
    need_backend("cpp")
    B, H, Nq, Nk = 2, 2, 70, 45
    q, k, v = make_qkv(B, H, Nq, Nk, 40, 24, dtype=torch.float16, layout="bnhd")
    pad = random_key_padding(B, Nk, fully_padded_row=1)
    mask = random_attn_mask((B, 1, Nq, Nk), "float", dtype=torch.float16)
    check_attention("cpp", q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=True)


# ---------------------------------------------------------------------------------------------
# The C++ entry points called directly, as any caller may, without the Python layer's checks.
# ---------------------------------------------------------------------------------------------
class _CppAttention(torch.autograd.Function):
    """Causal attention through transformer_fast._C's attention_forward / attention_backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, pad, scale):
        out, lse = _build.extension().attention_forward(*AttentionForwardCall(q, k, v, mask, pad, True, scale, 0.0,
                                                                              None))
        ctx.save_for_backward(q, k, v, mask, pad, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, pad, out, lse = ctx.saved_tensors
        dq, dk, dv, dmask, _ = _build.extension().attention_backward(*AttentionBackwardCall(
            dout, q, k, v, out, lse, mask, pad, True, ctx.scale, 0.0, None, ctx.needs_input_grad[3]))
        return dq, dk, dv, dmask, None, None


@pytest.mark.parametrize("B,H,Hk,Nq,Nk", [(2, 3, 3, 0, 5), (2, 3, 3, 5, 0), (2, 3, 3, 0, 0), (0, 3, 3, 5, 5),
                                          (2, 0, 0, 5, 5), (2, 0, 1, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_entry_points_empty_problems(B, H, Hk, Nq, Nk, dtype):
    """No query rows or no keys: out = 0, lse = +inf, zero gradients (laid out as their inputs) and
    dmask."""
    need_backend("cpp")
    C = _build.extension()
    q, k, v = make_qkv(B, H, Nq, Nk, 16, 24, Hk=Hk, dtype=dtype, layout="bnhd")
    mask, pad = torch.randn(B, H, Nq, Nk, dtype=dtype), torch.zeros(B, Nk, dtype=torch.bool)
    seed = torch.tensor(0)
    out, lse = C.attention_forward(*AttentionForwardCall(q, k, v, mask, pad, True, 0.25, 0.1, seed))
    assert out.shape == (B, H, Nq, 24) and out.dtype == dtype and (out == 0).all()
    assert lse.shape == (B, H, Nq) and lse.dtype == torch.float32 and (lse == float("inf")).all()
    for compute_dmask in (False, True):
        *grads, dmask, delta = C.attention_backward(*AttentionBackwardCall(
            torch.randn_like(out), q, k, v, out, lse, mask, pad, True, 0.25, 0.1, seed, compute_dmask,
            compute_delta=compute_dmask))
        for grad, t in zip(grads, (q, k, v)):
            assert grad.shape == t.shape and grad.dtype == dtype and (grad == 0).all()
            assert grad.stride() == result_strides(t, t.shape[-1])
        if compute_dmask:
            assert dmask.shape == (B, H, Nq, Nk) and dmask.dtype == dtype and (dmask == 0).all()
            assert delta.shape == (B, H, Nq) and delta.dtype == torch.float32 and (delta == 0).all()
        else:
            assert dmask is None and delta is None


@pytest.mark.parametrize("D,Dv", [(0, 24), (16, 0), (0, 0)])
@pytest.mark.parametrize("dtype,products", CPP_DTYPES_AND_PATHS, ids=str)
def test_cpp_entry_points_head_dim_0(D, Dv, dtype):
    """An empty dot product is 0: with D = 0 every score is 0 plus the masks (each row averages the
    values of its allowed keys); with Dv = 0 out is empty, lse still each row's log-sum-exp, and the
    gradients are 0. The packed products, whose register tiles leave a product over an empty
    reduction unwritten, must not be used for them."""
    need_backend("cpp")
    B, H, Hk, Nq, Nk, scale = 2, 4, 2, 37, 70, 0.25
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype)
    mask = random_attn_mask((B, H, Nq, Nk), "float", dtype=dtype)
    pad = random_key_padding(B, Nk, fully_padded_row=1)
    compare_with_reference(
        lambda q, k, v, mask: _CppAttention.apply(q, k, v, mask, pad, scale),
        lambda q, k, v, mask: reference.scaled_dot_product_attention(q, k, v, mask, True, scale, key_padding_mask=pad),
        (q, k, v, mask), grad_inputs=(0, 1, 2, 3), what=f"D={D}, Dv={Dv}")
    _, lse = _build.extension().attention_forward(*AttentionForwardCall(q, k, v, mask, pad, True, scale, 0.0, None))
    bias = reference.attention_bias(Nq, Nk, batch=B, heads=H, attn_mask=mask, key_padding_mask=pad, is_causal=True,
                                    dtype=torch.float64)
    expected = torch.logsumexp(bias, dim=-1) if D == 0 else torch.logsumexp(
        q.double() @ k.double().repeat_interleave(H // Hk, 1).transpose(-2, -1) * scale + bias, dim=-1)
    expected = torch.where(torch.isneginf(expected), float("inf"), expected)
    assert torch.equal(torch.isinf(lse), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert (lse.double()[finite] - expected[finite]).abs().max() < 1e-5


def test_cpp_entry_points_reject_inconsistent_shapes():
    """The kernels read k, v, dout, out and lse by the sizes of q (and k): a mismatch is a
    ValueError naming the tensor, not a read past its end."""
    need_backend("cpp")
    C = _build.extension()
    q, k, v = make_qkv(2, 4, 5, 7, 16, 8, Hk=2)
    for args, match in [((q, k[:1], v), r"k must have shape \[2, 2, 7, 16\], got \[1, 2, 7, 16\]"),
                        ((q, k[..., :8], v), r"k must have shape \[2, 2, 7, 16\]"),
                        ((q, k, v[:, :, :6]), r"v must have shape \[2, 2, 7, 8\], got \[2, 2, 6, 8\]"),
                        ((q, k[:, :1], v[:, :1]), None), ((q[:, :3], k, v), r"key heads \(2\) must divide")]:
        if match is None:  # one key head serves all four query heads
            C.attention_forward(*AttentionForwardCall(*args, None, None, False, 0.25, 0.0, None))
            continue
        with pytest.raises(ValueError, match=match):
            C.attention_forward(*AttentionForwardCall(*args, None, None, False, 0.25, 0.0, None))
    out, lse = C.attention_forward(*AttentionForwardCall(q, k, v, None, None, False, 0.25, 0.0, None))
    for dout, o, l, match in [(out[:, :, :4], out, lse, "dout must have shape"), (out, out[..., :4], lse, "out must"),
                              (out, out, lse[:1], r"lse must have shape \[2, 4, 5\]")]:
        with pytest.raises(ValueError, match=match):
            C.attention_backward(*AttentionBackwardCall(dout, q, k, v, o, l, None, None, False, 0.25, 0.0, None, False))
