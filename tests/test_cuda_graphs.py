"""CUDA graphs: every op is capturable. A converted model's whole training step (forward,
backward, optimizer step) captured in a torch.cuda.CUDAGraph and replayed gives what eager
gives, and torch.compile(mode="reduce-overhead") (which captures graphs) runs a converted model.
Dropout is 0: the in-kernel dropout seed is drawn on the host per call, so a replayed graph would
repeat one mask."""
from __future__ import annotations

import copy

import pytest
import torch

import transformer_fast as tf

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a CUDA device", allow_module_level=True)


def _model():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)).cuda()
    return tf.convert(model)


def _step(model, optimizer, x, y, mask):
    optimizer.zero_grad(set_to_none=False)
    logits = model[2](model[1](model[0](x, mask=mask, is_causal=True)))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return loss


def test_training_step_replays_from_a_cuda_graph():
    eager = _model()
    captured = copy.deepcopy(eager)
    x = torch.randn(4, 33, 64, device="cuda")
    y = torch.randint(0, 10, (4, 33), device="cuda")
    mask = torch.nn.Transformer.generate_square_subsequent_mask(33, device="cuda")
    opt_eager = torch.optim.Adam(eager.parameters(), lr=1e-3, capturable=True)
    opt_captured = torch.optim.Adam(captured.parameters(), lr=1e-3, capturable=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (Triton compiles, autotunes) outside the capture
        for _ in range(3):
            _step(captured, opt_captured, x, y, mask)
            _step(eager, opt_eager, x, y, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_captured = _step(captured, opt_captured, x, y, mask)
    for _ in range(3):
        graph.replay()
        loss_eager = _step(eager, opt_eager, x, y, mask)
        torch.cuda.synchronize()
        torch.testing.assert_close(loss_captured, loss_eager, rtol=1e-4, atol=1e-4)
    for p_eager, p_captured in zip(eager.parameters(), captured.parameters()):
        torch.testing.assert_close(p_captured, p_eager, rtol=1e-4, atol=1e-4)


def test_compile_reduce_overhead_runs_a_converted_model():
    model = _model().eval()
    x = torch.randn(4, 33, 64, device="cuda")
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            got = compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_ops_capture_with_bf16_autocast():
    q = torch.randn(2, 4, 100, 64, device="cuda", requires_grad=True)
    x = torch.randn(100, 256, device="cuda", requires_grad=True)
    w = torch.ones(256, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            out = tf.scaled_dot_product_attention(q, q, q, is_causal=True)
            y = tf.layer_norm(x, 256, w)
            z = tf.linear_attention(q, q, q, is_causal=True)
        (out.float().sum() + y.float().sum() + z.float().sum()).backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    q.grad = x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    expected = tf.scaled_dot_product_attention(q.detach().bfloat16(), q.detach().bfloat16(), q.detach().bfloat16(),
                                               is_causal=True)
    torch.testing.assert_close(out, expected)
