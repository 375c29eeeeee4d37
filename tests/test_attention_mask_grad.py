"""The gradient of a float attn_mask (a learned position bias, such as T5's relative_attention_bias):
the score gradient dS, which the backward kernels write out (compute_dmask=True), dropout included,
and autograd sums over the mask's broadcast dims. Checked against the float64 reference on the CPU
backends (Triton under the interpreter, with tiny shapes); with dropout, against the reference given
the kernels' own keep mask; end to end on a tiny T5. The CUDA kernels' dS is checked in
test_attention_cuda_emulated.py."""
import functools

import pytest
import torch

import transformer_fast as tf
from transformer_fast import attention as attention_module
from transformer_fast import reference

from attention_cases import (check_float32_mask, kernel_attention_backward, kernel_attention_forward, make_qkv,
                             random_attn_mask, random_key_padding)
from helpers import ATOL, assert_close_to_reference, compare_with_reference, need_backend

# (backend, dtype, C++ product path: see test_attention.py's PACK_MIN_ROWS)
PACK_MIN_ROWS = {"packed": "0", "unpacked": "1000000000"}
BACKEND_PARAMS = [
    pytest.param("reference", torch.float32, None, id="reference-float32"),
    *(pytest.param("cpp", d, path, id=f"cpp-{str(d)[6:]}-{path}")
      for d in (torch.float32, torch.bfloat16) for path in PACK_MIN_ROWS),
    pytest.param("cpp", torch.float16, None, id="cpp-float16"),
    pytest.param("triton", torch.float32, None, id="triton-float32"),
    # (bf16 tiles are wrong under the Triton interpreter, which computes with numpy: fp16 instead)
    pytest.param("triton", torch.float16, None, id="triton-float16"),
]


@pytest.fixture(autouse=True)
def _products(request, monkeypatch):
    path = request.node.callspec.params.get("path") if hasattr(request.node, "callspec") else None
    if path is not None:
        monkeypatch.setenv("TRANSFORMER_FAST_PACK_MIN_ROWS", PACK_MIN_ROWS[path])


def _mask_shape(spec, B, H, Nq, Nk):
    return {"B,H": (B, H, Nq, Nk), "1,1": (1, 1, Nq, Nk), "B,1": (B, 1, Nq, Nk), "H": (H, Nq, Nk),
            "2-D": (Nq, Nk), "keys": (B, 1, 1, Nk)}[spec]


def _bias(shape, dtype):
    """A float mask with some -inf, and (given 3 query rows or more) one query row all -inf: a row
    with no allowed key."""
    mask = random_attn_mask(shape, "float", dtype=dtype)
    if shape[-2] >= 3:
        mask[..., 2, :] = float("-inf")
    return mask


# (mask shape, is_causal, key padding with a fully padded sequence, B, H, Hk, Nq, Nk, D, Dv)
CASES = [
    ("1,1", True, True, 2, 4, 2, 17, 40, 24, 24),  # GQA; causal skips key tiles: their dS must be 0
    ("B,1", False, True, 2, 2, 1, 33, 17, 40, 20),  # multi-query, Nq > Nk
    ("H", True, True, 2, 4, 2, 17, 40, 24, 24),  # per-head bias (T5 style)
    ("B,H", False, False, 2, 4, 4, 17, 40, 24, 24),
    ("2-D", True, True, 2, 4, 4, 17, 40, 24, 24),
    ("keys", False, True, 2, 4, 1, 17, 40, 24, 24),  # per-key bias
    ("H", True, False, 1, 3, 3, 1, 1, 16, 16),
    ("H", False, True, 2, 2, 2, 9, 70, 17, 24),  # odd head dim, keys over three Triton tiles
]
TRITON_CASES = CASES[:1]  # the interpreter is slow


def _cases(backend):
    return TRITON_CASES if backend == "triton" else CASES


@pytest.mark.parametrize("backend,dtype,path", BACKEND_PARAMS)
def test_mask_gradient(backend, dtype, path):
    """d(out)/d(attn_mask) (and dq, dk, dv) against the float64 reference, with causal masking, key
    padding, broadcast masks, GQA, rows with no allowed key and odd sizes."""
    need_backend(backend)
    torch.manual_seed(0)
    for spec, is_causal, padded, B, H, Hk, Nq, Nk, D, Dv in _cases(backend):
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype)
        mask = _bias(_mask_shape(spec, B, H, Nq, Nk), dtype)
        pad = random_key_padding(B, Nk, fully_padded_row=B - 1 if B > 1 else None) if padded else None

        def kernel(q, k, v, mask):
            return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=Hk != H,
                                                   key_padding_mask=pad, backend=backend)

        def ref(q, k, v, mask):
            return reference.scaled_dot_product_attention(q, k, v, mask, is_causal, key_padding_mask=pad)

        compare_with_reference(kernel, ref, (q, k, v, mask), grad_inputs=(0, 1, 2, 3),
                               what=f"attention[{backend}] mask {spec} causal={is_causal} pad={padded}")


def _float64_ds(q, k, v, mask, pad, is_causal, scale, dout, keep=None, p=0.0):
    """dS = d(out)/d(scores) in float64 by autograd, (B, H, Nq, Nk): the scores are a leaf."""
    q, k, v, mask, dout = (t.double() for t in (q, k, v, mask, dout))
    H = q.shape[1]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2) * scale).requires_grad_()
    bias = reference.attention_bias(q.shape[2], k.shape[2], batch=q.shape[0], heads=H, attn_mask=mask,
                                    key_padding_mask=pad, is_causal=is_causal, dtype=torch.float64, device="cpu")
    s = scores + bias
    no_key = torch.isneginf(s).all(-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(no_key, 0.0), -1).masked_fill(no_key, 0.0)
    if keep is not None:
        probs = probs * keep / (1 - p)
    (ds,) = torch.autograd.grad(probs @ v, scores, dout)
    return ds


def _keep_mask(backend, B, H, Hk, Nq, Nk, pad, is_causal, scale, p, seed):
    """The kernels' dropout keep mask (B, H, Nq, Nk), read off the output with v = identity
    (out = P * keep / (1 - p), with P > 0 on every allowed pair), and where pairs are allowed."""
    q, k, _ = make_qkv(B, H, Nq, Nk, 16, Hk=Hk)
    eye = torch.eye(Nk).expand(B, Hk, Nk, Nk)
    fwd = kernel_attention_forward
    keep = fwd(q, k, eye, None, pad, is_causal, scale, p, seed, backend)[0] != 0
    allowed = fwd(q, k, eye, None, pad, is_causal, scale, 0.0, 0, backend)[0] != 0
    return keep, allowed


@pytest.mark.parametrize("backend,dropout_p", [("reference", 0.0), ("reference", 0.3), ("cpp", 0.0), ("cpp", 0.3),
                                               ("triton", 0.3)])
def test_kernel_writes_ds(backend, dropout_p):
    """attention_backward(..., compute_dmask=True)'s dmask, element by element, against dS in
    float64 (with the kernel's own dropout keep mask): exactly 0 on disallowed pairs, padded keys
    and rows with no allowed key. Without compute_dmask it is an empty tensor."""
    need_backend(backend)
    torch.manual_seed(1)
    B, H, Hk, Nq, Nk, D, Dv, is_causal, scale, seed = 2, 4, 2, 17, 40, 16, 24, True, 0.3, 4321
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk)
    mask = _bias((H, Nq, Nk), torch.float32).expand(B, H, Nq, Nk)
    pad = random_key_padding(B, Nk, fully_padded_row=1)
    args = (mask, pad, is_causal, scale, dropout_p, seed, backend)
    out, lse = kernel_attention_forward(q, k, v, *args)
    dout = torch.randn_like(out)
    dq, dk, dv, dmask, _ = kernel_attention_backward(dout, q, k, v, out, lse, *args, True)
    keep = None
    if dropout_p > 0:
        keep, allowed = _keep_mask(backend, B, H, Hk, Nq, Nk, pad, is_causal, scale, dropout_p, seed)
        rate = keep[allowed].float().mean().item()
        assert allowed.sum() > 200 and abs(rate - (1 - dropout_p)) < 0.1, (allowed.sum(), rate)
    expected = _float64_ds(q, k, v, mask, pad, is_causal, scale, dout, keep, dropout_p)
    assert dmask.shape == (B, H, Nq, Nk) and dmask.dtype == q.dtype and dmask.is_contiguous()
    disallowed = torch.isneginf(reference.attention_bias(Nq, Nk, batch=B, heads=H, attn_mask=mask,
                                                         key_padding_mask=pad, is_causal=is_causal))
    assert disallowed[1].all() and disallowed[0, :, 2].all()  # a padded sequence, a row with no allowed key
    assert torch.equal(dmask[disallowed], torch.zeros_like(dmask[disallowed]))
    torch.testing.assert_close(dmask.double(), expected, rtol=1e-4, atol=1e-5)
    # dQ, dK, dV of the same call are consistent with that dS (and so with the same keep mask)
    g = H // Hk
    torch.testing.assert_close(dq.double(), expected @ k.double().repeat_interleave(g, 1) * scale,
                               rtol=1e-4, atol=1e-5)
    dk_expected = (expected.transpose(-1, -2) @ q.double() * scale).unflatten(1, (Hk, g)).sum(2)
    torch.testing.assert_close(dk.double(), dk_expected, rtol=1e-4, atol=1e-5)
    without = kernel_attention_backward(dout, q, k, v, out, lse, *args)
    assert without[3].numel() == 0
    for a, b in zip(without[:3], (dq, dk, dv)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float32), ("cpp", torch.float32),
                                           ("cpp", torch.bfloat16), ("triton", torch.float32)])
def test_mask_gradient_with_dropout(backend, dtype):
    """With dropout, dq, dk, dv and the mask's gradient match the float64 reference given the
    kernel's own keep mask (recovered with v = identity): the backward regenerates the forward's
    mask for all four."""
    need_backend(backend)
    torch.manual_seed(2)
    B, H, Hk, Nq, Nk, D, Dv, p, seed, is_causal = 2, 4, 2, 17, 40, 16, 24, 0.3, 99, True
    pad = random_key_padding(B, Nk)
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, Hk=Hk, dtype=dtype)
    mask = _bias((H, Nq, Nk), dtype)

    def kernel(q, k, v, mask):
        torch.manual_seed(seed)  # the public function draws its dropout seed from torch's generator
        return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal,
                                               enable_gqa=True, key_padding_mask=pad, backend=backend)

    torch.manual_seed(seed)
    drawn = torch.randint(2**62, (), dtype=torch.int64)  # as the public op draws it (attention_args.cpp, call_seed)
    keep, allowed = _keep_mask(backend, B, H, Hk, Nq, Nk, pad, is_causal, D ** -0.5, p, drawn)
    assert abs(keep[allowed].float().mean().item() - (1 - p)) < 0.07

    def ref(q, k, v, mask):
        return reference.scaled_dot_product_attention(q, k, v, mask, is_causal, key_padding_mask=pad,
                                                      dropout_mask=keep, dropout_p=p)

    compare_with_reference(kernel, ref, (q, k, v, mask), grad_inputs=(0, 1, 2, 3),
                           what=f"attention[{backend}] mask + dropout")


@pytest.mark.parametrize("backend,dtype", [("reference", torch.bfloat16), ("cpp", torch.bfloat16),
                                           ("cpp", torch.float16), ("triton", torch.float16)])
def test_float32_mask_with_half_precision_query(backend, dtype):
    """torch's SDPA takes a float32 attn_mask with a bf16/fp16 query; so does every backend: the
    mask is added in float32 and its gradient (dS) written in float32."""
    need_backend(backend)
    check_float32_mask(functools.partial(tf.scaled_dot_product_attention, backend=backend), dtype, backend)


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_rows_masked_by_the_most_negative_float(backend):
    """A float mask holding finfo.min where masked (Hugging Face models' fill): where a row has it
    on every key, the scores vanish next to it and torch's softmax is uniform; every backend's too
    (in the Triton kernels' base-2 units it would overflow to -inf: a row with no allowed key,
    output 0). Rows with some key allowed as usual. Gradients finite everywhere, and equal to
    torch's on the rows with an allowed key (docs/compatibility.md: the fully masked rows')."""
    need_backend(backend)
    torch.manual_seed(4)
    B, H, N, D = 2, 2, 9, 16
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, N, N, D))
    lowest = torch.finfo(torch.float32).min
    mask = torch.zeros(N, N).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), lowest)
    mask[0] = lowest  # no key allowed
    mask[4, 2] = lowest
    out = tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*inputs64, attn_mask=mask.double())
    assert torch.allclose(expected[:, :, 0], inputs64[2].mean(2))  # uniform over every key
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)
    dout = torch.randn_like(expected)
    grads = torch.autograd.grad(out, (q, k, v), dout.float())
    assert all(torch.isfinite(g).all() for g in grads)
    dq_expected = torch.autograd.grad(expected, inputs64[0], dout)[0]
    torch.testing.assert_close(grads[0][:, :, 1:].double(), dq_expected[:, :, 1:], atol=1e-5, rtol=1e-4)


def test_opcheck_backward_with_dmask():
    """The backward op's schema and fake implementation with compute_dmask (torch.compile's view)."""
    need_backend("cpp")
    B, H, Nq, Nk = 2, 4, 9, 13
    q, k, v = make_qkv(B, H, Nq, Nk, 16, 24, Hk=2)
    mask = random_attn_mask((H, Nq, Nk), "float").expand(B, H, Nq, Nk)
    pad = random_key_padding(B, Nk)
    ops = torch.ops.transformer_fast
    seed = torch.tensor(7)
    out, lse = ops.attention_forward(q, k, v, mask, pad, True, 0.3, 0.2, seed)
    dout = torch.randn_like(out)
    for compute_dmask in (True, False):
        torch.library.opcheck(ops.attention_backward,
                              (dout, q, k, v, out, lse, mask, pad, True, 0.3, 0.2, seed, compute_dmask))


# ---------------------------------------------------------------------------------------------
# T5: a learned relative position bias, trained with attention dropout.
# ---------------------------------------------------------------------------------------------
def _t5(transformers, attn_implementation, **config):
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   decoder_start_token_id=0, pad_token_id=0, **config)
    return transformers.T5ForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)


def _t5_batch():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 100, (2, 11), generator=g)
    attention_mask = torch.ones(2, 11, dtype=torch.long)
    attention_mask[1, 7:] = 0  # a padded sequence
    labels = torch.randint(1, 100, (2, 6), generator=g)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _bias_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "relative_attention_bias" in n}


def test_t5_trains_with_default_dropout(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import transformer_fast.integrations.huggingface as tf_hf

    tf_hf.register()
    dropouts = []
    original = tf_hf.scaled_dot_product_attention

    def recording(*args, **kwargs):
        dropouts.append((kwargs["dropout_p"], kwargs["attn_mask"] is not None and kwargs["attn_mask"].requires_grad))
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_hf, "scaled_dot_product_attention", recording)
    model = _t5(transformers, "transformer_fast")
    assert model.config.dropout_rate == 0.1  # the default
    model.train()
    loss = model(**_t5_batch()).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert (0.1, True) in dropouts  # a learned bias that requires grad, with attention dropout
    grads = _bias_grads(model)
    assert len(grads) == 2  # encoder and decoder
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_t5_bias_gradient_matches_sdpa():
    """dropout_rate=0: the loss and every parameter's gradient, relative_attention_bias included,
    as on transformers' sdpa path with the same weights (fp32)."""
    transformers = pytest.importorskip("transformers")
    import transformer_fast.integrations.huggingface as tf_hf

    tf_hf.register()
    ref = _t5(transformers, "sdpa", dropout_rate=0.0)
    ours = _t5(transformers, "transformer_fast", dropout_rate=0.0)
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == "transformer_fast"
    ref.train()
    ours.train()
    batch = _t5_batch()
    loss_r, loss_o = ref(**batch).loss, ours(**batch).loss
    torch.testing.assert_close(loss_o, loss_r, atol=1e-6, rtol=1e-5)
    loss_r.backward()
    loss_o.backward()
    grads_r, grads_o = _bias_grads(ref), _bias_grads(ours)
    assert grads_r.keys() == grads_o.keys() and len(grads_r) == 2
    for name in grads_r:
        torch.testing.assert_close(grads_o[name], grads_r[name], atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for (name, p_r), p_o in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p_o.grad, p_r.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_broadcast_half_precision_mask_gradient_is_summed_in_float32(dtype):
    """A bf16/fp16 mask broadcast over heads (and batch) gets dS summed over those dims: in float32
    and rounded once, as torch's math does, within 2x torch's error. (Summing dS rounded to the
    mask's dtype head by head gives up to 17x torch's error: 3 queries over 129 keys.)"""
    need_backend("cpp")
    for seed, (B, L, S) in enumerate([(1, 3, 129)] * 6 + [(2, 40, 300), (2, 200, 200)]):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(B, 2, n, 64).to(dtype) for n in (L, S, S))
        bias, dout = torch.randn(L, S).to(dtype), torch.randn(B, 2, L, 64).to(dtype)
        causal = torch.zeros(L, S).masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))

        def mask_grad(fn, dt):
            mask = bias.to(dt).requires_grad_()
            out = fn(q.to(dt), k.to(dt), v.to(dt), mask)
            return torch.autograd.grad(out, mask, dout.to(dt))[0]

        exact = mask_grad(lambda a, b, c, m: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, attn_mask=m + causal.double()), torch.float64)
        theirs = mask_grad(lambda a, b, c, m: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, attn_mask=m + causal.to(dtype)), dtype)
        ours = mask_grad(lambda a, b, c, m: tf.scaled_dot_product_attention(
            a, b, c, attn_mask=m, is_causal=True, backend="cpp"), dtype)
        assert ours.dtype == dtype
        assert_close_to_reference(ours, exact, theirs, atol=ATOL[dtype] * 0.05 * exact.abs().max().item(),
                                  what=f"dmask seed {seed} {(B, L, S)}")
