"""The attention ops' dropout seed: a one-element int64 CPU tensor that the public ops draw with an
op torch.compile traces (csrc/ops/op_utils.h, dropout_seed), not an int read with .item(). A step with
dropout compiles to one graph, draws a new mask at each call, and its backward regenerates the
forward's mask; a seed that is not one is refused with the argument named."""
import pytest
import torch

import transformer_fast as tf

P = 0.4


def _dense(q, k, v):
    return tf.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)


def _packed(q, k, v, cu):
    return tf.varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0), dropout_p=P)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_dropout_draws_a_mask_per_call_and_its_backward_uses_it(compiler, device):
    """With v = identity the output is the dropped probabilities P' themselves, so dV = P'^T dO
    must be out^T dO when the backward drops what the forward dropped (a probability dropped in
    one and not the other moves dV by about P' |dO| ~ 0.1, far beyond the products' rounding:
    float16 on CUDA, where the Triton kernels run through native calls)."""
    torch._dynamo.reset()
    compiled = torch.compile(_dense, fullgraph=True, backend=compiler)
    B, H, N = 2, 3, 24
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k = torch.randn(B, H, N, 16, device=device, dtype=dtype), torch.randn(B, H, N, 16, device=device, dtype=dtype)
    eye = torch.eye(N, device=device, dtype=dtype).expand(B, H, N, N).clone().requires_grad_()
    allowed = torch.ones(N, N, dtype=torch.bool, device=device).tril().expand(B, H, N, N)
    tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else {}
    kept = []
    for _ in range(2):
        out = compiled(q, k, eye)
        dout = torch.randn_like(out)
        (dv,) = torch.autograd.grad((out * dout).sum(), eye)
        torch.testing.assert_close(dv.float(), out.detach().float().transpose(-2, -1) @ dout.float(), **tolerance)
        kept.append(out.detach() != 0)
        assert not kept[-1][~allowed].any()
        assert abs(kept[-1][allowed].float().mean().item() - (1 - P)) < 0.08
    assert not torch.equal(kept[0], kept[1]), "the same mask twice: the seed was fixed when compiling"


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_compiled_dropout_matches_eager_under_the_same_generator_state(layout):
    """aot_eager runs the graph's seed draw on torch's generator, as eager does: equal results
    and gradients after the same torch.manual_seed."""
    torch._dynamo.reset()
    if layout == "dense":
        fn, shapes, extra = _dense, [(2, 3, 17, 16)] * 3, ()
    else:
        fn, shapes, extra = _packed, [(12, 3, 16)] * 3, (torch.tensor([0, 5, 12], dtype=torch.int32),)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = [torch.randn(s) for s in shapes]
    results = []
    for run in (compiled, fn):
        args = [t.clone().requires_grad_() for t in inputs]
        torch.manual_seed(11)
        out = run(*args, *extra)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), *(a.grad for a in args)))
    assert (results[0][0] == 0).any(), "nothing dropped: the test would not see a seed mismatch"
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_converted_encoder_layer_in_training_compiles_to_one_graph():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    ours = tf.convert(layer).train()
    explained = torch._dynamo.explain(ours)(torch.randn(2, 7, 32))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("seed,error,message", [
    (None, ValueError, "dropout_p = 0.2 needs a seed"),
    (torch.tensor(3.0), TypeError, "seed must be an int64 tensor, got dtype torch.float32"),
    (torch.tensor([3, 4]), ValueError, r"seed must be a one-element CPU tensor, got shape \(2,\) on cpu"),
])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_kernel_ops_refuse_what_is_not_a_seed(backend, seed, error, message):
    """The C++ kernels check the seed where they read it; the Python kernels (Triton, plain torch)
    through the same C++ check."""
    from transformer_fast._device_kernels import op_kernel

    q = torch.randn(1, 2, 5, 8)
    forward = torch.ops.transformer_fast.attention_forward if backend == "cpp" else op_kernel("attention_forward",
                                                                                             "reference")
    with pytest.raises(error, match=message):
        forward(q, q, q, None, None, False, 0.3, 0.2, seed)


def test_seed_on_another_device_is_refused():
    from transformer_fast import _build

    with pytest.raises(ValueError, match=r"f: seed must be a one-element CPU tensor, got shape \(\) on meta"):
        _build.extension().dropout_seed("f", torch.tensor(3, device="meta"), 0.2)


def test_public_op_takes_a_given_seed():
    """torch.ops' public op draws a seed only where none is given: with one, the same seed drops
    the same probabilities, and another drops others."""
    q = torch.randn(1, 2, 24, 8)
    sdpa = torch.ops.transformer_fast.scaled_dot_product_attention
    a, b, c = (sdpa(q, q, q, None, 0.5, seed=torch.tensor(s)) for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)
