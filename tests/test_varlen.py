"""``varlen_attn``: packed variable-length sequences, ``seqused_k``, paged caches and decoding on
every backend, against the float64 reference (one dense attention per sequence), outputs and
gradients. The Triton kernels run under the interpreter on small packs."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import reference

from helpers import BACKENDS, LOW_PRECISION, assert_close_to_reference
from helpers import kernel_device as _device, need_backend, skip_unavailable_backend  # noqa: F401 (a fixture)
from varlen_cases import check_varlen, make_pack, offsets, paged

pytestmark = pytest.mark.usefixtures("skip_unavailable_backend")
ops = torch.ops.transformer_fast


PACKS = [
    ([0, 1, 17, 5, 40, 33], None),   # empty, one-token and non-tile-multiple sequences
    ([3, 1, 0, 17], [10, 1, 5, 40]),  # fewer queries than keys (bottom-right alignment), an empty query set
    ([20, 6], [4, 6]),               # more queries than keys: early rows see nothing when causal
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pack", PACKS, ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (2, 3)], ids=str)
def test_packs_and_windows(backend, pack, window):
    q_lens, k_lens = pack
    dtypes = (torch.float32,) if window in ((-1, -1), (2, 3)) else (torch.float32, LOW_PRECISION[backend])
    for dtype in dtypes:
        q, k, v, cu_q, cu_k = make_pack(q_lens, k_lens or q_lens, dtype=dtype)
        check_varlen(backend, q, k, v, cu_q, cu_k, window_size=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_softcap_alibi_sinks(backend):
    dtype = LOW_PRECISION[backend]
    q, k, v, cu_q, cu_k = make_pack([9, 0, 24], [9, 3, 30], H=4, Hk=2, D=24, Dv=8, dtype=dtype)
    check_varlen(backend, q, k, v, cu_q, cu_k, window_size=(-1, 0), softcap=4.0,
                 alibi_slopes=torch.rand(3, 4, device=_device()), sinks=torch.randn(4, device=_device()).to(dtype),
                 scale=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_sum_exp(backend):
    q, k, v, cu_q, cu_k = make_pack([5, 0, 17], [5, 4, 1])
    sinks = torch.randn(2, device=_device())
    out, lse = tf.varlen_attn(q, k, v, cu_q, cu_k, 17, 5, return_aux=tf.AuxRequest(lse=True), window_size=(-1, 0),
                              sinks=sinks, backend=backend)
    ref_out, ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                  window_size=(-1, 0), sinks=sinks.double(), return_lse=True)
    assert lse.shape == (2, 22) and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max() < 1e-5 and (out.double() - ref_out).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_seqused_k_shorter_than_the_slot(backend):
    q, k, v, cu_q, cu_k = make_pack([1, 4, 2], [12, 20, 7], dtype=LOW_PRECISION[backend])
    used = torch.tensor([5, 20, 0], dtype=torch.int32, device=_device())
    with torch.no_grad():
        check_varlen(backend, q, k, v, cu_q, cu_k, seqused_k=used, window_size=(-1, 0), grads=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [5, 16])
def test_paged_cache_with_pages_out_of_order(backend, page_size):
    k, v, table, used = paged([23, 1, 40], page_size, dtype=LOW_PRECISION[backend])
    for q_lens in ([1, 1, 1], [3, 1, 7]):  # decoding, and a chunk of new queries over the cache
        q = torch.randn(sum(q_lens), 2, 16, dtype=LOW_PRECISION[backend], device=_device())
        with torch.no_grad():
            check_varlen(backend, q, k, v, offsets(q_lens), None, seqused_k=used, block_table=table,
                         window_size=(-1, 0), grads=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_cache_does_not_read_cu_seq_k(backend):
    """With a block table the keys' lengths are seqused_k's (as in torch and FlashAttention): a
    cu_seq_k, which cannot describe a pool of pages, is not read on any backend."""
    k, v, table, used = paged([23, 1, 40], 8, dtype=LOW_PRECISION[backend])
    q = torch.randn(3, 2, 16, dtype=k.dtype, device=_device())
    with torch.no_grad():
        outs = [tf.varlen_attn(q, k, v, offsets([1, 1, 1]), cu_k, 1, 40, seqused_k=used, block_table=table,
                               backend=backend)
                for cu_k in (None, offsets([23, 1, 40]), offsets([0, 0, 0]))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_with_and_without_splits(backend):
    """One query per sequence against long caches: the key split (forced with num_splits) gives the
    unsplit result to rounding, and both match the reference."""
    long = 300 if backend == "triton" else 5000
    q, k, v, cu_q, cu_k = make_pack([1, 1, 1], [long, 1, 77], H=8, Hk=2, D=32)
    outs = []
    with torch.no_grad():
        for splits in (1, 3, None):
            outs.append(check_varlen(backend, q, k, v, cu_q, cu_k, num_splits=splits, grads=False))
    assert (outs[0] - outs[1]).abs().max() < 1e-5 and (outs[0] - outs[2]).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_forward_and_backward_agree(backend):
    """With values one-hot per key, the output is each row's dropped-out probabilities; the
    gradients must be those of attention with exactly that dropout mask."""
    q_lens = [5, 0, 9]
    q, _, _, cu_q, cu_k = make_pack(q_lens, q_lens, D=8)
    k = torch.randn(14, 2, 8, device=_device())
    v = torch.zeros(14, 2, 14, device=_device())
    v[torch.arange(14), :, torch.arange(14)] = 1.0  # key j's value is the j-th unit vector
    q.requires_grad_()
    torch.manual_seed(5)
    out = tf.varlen_attn(q, k, v, cu_q, cu_k, 9, 9, window_size=(-1, 0), dropout_p=0.4, backend=backend)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if rows.start == rows.stop:
            continue
        qb, kb, vb = (t[rows].detach().double().transpose(0, 1)[None].requires_grad_(i == 0)
                      for i, t in enumerate((q, k, v)))
        kept = out[rows, :, rows].transpose(0, 1)[None] != 0  # (1, H, n, n): the keys kept for each row
        ref = reference.scaled_dot_product_attention(qb, kb, vb[..., rows], window_size=(-1, 0), dropout_mask=kept,
                                                     dropout_p=0.4)
        assert (out[rows].transpose(0, 1)[None, ..., rows].double() - ref).abs().max() < 1e-5
        ref_dq = torch.autograd.grad(ref, qb, dout[rows, :, rows].transpose(0, 1)[None].double())[0]
        assert (dq[rows].transpose(0, 1)[None].double() - ref_dq).abs().max() < 1e-4


def _strided(t):
    """t's values in a view with strides twice t's along every dim (not contiguous)."""
    big = torch.full([2 * n for n in t.shape], -7, dtype=t.dtype, device=t.device)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_tensors_with_any_strides(backend):
    """cu_seq_q, cu_seq_k, seqused_k and block_table as strided views (values -7 between theirs)
    give the contiguous tensors' results, outputs and gradients: the Triton kernels read them at
    unit stride and once took the views' gaps for offsets (output off by 3.4)."""
    q, k, v, cu_q, cu_k = make_pack([5, 0, 9], [7, 3, 9])
    inputs = [t.requires_grad_() for t in (q, k, v)]
    runs = []
    for strided in (False, True):
        idx = (_strided(cu_q), _strided(cu_k)) if strided else (cu_q, cu_k)
        out = tf.varlen_attn(*inputs, *idx, 9, 9, window_size=(-1, 0), backend=backend)
        runs.append((out, *torch.autograd.grad(out, inputs, torch.ones_like(out))))
    assert not _strided(cu_q).is_contiguous()
    for plain, strided in zip(*runs):
        assert torch.equal(plain, strided)
    kp, vp, table, used = paged([23, 1, 40], 8)
    qd = torch.randn(3, 2, 16, device=_device())
    with torch.no_grad():
        outs = [tf.varlen_attn(qd, kp, vp, offsets([1, 1, 1]), None, 1, 40, seqused_k=u, block_table=t,
                               backend=backend)
                for u, t in ((used, table), (_strided(used), _strided(table)), (used, table.t().contiguous().t()))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    check_varlen(backend, qd, kp, vp, offsets([1, 1, 1]), None, seqused_k=_strided(used), block_table=_strided(table),
                 grads=False)


@pytest.mark.triton
def test_triton_op_reads_index_tensors_and_sinks_of_any_strides():
    """The Triton launchers copy what their kernels read at unit stride (the index tensors and the
    sinks) where a view has other strides; varlen_attn passes its arguments as they come, and the
    sinks reach the op contiguous, so the op is called directly here: forward and backward."""
    need_backend("triton")
    from transformer_fast._attention_call import AttentionBackwardCall, AttentionForwardCall
    from transformer_fast.kernels import attention as triton_attention
    q, k, v, cu_q, cu_k = make_pack([3, 0, 4], [3, 2, 4])
    sinks = torch.randn(2, device=_device())
    runs = []
    for prepare in (lambda t: t, _strided):
        out, lse = triton_attention.attention_forward(AttentionForwardCall(
            q, k, v, None, None, False, 0.25, 0.0, None, window=(-1, 0), sinks=prepare(sinks), cu_seq_q=prepare(cu_q),
            cu_seq_k=prepare(cu_k), max_q=4, max_k=4))
        grads = triton_attention.attention_backward(AttentionBackwardCall(
            torch.ones_like(out), q, k, v, out, lse, None, None, False, 0.25, 0.0, None, False, window=(-1, 0),
            cu_seq_q=prepare(cu_q), cu_seq_k=prepare(cu_k), max_q=4, max_k=4))
        runs.append((out, lse, *grads[:3]))
    for plain, strided in zip(*runs):
        assert torch.equal(plain, strided)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("case", ["unsorted", "too_long", "max_q", "seqused", "block_table"])
def test_bad_offsets_are_refused(backend, case):
    """Values inside the index tensors are checked by the CPU kernels that read them."""
    q, k, v, cu_q, cu_k = make_pack([3, 4], [3, 4])
    kwargs, max_q = {}, 4
    if case == "unsorted":
        cu_q = torch.tensor([0, 5, 3], dtype=torch.int32)
    elif case == "too_long":
        cu_k = torch.tensor([0, 3, 9], dtype=torch.int32)
    elif case == "max_q":
        max_q = 3
    elif case == "seqused":
        kwargs = dict(seqused_k=torch.tensor([4, 1], dtype=torch.int32))
    else:
        kp, vp, table, used = paged([3, 4], 4)
        table[1, 0] = kp.shape[0]
        k, v, cu_k, kwargs = kp, vp, None, dict(block_table=table, seqused_k=used)
    with pytest.raises(ValueError, match="cu_seq_q|cu_seq_k|max_q|seqused_k|block_table"):
        tf.varlen_attn(q, k, v, cu_q, cu_k, max_q, 4, backend=backend, **kwargs)


@pytest.mark.parametrize("change,error,words", [
    (dict(cu_seq_q=torch.tensor([0, 3, 7])), TypeError, "cu_seq_q must be an int32"),
    (dict(cu_seq_k=torch.tensor([0, 3], dtype=torch.int32)), ValueError, "cu_seq_k"),
    (dict(cu_seq_k=None), ValueError, "cu_seq_k may be None only"),
    (dict(query=torch.randn(2, 7, 2, 16)), ValueError, "query must have 3"),
    (dict(key=torch.randn(7, 3, 16)), ValueError, "heads"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "key must have 4"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(max_q=2.0), TypeError, "max_q"),
    (dict(max_q=2**64), ValueError, "max_q must fit in int64"),
    (dict(max_k=2**63), ValueError, "max_k must fit in int64"),
    (dict(num_splits=-2**70), ValueError, "num_splits must fit in int64"),
    (dict(window_size=(0, 2**64)), ValueError, "window_size entries must fit in int64"),
    (dict(window_size=(-3, 0)), ValueError, "window_size"),
    (dict(seqused_k=torch.tensor([1, 2])), TypeError, "seqused_k must be an int32"),
    (dict(return_aux=True), TypeError, "return_aux must be an AuxRequest or None, got bool"),
])
def test_bad_arguments_are_refused(change, error, words):
    q, k, v, cu_q, cu_k = make_pack([3, 4], [3, 4])
    args = dict(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=4, max_k=4)
    args.update(change)
    with pytest.raises(error, match=words):
        tf.varlen_attn(**args)


def test_inference_only_arguments_refuse_gradients():
    q, k, v, cu_q, cu_k = make_pack([3, 4], [3, 4])
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="inference-only"):
        tf.varlen_attn(q, k, v, cu_q, cu_k, 4, 4, seqused_k=torch.tensor([2, 4], dtype=torch.int32))


def test_float64_gradcheck():
    q, k, v, cu_q, cu_k = (t.double() if t.is_floating_point() else t for t in make_pack([2, 0, 3], [3, 1, 3], D=4))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def attention(q, k, v, sinks):
        return tf.varlen_attn(q, k, v, cu_q, cu_k, 3, 3, window_size=(1, 0), softcap=3.0, sinks=sinks)
    inputs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), sinks)
    assert torch.autograd.gradcheck(attention, inputs)


@pytest.mark.parametrize("backend", ["cpp"])
def test_opcheck_packed(backend):
    q, k, v, cu_q, cu_k = make_pack([3, 0, 5], [4, 2, 5])
    args = (q, k, v, None, None, False, 0.25, 0.0, None, [2, 1], 3.0, torch.rand(3, 2), torch.randn(2), cu_q, cu_k,
            None, None, 5, 5, 0)
    torch.library.opcheck(ops.attention_forward.default, args)


def test_matches_dense_attention_on_equal_lengths():
    """A pack of equal-length sequences is the dense batch: same result as scaled_dot_product_attention."""
    q, k, v, cu_q, cu_k = make_pack([7, 7, 7], [9, 9, 9], H=4, Hk=2)
    out = tf.varlen_attn(q, k, v, cu_q, cu_k, 7, 9, window_size=(3, 0), enable_gqa=True)
    dense = tf.scaled_dot_product_attention(*(t.view(3, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)),
                                            window_size=(3, 0), enable_gqa=True)
    assert_close_to_reference(out, dense.transpose(1, 2).reshape(21, 4, 16).double(),
                              dense.transpose(1, 2).reshape(21, 4, 16), factor=1.0, atol=1e-6)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("q_offsets", [[0, 3, 7], [0]], ids=str)
def test_transforms_keep_the_rows_after_the_last_sequence(q_offsets, with_sinks):
    """Under jvp, forward AD, vmap, torch.func.grad and create_graph=True (the differentiable
    form), packed rows after the last sequence come out as eagerly: out 0 (0 tangent, 0 gradient),
    lse the sink or +inf. The eager result is float64 plain torch, itself checked above."""
    from torch.func import grad, jvp, vmap
    import torch.autograd.forward_ad as fwAD
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for n in (9, 11, 11))
    cu_q = torch.tensor(q_offsets, dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9][:len(q_offsets)], dtype=torch.int32)
    sinks = torch.randn(2, generator=g, dtype=torch.float64) if with_sinks else None
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    tail = slice(q_offsets[-1], None)

    def attention(q, k, v):
        return tf.varlen_attn(q, k, v, cu_q, cu_k, 4, 5, return_aux=tf.AuxRequest(lse=True), sinks=sinks)

    def reference_loss(q, k, v):  # the reference returns the sequences' rows only
        return reference.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks).square().sum()

    out, lse = attention(q, k, v)
    assert out.shape == (9, 2, 8) and not out[tail].any()
    expected_lse = sinks[:, None] if with_sinks else torch.full((2, 1), torch.inf)
    assert torch.equal(lse[:, tail], expected_lse.expand(2, 9 - q_offsets[-1]))

    (out_j, lse_j), (tangent, _) = jvp(attention, (q, k, v), tangents)
    torch.testing.assert_close(out_j, out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_j, lse, atol=1e-12, rtol=0)
    assert not tangent[tail].any()
    if q_offsets[-1]:
        expected = jvp(lambda *a: reference.varlen_attention(*a, cu_q, cu_k, sinks=sinks), (q, k, v), tangents)[1]
        torch.testing.assert_close(tangent[:q_offsets[-1]], expected, atol=1e-10, rtol=0)
    with fwAD.dual_level():
        dual_out = attention(*(fwAD.make_dual(t, d) for t, d in zip((q, k, v), tangents)))[0]
        dual_tangent = fwAD.unpack_dual(dual_out).tangent  # None: no sequence, the output depends on nothing
        torch.testing.assert_close(torch.zeros_like(tangent) if dual_tangent is None else dual_tangent, tangent,
                                   atol=1e-12, rtol=0)

    batched_out, batched_lse = vmap(attention, in_dims=(0, None, None))(torch.stack([q, 2 * q]), k, v)
    torch.testing.assert_close(batched_out[0], out, atol=1e-12, rtol=0)
    torch.testing.assert_close(batched_lse[0], lse, atol=1e-12, rtol=0)
    torch.testing.assert_close(batched_out[1], attention(2 * q, k, v)[0], atol=1e-12, rtol=0)

    def loss(q, k, v):
        return attention(q, k, v)[0].square().sum()
    grads = grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    firsts = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    if not q_offsets[-1]:  # no sequence: the loss is a constant 0
        assert not any(f.any() for f in firsts) and not any(f.any() for f in grads)
        return
    seconds = torch.autograd.grad(sum(f.sum() for f in firsts), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_firsts = torch.autograd.grad(reference_loss(*ref_leaves), ref_leaves, create_graph=True, allow_unused=True,
                                     materialize_grads=True)
    ref_seconds = torch.autograd.grad(sum(f.sum() for f in ref_firsts), ref_leaves, allow_unused=True,
                                      materialize_grads=True)
    for got, first, second, ref_first, ref_second in zip(grads, firsts, seconds, ref_firsts, ref_seconds):
        torch.testing.assert_close(got, ref_first, atol=1e-10, rtol=0)
        torch.testing.assert_close(first, ref_first, atol=1e-10, rtol=0)
        torch.testing.assert_close(second, ref_second, atol=1e-9, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_after_the_last_sequence(backend):
    """Packed rows of no sequence are rows with no allowed key: out 0, lse the sink (or +inf),
    with and without sinks, on every backend; their gradients are 0 and the sinks' gradient
    takes nothing from them."""
    q, k, v, cu_q, cu_k = make_pack([3, 4], [5, 2], D=8)
    q, k, v = (torch.cat([t, torch.randn(n, 2, 8, device=_device())]) for t, n in ((q, 2), (k, 1), (v, 1)))
    for sinks in (None, torch.tensor([0.5, -1.25], device=_device())):
        inputs = [t.clone().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
        extra = {} if sinks is None else {"sinks": inputs[3]}
        out, lse = tf.varlen_attn(*inputs[:3], cu_q, cu_k, 4, 5, return_aux=tf.AuxRequest(lse=True), backend=backend,
                                  **extra)
        assert out.shape == (9, 2, 8) and not out[7:].any()
        expected = torch.full((2, 2), torch.inf, device=_device()) if sinks is None else sinks[:, None].expand(2, 2)
        assert torch.equal(lse[:, 7:], expected), (backend, lse[:, 7:])
        out.square().sum().backward()
        assert not inputs[0].grad[7:].any() and not inputs[1].grad[7:].any() and not inputs[2].grad[7:].any()
        if sinks is not None:
            sinks64 = sinks.double().requires_grad_()
            reference.varlen_attention(*(t.detach().double() for t in inputs[:3]), cu_q, cu_k,
                                       sinks=sinks64).square().sum().backward()
            assert (inputs[3].grad.double() - sinks64.grad).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_lengths_beyond_the_pack(backend):
    """max_q and max_k are bounds: values past what the pack holds give the result of the exact
    ones, forward and backward. (The Triton launcher sized its grid by them: 2**40 overflowed the
    interpreter's int32 grid, and its run time grew with the value.)"""
    q, k, v, cu_q, cu_k = make_pack([3, 5], [4, 6], D=8)
    results = []
    for max_q, max_k in ((5, 6), (50_000, 50_000), (2**40, 2**40)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tf.varlen_attn(*inputs, cu_q, cu_k, max_q, max_k, window_size=(2, 0), backend=backend)
        out.square().sum().backward()
        results.append((out, *(t.grad for t in inputs)))
    for other in results[1:]:
        for got, expected in zip(other, results[0]):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
