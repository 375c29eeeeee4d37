"""The C++ CPU attention kernels' own paths for sliding windows, soft-capping, ALiBi, sinks, packed
variable-length sequences (seqused_k, paged caches) and decoding (the GQA-stacked rows and the key
split), against the float64 oracle (transformer_fast/reference.py) with the package's policy
(tests/helpers.py). Outputs are NaN-poisoned (conftest: TRANSFORMER_FAST_POISON=1), so an element a
kernel leaves unwritten fails."""
import os

import pytest
import torch

import transformer_fast as tf
from transformer_fast._attention_call import AttentionForwardCall
from transformer_fast import _build, reference

from attention_cases import check_garbage_does_not_leak, make_qkv, random_attn_mask, random_key_padding
from helpers import assert_close_to_reference, compare_with_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The C++ backend's product paths (test_attention.py): packed blocks where the CPU has them (forced
# by a threshold of 0 rows), MKL otherwise; the decoding stacks GQA rows only off the packed path.
PACK_MIN_ROWS = {"packed": "0", "unpacked": "1000000000"}


@pytest.fixture(autouse=True)
def _need_cpp():
    reason = tf.available_backends()["cpp"]["cpu"]
    if reason != "ok":
        pytest.fail(f"the C++ backend must be available for these tests: {reason}")
    assert os.environ.get("TRANSFORMER_FAST_POISON") == "1"


def _id(case):
    return "-".join(f"{k}{v}" for k, v in case.items() if v not in (None, False))


# ---------------------------------------------------------------------------------------------
# The dense kernel's extras: window, softcap, ALiBi, sinks, with causal, padding and masks
# ---------------------------------------------------------------------------------------------
def flash_gradients(q, k, v, dout, *, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                    window_size=None, softcap=None, alibi_slopes=None, sinks=None):
    """dq, dk, dv by FlashAttention-2's equations in fp32 (delta = rowsum(dO * O), O rounded to the
    inputs' dtype), with the soft-capping's factor: the kernels' formulation (attention_cases has
    the one without extras)."""
    dtype = q.dtype
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    qf, kf, vf, dof = (t.detach().float() for t in (q, k, v, dout))
    kf, vf = kf.repeat_interleave(H // Hk, 1), vf.repeat_interleave(H // Hk, 1)
    scale = D ** -0.5 if scale is None else scale
    raw = qf @ kf.transpose(-2, -1) * scale
    t = torch.tanh(raw / softcap) if softcap else None
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    s = (softcap * t if softcap else raw) + reference.attention_bias(
        Nq, Nk, batch=B, heads=H, attn_mask=mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
        window_size=window_size, alibi_slopes=alibi_slopes, dtype=torch.float32)
    terms = s if sinks is None else torch.cat([s, sinks.float()[None, :, None, None].expand(B, H, Nq, 1)], -1)
    lse = torch.logsumexp(terms, -1, keepdim=True)
    p = torch.where(torch.isneginf(s), 0.0, torch.exp(s - lse))
    out = (p @ vf).to(dtype).float()
    dp = dof @ vf.transpose(-2, -1)
    ds = p * (dp - (dof * out).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - t * t)
    dq = ds @ kf * scale
    dk = (ds.transpose(-2, -1) @ qf * scale).unflatten(1, (Hk, H // Hk)).sum(2)
    dv = (p.transpose(-2, -1) @ dof).unflatten(1, (Hk, H // Hk)).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def check_dense(q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None, window_size=None,
                softcap=None, alibi_slopes=None, sinks=None, grads=True, mask_grad=False, what=""):
    """Output and gradients (q, k, v, the sinks', a float mask's) of the C++ kernels against the oracle."""
    gqa = k.shape[1] != q.shape[1]
    extras = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)

    def kernel(q, k, v, sinks, mask):
        return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                               enable_gqa=gqa, key_padding_mask=key_padding_mask, sinks=sinks,
                                               backend="cpp", **extras)

    def ref(q, k, v, sinks, mask):
        return reference.scaled_dot_product_attention(q, k, v, mask, is_causal, scale,
                                                      key_padding_mask=key_padding_mask, sinks=sinks, **extras)

    def flash(inputs, dout):
        return flash_gradients(*inputs[:3], dout, attn_mask=inputs[4], key_padding_mask=key_padding_mask,
                               is_causal=is_causal, scale=scale, sinks=inputs[3], **extras)

    grad_inputs = ((0, 1, 2) + ((3,) if sinks is not None else ()) + ((4,) if mask_grad else ())) if grads else ()
    return compare_with_reference(kernel, ref, (q, k, v, sinks, attn_mask), grad_inputs=grad_inputs, what=what,
                                  gradient_formulation=flash)


# (B, H, Hk, Nq, Nk, D, window, causal, padding, mask kind, softcap, alibi, sinks)
DENSE_CASES = [
    dict(B=2, H=4, Hk=2, Nq=70, Nk=70, D=32, window=(1000, 1000)),  # wider than the sequence
    dict(B=1, H=2, Hk=2, Nq=40, Nk=90, D=16, window=(0, 0), sinks=True),  # zero-width: rows with no key
    dict(B=2, H=2, Hk=1, Nq=33, Nk=150, D=24, window=(-1, 5), causal=True, pad=True),  # one-sided, causal
    dict(B=2, H=4, Hk=4, Nq=150, Nk=47, D=40, window=(7, -1), mask="bool"),  # Nq > Nk
    dict(B=1, H=3, Hk=1, Nq=300, Nk=300, D=64, window=(100, 0), pad=True, alibi=True),  # several key tiles
    dict(B=2, H=2, Hk=2, Nq=65, Nk=129, D=48, softcap=30.0, alibi=True, mask="float", sinks=True),
    dict(B=2, H=2, Hk=1, Nq=17, Nk=530, D=16, window=(200, 3), softcap=5.0, sinks=True, pad=True, causal=True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DENSE_CASES, ids=_id)
def test_dense_extras(case, dtype):
    B, H, Hk, Nq, Nk, D = (case[k] for k in ("B", "H", "Hk", "Nq", "Nk", "D"))
    q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=dtype, layout="bnhd")
    pad = random_key_padding(B, Nk, fully_padded_row=B - 1 if B > 1 else None) if case.get("pad") else None
    mask = random_attn_mask((B, 1, Nq, Nk), case["mask"], dtype=dtype) if case.get("mask") else None
    slopes = torch.rand(B, H) if case.get("alibi") else None  # per batch
    sinks = torch.randn(H) * 2 if case.get("sinks") else None
    check_dense(q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=case.get("causal", False),
                window_size=case.get("window"), softcap=case.get("softcap"), alibi_slopes=slopes, sinks=sinks,
                mask_grad=mask is not None and mask.is_floating_point(), what=_id(case))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_sinks_gradient_over_many_rows(seed):
    """The sinks' gradient sums P_sink * delta over every row of a head: fp16, head dim 128, the
    shapes of the gpu test of the extras (up to 3,000 rows a head). With delta = dO . O its error
    was 3.7x and 4.5x the bound's reference error in two of these 24 draws (1000 x 129); with delta
    summed from the kernels' P and dP it is at most 0.01x."""
    for i, (Nq, Nk) in enumerate([(300, 300), (129, 1000), (1000, 129), (1, 2000)]):
        torch.manual_seed(seed)
        B, H, Hk = (2, 4, 2) if i % 2 else (3, 2, 2)
        q, k, v = make_qkv(B, H, Nq, Nk, 128, Hk=Hk, dtype=torch.float16, layout=("bhnd", "bnhd")[i % 2])
        sinks = torch.randn(H)
        check_dense(q, k, v, sinks=sinks, key_padding_mask=random_key_padding(B, Nk), what=f"{Nq}x{Nk}")


@pytest.mark.parametrize("share", [1e-3, 3e-5, 1e-5, 1e-6])
def test_float32_gradients_with_a_sink_of_a_tiny_share(share):
    """A sink that takes a tiny share of every row, fp32: the backward rescales a row whose keys fit
    one tile so that its P sum to what the forward's did (renormalize_row), 1 - P_sink. Rescaled to
    1, the sink's share was taken for rounding wherever it fell below the rounding bound (about 5e-5
    here): dQ, dK and dV 11-56x the reference's error at shares of 1e-5 and 3e-5 (varlen hunt); the
    3e-5 case fails with it (1e-5 stays within the fp32 atol of 1e-5)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 2, 400, 400, 64)
    lse_keys = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 8, -1)  # scale 1/sqrt(64)
    sinks = (lse_keys[0].mean(-1) + torch.tensor(share).log()).float()
    check_dense(q, k, v, sinks=sinks, what=f"sink share {share}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_with_extreme_scores(dtype):
    """Scores in the hundreds, capped at 5: tanh saturates (its gradient factor underflows to 0 for
    most pairs), no NaN or inf, the softmax of the capped scores."""
    q, k, v = make_qkv(2, 2, 40, 77, 32, dtype=dtype)
    q = (q.float() * 20).to(dtype)
    check_dense(q, k, v, softcap=5.0, what="softcap 5, |scores| ~ 100")
    check_dense(q, k, v, softcap=50.0, scale=1.0, window_size=(10, 10), what="softcap 50, scale 1, window")


@pytest.mark.parametrize("products", PACK_MIN_ROWS)
def test_product_paths_with_softcap_and_alibi(products, monkeypatch):
    """The packed products fold the softmax scale into the exponent: soft-capping and ALiBi need
    the scaled scores, and the backward must recompute them as the forward made them."""
    monkeypatch.setenv("TRANSFORMER_FAST_PACK_MIN_ROWS", PACK_MIN_ROWS[products])
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_qkv(1, 2, 80, 140, 32, dtype=dtype)
        check_dense(q, k, v, softcap=4.0, alibi_slopes=torch.rand(2), window_size=(50, -1), scale=0.5,
                    what=f"{products} {dtype}")


def test_lse_and_rows_without_keys():
    """The kernel-level lse includes the sink; a row with no allowed key gives out 0 and lse =
    sinks[h] (+inf without sinks), not NaN."""
    C = _build.extension()
    B, H, Nq, Nk, D = 2, 3, 20, 9, 16
    q, k, v = make_qkv(B, H, Nq, Nk, D)
    sinks = torch.randn(H)
    slopes = torch.rand(B, H)
    for sink in (sinks, None):
        out, lse = C.attention_forward(*AttentionForwardCall(q, k, v, None, None, False, 0.3, 0.0, None, [0, 0], 2.0,
                                                             slopes, sink))
        ref_out, ref_lse = reference.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), None, False, 0.3, window_size=(0, 0), softcap=2.0,
            alibi_slopes=slopes.double(), sinks=None if sink is None else sink.double(), return_lse=True)
        empty = torch.arange(Nq) < Nq - Nk  # rows i with i + Nk - Nq < 0: no key in their window
        assert (out[:, :, empty] == 0).all()
        expected_empty = (sinks[None, :, None].expand(B, H, int(empty.sum())) if sink is not None
                          else torch.full((B, H, int(empty.sum())), float("inf")))
        assert torch.equal(lse[:, :, empty], expected_empty)
        assert (lse.double() - ref_lse).abs()[:, :, ~empty].max() < 1e-5
        assert (out.double() - ref_out).abs().max() < 1e-5


def test_garbage_outside_every_window_does_not_leak():
    """Keys outside every row's band (a window of 30 over 400 keys) hold NaN and inf: the tiles
    holding only such keys are never visited, and the band masks the others exactly."""
    q, k, v = make_qkv(2, 2, 64, 400, 32)
    window = (30, 0)
    outside = torch.ones(400, dtype=torch.bool)
    outside[400 - 64 - 30:] = False  # row i sees keys i + 336 - 30 .. i + 336

    def poisoned(q, k, v):
        k = k.masked_fill(outside[:, None], float("nan"))
        v = v.masked_fill(outside[:, None], float("inf"))
        return tf.scaled_dot_product_attention(q, k, v, window_size=window, backend="cpp")

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, window_size=window)

    compare_with_reference(poisoned, ref, (q, k, v), grad_inputs=(0, 1, 2), what="garbage outside the window")


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------
def make_pack(q_lens, k_lens, H, Hk, D, Dv=None, dtype=torch.float32, extra_rows=0):
    Dv = D if Dv is None else Dv
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]) + extra_rows, H, D, dtype=dtype)
    k = torch.randn(int(cu_k[-1]) + extra_rows, Hk, D, dtype=dtype)
    v = torch.randn(int(cu_k[-1]) + extra_rows, Hk, Dv, dtype=dtype)
    return q, k, v, cu_q, cu_k


def varlen_flash_gradients(q, k, v, dout, cu_q, cu_k, **kw):
    """flash_gradients per sequence of a pack (rows outside every sequence: 0)."""
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    slopes = kw.pop("alibi_slopes", None)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        g = flash_gradients(*(t[r].transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq))),
                            alibi_slopes=None if slopes is None else slopes[b:b + 1], **kw)
        for out, gg, r in zip(grads, g, (rq, rk, rk)):
            out[r] = gg[0].transpose(0, 1)
    return grads


def check_varlen(q, k, v, cu_q, cu_k, *, grads=True, what="", num_splits=None, **kw):
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if len(cu_q) > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if len(cu_k) > 1 else 0
    gqa = k.shape[1] != q.shape[1]

    def kernel(q, k, v):
        return tf.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=gqa, num_splits=num_splits,
                              backend="cpp", **kw)

    def ref(q, k, v):  # (rows after the last sequence: 0)
        out = reference.varlen_attention(q, k, v, cu_q, cu_k, **kw)
        return torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])

    def flash(inputs, dout):
        return varlen_flash_gradients(*inputs, dout, cu_q, cu_k, **kw)

    out = compare_with_reference(kernel, ref, (q, k, v), grad_inputs=(0, 1, 2) if grads else (), what=what,
                                 gradient_formulation=flash)
    assert (out[int(cu_q[-1]):] == 0).all()  # rows after the last sequence
    return out


# (query lengths, key lengths, H, Hk, D, extras)
PACKS = [
    ([5, 0, 1, 130, 67], [5, 0, 1, 130, 67], 2, 2, 32, dict(window_size=(-1, 0))),  # causal, empty, one token
    ([1, 33, 0, 300], [70, 20, 5, 260], 4, 2, 24, dict()),  # unequal packs; a query-only sequence; GQA
    ([129, 7, 64], [200, 7, 1], 4, 1, 16, dict(window_size=(16, 4), softcap=3.0, sinks=True)),
    ([40, 1, 90], [90, 300, 90], 2, 1, 40, dict(window_size=(-1, 0), alibi=True, sinks=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pack", PACKS, ids=lambda p: f"q{p[0]}k{p[1]}H{p[2]}Hk{p[3]}D{p[4]}{sorted(p[5])}")
def test_varlen_against_oracle(pack, dtype):
    q_lens, k_lens, H, Hk, D, extras = pack
    q, k, v, cu_q, cu_k = make_pack(q_lens, k_lens, H, Hk, D, dtype=dtype, extra_rows=3)
    kw = dict(extras)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(q_lens), H)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H)
    check_varlen(q, k, v, cu_q, cu_k, what=f"{q_lens} {k_lens}", **kw)


def test_varlen_lse_layout():
    """The log-sum-exp comes back as (H, Tq), +inf on rows of no sequence."""
    q, k, v, cu_q, cu_k = make_pack([3, 9], [4, 11], 3, 3, 16, extra_rows=2)
    out, lse = tf.varlen_attn(q, k, v, cu_q, cu_k, 9, 11, return_aux=tf.AuxRequest(lse=True), backend="cpp")
    _, ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, return_lse=True)
    assert lse.shape == (3, 14) and torch.isinf(lse[:, 12:]).all()
    assert (lse[:, :12].double() - ref_lse).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_dropout_keys_rows_by_their_lse_index(dtype):
    """Dropout keeps a probability by (seed, the row's lse index, key): a pack of one sequence has
    the lse index of the same dense problem (h * Tq + row = h * Nq + i), so both drop the same
    entries, forward and backward; a second sequence's rows are keyed by their own index."""
    H, Nq, Nk, D, p = 2, 37, 90, 16, 0.3
    q, k, v, cu_q, cu_k = make_pack([Nq], [Nk], H, H, D, dtype=dtype)
    dout = torch.randn(Nq, H, D, dtype=dtype)

    def run(fn, *inputs):
        args = [t.clone().requires_grad_() for t in inputs]
        torch.manual_seed(5)
        out = fn(*args)
        return [out] + list(torch.autograd.grad(out, args, dout if out.dim() == 3 else dout.transpose(0, 1)[None]))

    packed = run(lambda q, k, v: tf.varlen_attn(q, k, v, cu_q, cu_k, Nq, Nk, dropout_p=p, window_size=(20, 3),
                                                backend="cpp"), q, k, v)
    dense = run(lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, dropout_p=p, window_size=(20, 3),
                                                                backend="cpp"),
                *(t.transpose(0, 1)[None] for t in (q, k, v)))
    for a, b in zip(packed, dense):
        torch.testing.assert_close(a, b[0].transpose(0, 1), rtol=0, atol=0)
    # the same sequence second in a pack: other rows' keys, another dropout pattern
    q2, k2, v2, cu_q2, cu_k2 = make_pack([5, Nq], [7, Nk], H, H, D, dtype=dtype)
    q2[5:], k2[7:], v2[7:] = q, k, v
    torch.manual_seed(5)
    second = tf.varlen_attn(q2, k2, v2, cu_q2, cu_k2, Nq, Nk, dropout_p=p, window_size=(20, 3), backend="cpp")
    assert not torch.equal(second[5:], packed[0])


def test_varlen_deterministic_backward():
    q, k, v, cu_q, cu_k = make_pack([300, 5, 77], [310, 5, 200], 4, 2, 32)

    def run():
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tf.varlen_attn(*args, cu_q, cu_k, 300, 310, enable_gqa=True, window_size=(-1, 0), backend="cpp")
        out.backward(torch.ones_like(out))
        return [out] + [a.grad for a in args]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Decoding: few queries against many keys; the GQA-stacked rows and the key split
# ---------------------------------------------------------------------------------------------
# (B, H, Hk, Nq, Nk, D)
DECODE = [(2, 8, 2, 1, 1, 32), (1, 4, 1, 4, 700, 64), (3, 6, 2, 16, 129, 16), (1, 2, 1, 1, 65536, 16)]


@pytest.mark.parametrize("products", PACK_MIN_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", DECODE, ids=lambda s: "B{}H{}Hk{}q{}k{}D{}".format(*s))
def test_decode_dense(shape, dtype, products, monkeypatch):
    """Decoding through scaled_dot_product_attention (as a generate loop calls it), with key padding
    and a bottom-right window, forward and backward."""
    monkeypatch.setenv("TRANSFORMER_FAST_PACK_MIN_ROWS", PACK_MIN_ROWS[products])
    B, H, Hk, Nq, Nk, D = shape
    q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=dtype, layout="bnhd")
    pad = random_key_padding(B, Nk)
    check_dense(q, k, v, key_padding_mask=pad, grads=Nk < 1000, what="padded")
    if Nk > 1:
        check_dense(q, k, v, window_size=(Nk // 3, 0), sinks=torch.randn(H), grads=Nk < 1000, what="window")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_garbage_in_padded_keys_does_not_leak(dtype):
    """NaN and inf in padded keys and values, decoding (the stacked rows' value product skips the
    keys no row uses), including a tile whose only unpadded keys are in its middle."""
    B, H, Hk, Nq, Nk, D = 2, 6, 2, 2, 1100, 32
    q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=dtype)
    pad = torch.ones(B, Nk, dtype=torch.bool)
    pad[0, 3:700] = False
    pad[0, 1000:1010] = False
    pad[1, 600:601] = False
    check_garbage_does_not_leak(q, k, v, pad, pad[:, None, :, None], "decode, garbage in padding")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_equals_unsplit(dtype):
    """num_splits cuts each sequence's keys into parts merged by their log-sum-exp: to rounding the
    result of no split, whether parts are empty (a window) or not, and the same on every run."""
    q, k, v, cu_q, cu_k = make_pack([1, 3, 2], [1500, 2000, 37], 8, 2, 32, dtype=dtype)
    used = torch.tensor([1200, 2000, 30], dtype=torch.int32)
    sinks = torch.randn(8)
    for kw in (dict(), dict(window_size=(300, 0), sinks=sinks), dict(softcap=2.0, seqused_k=used)):
        def run(n):
            return tf.varlen_attn(q, k, v, cu_q, cu_k, 3, 2000, enable_gqa=True, num_splits=n, backend="cpp",
                                  return_aux=tf.AuxRequest(lse=True), **kw)
        whole, whole_lse = run(1)
        for n in (2, 3, 7):
            out, lse = run(n)
            torch.testing.assert_close(out, whole, rtol=0, atol=1e-6 if dtype == torch.float32 else 8e-3)
            torch.testing.assert_close(lse, whole_lse, rtol=0, atol=2e-6)
            assert torch.equal(out, run(n)[0])
        ref = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, **{
            key: val.double() if torch.is_tensor(val) and val.is_floating_point() else val for key, val in kw.items()})
        ref_lp = reference.varlen_attention(q, k, v, cu_q, cu_k, **kw)
        assert_close_to_reference(run(3)[0], ref, ref_lp, what=f"split {kw.keys()}")


def test_auto_split_and_stacked_rows_match_per_head():
    """Multi-query decoding on fewer tasks than threads is split automatically; the GQA-stacked rows
    give what the same problem gives with every query head its own key head (not stacked)."""
    torch.set_num_threads(max(2, torch.get_num_threads()))
    q, k, v = make_qkv(1, 4, 2, 3000, 32, Hk=1)
    stacked = tf.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="cpp")
    per_head = tf.scaled_dot_product_attention(q, k.expand(1, 4, 3000, 32), v.expand(1, 4, 3000, 32), backend="cpp")
    torch.testing.assert_close(stacked, per_head, rtol=0, atol=1e-6)
    ref = reference.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ref_lp = reference.scaled_dot_product_attention(q, k, v)
    assert_close_to_reference(stacked, ref, ref_lp, what="auto split")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_cache(page_size, dtype):
    """A paged cache with pages out of order and seqused_k shorter than the slot (not a multiple of
    the page size), against the oracle; with num_splits and without."""
    B, H, Hk, D, pages_per_seq = 3, 4, 2, 32, 40
    num_pages = B * pages_per_seq + 7
    k_pages = torch.randn(num_pages, page_size, Hk, D, dtype=dtype)
    v_pages = torch.randn(num_pages, page_size, Hk, D, dtype=dtype)
    table = torch.randperm(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq).int()
    used = torch.tensor([pages_per_seq * page_size - 3, 1, 77], dtype=torch.int32)
    q_lens = [1, 1, 4]
    cu_q = torch.tensor([0, 1, 2, 6], dtype=torch.int32)
    q = torch.randn(6, H, D, dtype=dtype)
    sinks = torch.randn(H)
    for n in (None, 1, 4):
        out = tf.varlen_attn(q, k_pages, v_pages, cu_q, None, max(q_lens), int(used.max()), enable_gqa=True,
                             seqused_k=used, block_table=table, num_splits=n, sinks=sinks, window_size=(-1, 0),
                             backend="cpp")
        kw = dict(seqused_k=used, block_table=table, window_size=(-1, 0))
        ref = reference.varlen_attention(q.double(), k_pages.double(), v_pages.double(), cu_q, None,
                                         sinks=sinks.double(), **kw)
        ref_lp = reference.varlen_attention(q, k_pages, v_pages, cu_q, None, sinks=sinks, **kw)
        assert_close_to_reference(out, ref, ref_lp, what=f"paged, num_splits={n}")


def test_seqused_k_shorter_than_the_slot():
    """Keys past seqused_k[b] in the slot hold NaN: they are never read."""
    q, k, v, cu_q, cu_k = make_pack([2, 1, 3], [50, 600, 9], 2, 2, 16)
    used = torch.tensor([17, 513, 0], dtype=torch.int32)
    for b in range(3):
        k[int(cu_k[b]) + int(used[b]):int(cu_k[b + 1])] = float("nan")
    out = tf.varlen_attn(q, k, v, cu_q, cu_k, 3, 600, seqused_k=used, backend="cpp")
    ref = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, seqused_k=used)
    ref_lp = reference.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=used)
    assert_close_to_reference(out, ref, ref_lp, what="seqused_k")
    assert (out[3:] == 0).all()  # the sequence that uses no key


# ---------------------------------------------------------------------------------------------
# Index values the kernels read: checked by the CPU entry points, ValueError naming the argument
# ---------------------------------------------------------------------------------------------
def test_bad_index_values_are_rejected():
    q, k, v, cu_q, cu_k = make_pack([3, 4], [5, 6], 2, 2, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def call(cu_q=cu_q, cu_k=cu_k, max_q=4, max_k=6, **kw):
        return tf.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, backend="cpp", **kw)

    call()
    for kw, match in [
        (dict(cu_q=i32(1, 3, 7)), r"cu_seq_q must start at 0, got cu_seq_q\[0\] = 1"),
        (dict(cu_q=i32(0, 5, 3)), r"cu_seq_q must be nondecreasing, got cu_seq_q\[2\] = 3 < cu_seq_q\[1\] = 5"),
        (dict(cu_q=i32(0, 3, 8)), r"cu_seq_q must end within the 7 rows of q, got cu_seq_q\[2\] = 8"),
        (dict(cu_k=i32(0, 6, 5)), r"cu_seq_k must be nondecreasing"),
        (dict(cu_k=i32(0, 5, 12)), r"cu_seq_k must end within the 11 rows of k, got cu_seq_k\[2\] = 12"),
        (dict(seqused_k=i32(5, 7)), r"seqused_k\[1\] must be in \[0, 6\] \(its cu_seq_k range\), got 7"),
        (dict(seqused_k=i32(-1, 2)), r"seqused_k\[0\] must be in \[0, 5\]"),
        (dict(max_q=3), r"max_q must be at least the longest query sequence \(4\), got 3"),
        (dict(max_k=5), r"max_k must be at least the longest key sequence \(6\), got 5"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**kw)
    pages_k, pages_v = torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)
    for table, used, match in [
        (i32(0, 1, 2, 4).view(2, 2), i32(4, 4), r"block_table entries must name pages in \[0, 4\), got "
                                                r"block_table\[1, 1\] = 4"),
        (i32(0, -1, 2, 3).view(2, 2), i32(4, 4), r"block_table\[0, 1\] = -1"),
        (i32(0, 1, 2, 3).view(2, 2), i32(4, 5), r"seqused_k\[1\] must be in \[0, 4\] \(the keys of its block_table"),
    ]:
        with pytest.raises(ValueError, match=match):
            tf.varlen_attn(q, pages_k, pages_v, cu_q, None, 4, 5, seqused_k=used, block_table=table, backend="cpp")


# ---------------------------------------------------------------------------------------------
# bf16/fp16 tile products: the CPU's own, or fp32 on converted copies
# ---------------------------------------------------------------------------------------------
_OTHER_PRODUCTS_SCRIPT = """
import sys, torch
import transformer_fast as tf
from attention_cases import check_attention, make_qkv, random_key_padding
expected = sys.argv[1] == "native"
assert tf._C.native_lowp_products(torch.bfloat16) == expected == tf._C.native_lowp_products(torch.float16)
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    for B, H, Hk, Nq, Nk, D, Dv, causal in [(2, 3, 3, 70, 150, 40, 24, True), (2, 4, 2, 33, 200, 64, 64, False),
                                          (1, 2, 2, 300, 300, 32, 32, False)]:
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype, layout="bnhd")
        check_attention("cpp", q, k, v, is_causal=causal, key_padding_mask=random_key_padding(B, Nk))
print("checked")
"""


def test_low_precision_products_the_other_way():
    """bf16/fp16 tiles are multiplied by the CPU's own products of that dtype where it has them
    (AVX512-BF16, AMX; AVX512-FP16), else in fp32 on copies converted per product (cpu_blas.h).
    The tests in this process take this CPU's way; TRANSFORMER_FAST_LOWP_GEMM (read once per process)
    forces the other in a subprocess: outputs and q, k, v gradients against the float64 reference."""
    import subprocess
    import sys
    other = "float" if tf._C.native_lowp_products(torch.bfloat16) else "native"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _OTHER_PRODUCTS_SCRIPT, other], cwd=tests_dir, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRANSFORMER_FAST_LOWP_GEMM": other})
    assert proc.returncode == 0 and proc.stdout.strip() == "checked", proc.stdout[-2000:] + proc.stderr[-3000:]
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16"):
        tf._C.native_lowp_products(torch.float32)
