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


def _rows_p_dp(q, k, v, dout, sinks, scale, softcap=None, key_padding_mask=None, window=None):
    """sum_j P_ij dP_ij per row in float64 (dense (B, H, N, D) inputs; P from the float64 scores
    and their log-sum-exp with the sinks, no dropout), sum_j |P_ij dP_ij| (the scale of its
    rounding), and the rows' log-sum-exp."""
    B, H, Nq, _ = q.shape
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    k, v = (t.repeat_interleave(H // k.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-2, -1) * scale
    s = s if softcap is None else softcap * torch.tanh(s / softcap)
    s = s + reference.attention_bias(Nq, k.shape[2], batch=B, heads=H, key_padding_mask=key_padding_mask,
                                     window_size=window, dtype=torch.float64, device=q.device)
    lse = torch.logsumexp(torch.cat([s, sinks.double()[None, :, None, None].expand(B, H, Nq, 1)], -1), -1)
    p_dp = torch.exp(s - lse[..., None]) * (dout @ v.transpose(-2, -1))
    return p_dp.sum(-1), p_dp.abs().sum(-1), lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_backward_delta_is_the_rows_sum_of_p_dp(backend, packed):
    """The backward op's delta (compute_delta), from which the sinks' gradient is formed, is
    sum_j P_ij dP_ij to float32 accuracy: the kernels sum it from their fp32 P and dP. dO . O, its
    value in exact arithmetic, misses it by O's rounding to the query's dtype (asserted, so the
    check can fail), and the sinks' gradient would add that up over every row."""
    from transformer_fast._device_kernels import op_kernel

    dtype, device = LOW_PRECISION[backend], _device()
    torch.manual_seed(0)
    H, Hk, D, window, softcap = 4, 2, 24, (6, 0), 5.0
    scale = D ** -0.5
    sinks = torch.randn(H, device=device) * 2
    forward, backward = (op_kernel(f"attention_{x}", backend, device) for x in ("forward", "backward"))
    if packed:
        lengths_q, lengths_k = [5, 0, 12], [9, 3, 20]
        q, k, v = (torch.randn(sum(n), h, D, device=device).to(dtype)
                   for n, h in ((lengths_q, H), (lengths_k, Hk), (lengths_k, Hk)))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                      for n in (lengths_q, lengths_k))
        shape = (window, softcap, None)
        seqs = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max(lengths_q), max_k=max(lengths_k))
        out, lse = forward(q, k, v, None, None, False, scale, 0.0, None, *shape, sinks, **seqs)
        dout = torch.randn_like(out)
        *_, delta = backward(dout, q, k, v, out, lse, None, None, False, scale, 0.0, None, False, *shape, **seqs,
                             compute_delta=True)
        expected, magnitude = (torch.zeros(H, q.shape[0], dtype=torch.float64, device=device) for _ in range(2))
        for b in range(len(lengths_q)):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            rows = _rows_p_dp(*(t[r].transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq))),
                              sinks, scale, softcap, window=window)
            expected[:, rq], magnitude[:, rq] = rows[0][0], rows[1][0]
        o_delta = (dout.double() * out.double()).sum(-1).t()
    else:
        q, k, v = make_qkv(2, H, 17, 40, D, Hk=Hk, dtype=dtype, device=device)
        pad = random_key_padding(2, 40, device=device)
        out, lse = forward(q, k, v, None, pad, False, scale, 0.0, None, window, softcap, None, sinks)
        dout = torch.randn_like(out)
        *_, delta = backward(dout, q, k, v, out, lse, None, pad, False, scale, 0.0, None, False, window, softcap,
                             compute_delta=True)
        expected, magnitude, _ = _rows_p_dp(q, k, v, dout, sinks, scale, softcap, key_padding_mask=pad,
                                            window=window)
        o_delta = (dout.double() * out.double()).sum(-1)
    assert delta.shape == lse.shape and delta.dtype == lse.dtype
    assert ((delta.double() - expected).abs() <= 1e-4 * magnitude).all()
    if dtype != torch.float32:  # dO . O fails the same bound
        assert ((o_delta - expected).abs() > 1e-4 * magnitude).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_gradient_with_dropout(backend):
    """With dropout, the rows' sum of P * dP takes dP through the forward's keep mask, as O is made:
    in float32 the sinks' gradient is -sum_i P_sink,i dO_i . O_i (equal in exact arithmetic) with
    the O that call produced, and far from the sum without the keep mask."""
    device = _device()
    q, k, v = make_qkv(2, 4, 17, 40, 16, Hk=2, device=device)
    sinks = torch.randn(4, device=device, requires_grad=True)
    out = tf.scaled_dot_product_attention(q, k, v, dropout_p=0.3, sinks=sinks, enable_gqa=True, backend=backend)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, sinks, dout)
    p_dp, _, lse = _rows_p_dp(q, k, v, dout, sinks.detach(), 16 ** -0.5)
    p_sink = torch.exp(sinks.double()[None, :, None] - lse)
    expected = -(p_sink * (dout.double() * out.double()).sum(-1)).sum((0, 2))
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-5)
    without_keep_mask = -(p_sink * p_dp).sum((0, 2))
    assert (without_keep_mask - expected).abs().max() > 100 * (grad.double() - expected).abs().max()


def test_sinks_gradient_in_the_sinks_dtype():
    q, k, v = make_qkv(1, 2, 5, 7, 8, dtype=torch.bfloat16)
    sinks = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    tf.scaled_dot_product_attention(q, k, v, sinks=sinks).float().sum().backward()
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (2,)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(window_size=(2.5, 0)), TypeError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(2**64, 0)), ValueError, "window_size entries must fit in int64"),
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_arguments_beyond_float32_range(backend):
    """The kernels compute in float32 (float64 inputs aside), where a value beyond float32's range
    is inf (NaN outputs before). A scale or float64 ALiBi slopes beyond it are refused, naming
    the argument; a softcap at or above 2^127 caps nothing (softcap * tanh(s / softcap) = s to
    float32 precision); a float64 sink beyond it is a +-inf sink: -inf joins no row, +inf takes
    every row of its head (out 0, lse +inf, 0 gradients, its own gradient 0). Against float64."""
    from helpers import assert_close_to_reference
    q, k, v = make_qkv(1, 2, 5, 7, 8, device=_device())
    with pytest.raises(ValueError, match="scale must be within float32's range"):
        tf.scaled_dot_product_attention(q, k, v, scale=-1e39, backend=backend)
    for slope in (1e39, -1e39):
        slopes = torch.tensor([0.5, slope], dtype=torch.float64, device=_device())
        with pytest.raises(ValueError, match="alibi_slopes must be within float32's range"):
            tf.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, backend=backend)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    for softcap in (1e39, 2.0**127):
        out = tf.scaled_dot_product_attention(q, k, v, softcap=softcap, backend=backend)
        expected = reference.scaled_dot_product_attention(q64, k64, v64, softcap=softcap)
        assert_close_to_reference(out, expected, reference.scaled_dot_product_attention(q, k, v),
                                  what=f"softcap {softcap:g}")
    for sink in (1e39, float("inf"), -1e39):
        sinks = torch.tensor([sink, 0.3], dtype=torch.float64, device=_device(), requires_grad=True)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tf.scaled_dot_product_attention(*inputs, sinks=sinks, backend=backend)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, [*inputs, sinks], dout)
        inputs64 = [t.clone().requires_grad_() for t in (q64, k64, v64)]
        sinks64 = torch.tensor([1e39 if sink > 0 else -1e39, 0.3], dtype=torch.float64, requires_grad=True)
        out64 = reference.scaled_dot_product_attention(*inputs64, sinks=sinks64.to(_device()))
        grads64 = torch.autograd.grad(out64, [*inputs64, sinks64], dout.double())
        # the float32 reference with a finite sink on head 0: its head 1 is head 1's reference
        inputs32 = [t.clone().requires_grad_() for t in (q, k, v)]
        out32 = reference.scaled_dot_product_attention(*inputs32, sinks=torch.tensor([0.0, 0.3], device=_device()))
        grads32 = torch.autograd.grad(out32, inputs32, dout)
        if sink > 0:
            assert not out[:, 0].any() and not any(g[:, 0].any() for g in grads[:3]) and grads[3][0] == 0, sink
        else:
            assert_close_to_reference(out[:, 0], out64[:, 0], reference.scaled_dot_product_attention(q, k, v)[:, 0])
        assert_close_to_reference(out[:, 1], out64[:, 1], out32[:, 1], what=f"sink {sink:g} output")
        for name, g, g64, g32 in zip("qkv", grads, grads64, grads32):
            assert_close_to_reference(g[:, 1], g64[:, 1], g32[:, 1], what=f"sink {sink:g} d{name}")
        assert abs(float(grads[3][1]) - float(grads64[3][1])) < 1e-5
        packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # one sequence; lse through varlen_attn
        cu = torch.tensor([0, 5], dtype=torch.int32, device=_device())
        for splits in (1, 3):
            out, lse = tf.varlen_attn(*packed, cu, torch.tensor([0, 7], dtype=torch.int32, device=_device()), 5, 7,
                                      sinks=sinks.detach(), num_splits=splits, return_aux=tf.AuxRequest(lse=True),
                                      backend=backend)
            if sink > 0:
                assert not out[:, 0].any() and torch.equal(lse[0], torch.full_like(lse[0], torch.inf)), (sink, splits)
            assert torch.isfinite(lse[1]).all() and torch.isfinite(out).all()


def test_infinite_sink_under_second_derivatives():
    """The differentiable form (create_graph=True, torch.func) with a +inf sink: its head's rows are
    0 with 0 gradients, as the kernels give (inf - inf made them NaN); the other head's gradients
    are the first-order ones."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 5, 7, 8))
    sinks = torch.tensor([float("inf"), 0.3], requires_grad=True)
    out = tf.scaled_dot_product_attention(q, k, v, sinks=sinks)
    firsts = torch.autograd.grad(out.square().sum(), (q, k, v, sinks), create_graph=True)
    plain = torch.autograd.grad(tf.scaled_dot_product_attention(q, k, v, sinks=sinks).square().sum(), (q, k, v, sinks))
    for first, expected in zip(firsts, plain):
        assert torch.isfinite(first).all()
        torch.testing.assert_close(first.detach(), expected, atol=1e-5, rtol=1e-5)
    assert firsts[3][0] == 0 and not firsts[0][:, 0].any()
    seconds = torch.autograd.grad(sum(f.sum() for f in firsts), (q, k, v, sinks))
    assert all(torch.isfinite(s).all() for s in seconds) and seconds[3][0] == 0
