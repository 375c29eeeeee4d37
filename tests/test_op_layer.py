"""The op layer: every op passes torch.library.opcheck; the ways a call reaches its kernels (the
C++ binding in eager mode, torch.ops, a backend named explicitly) give the same results; the
dispatcher chooses the backend by device, and backend= overrides it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import transformer_fast as tf
from transformer_fast import _backends, _build_config, _explicit

ops = torch.ops.transformer_fast


def _attention_inputs(grad=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 key heads for 4 query heads
    pad = torch.tensor([[False] * 5, [False, False, True, True, True]])
    mask = torch.randn(1, 4, 5, 5, generator=g).expand(2, 4, 5, 5)
    return [t.requires_grad_(grad) for t in (q, k, v)], pad, mask


def _op_cases():
    (q, k, v), pad, mask = _attention_inputs()
    out, lse = ops.attention_forward(q.detach(), k.detach(), v.detach(), mask, pad, True, 0.3, 0.0, 0)
    x, r = torch.randn(6, 16, requires_grad=True), torch.randn(6, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    _, h, mean, rstd = ops.layer_norm_forward(x.detach(), r.detach(), w.detach(), b.detach(), 1e-5, False)
    qs, ks, vs = (t.detach() for t in (q, k, v))
    lq, lk, lv = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, 5, 8)
    slopes, sinks = torch.rand(2, 4), torch.randn(4, requires_grad=True)
    extras = ([3, 1], 2.0, slopes)
    out_x, lse_x = ops.attention_forward(qs, ks, vs, None, pad, False, 0.3, 0.0, 0, *extras, sinks.detach())
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 2, 6, 10], dtype=torch.int32)
    pq, pk, pv = torch.randn(8, 4, 8, requires_grad=True), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    return {
        "attention_forward": (ops.attention_forward, (q, k, v, mask, pad, True, 0.3, 0.0, 0)),
        "attention_forward extras": (ops.attention_forward, (q, k, v, None, pad, False, 0.3, 0.0, 0, *extras, sinks)),
        "attention_forward packed": (ops.attention_forward, (pq, pk, pv, None, None, False, 0.3, 0.0, 0, [-1, 0], 0.0,
                                                             torch.rand(3, 4), None, cu_q, cu_k, None, None, 5, 4)),
        "attention_backward extras": (ops.attention_backward, (dout, qs, ks, vs, out_x, lse_x, None, pad, False, 0.3,
                                                               0.0, 0, False, *extras)),
        "attention_forward dropout": (ops.attention_forward, (q, k, v, None, None, False, 0.3, 0.25, 7)),
        "attention_backward": (ops.attention_backward, (dout, qs, ks, vs, out, lse, mask, pad, True, 0.3, 0.0, 0, True)),
        "attention_backward_composite": (ops.attention_backward_composite, (dout, qs, ks, vs, mask, pad, True, 0.3)),
        "scaled_dot_product_attention": (ops.scaled_dot_product_attention, (q, k, v, None, 0.0, True),
                                         {"enable_gqa": True, "key_padding_mask": pad}),
        "layer_norm_forward": (ops.layer_norm_forward, (x, r, w, b, 1e-5, False)),
        "layer_norm_forward 3d": (ops.layer_norm_forward, (x.view(2, 3, 16), r.view(2, 3, 16), w, b, 1e-5, False)),
        "layer_norm_forward rms": (ops.layer_norm_forward, (x, None, w, None, 1e-6, True)),
        "layer_norm_backward": (ops.layer_norm_backward,
                                (torch.randn(6, 16), torch.randn(6, 16), h, w.detach(), b.detach(), mean, rstd, 1e-5,
                                 False)),
        "layer_norm_backward_composite": (ops.layer_norm_backward_composite,
                                          (torch.randn(6, 16), h, w.detach(), b.detach(), 1e-5, False)),
        "layer_norm": (ops.layer_norm, (x.view(2, 3, 16), [16], w, b, 1e-5, r.view(2, 3, 16), False)),
        "linear_attention_forward": (ops.linear_attention_forward, (lq, lk, lv, pad, True, 1e-6)),
        "linear_attention_backward": (ops.linear_attention_backward,
                                      (torch.randn(2, 3, 5, 8), lq.detach(), lk.detach(), lv.detach(), pad, False,
                                       1e-6)),
        "linear_attention_backward_composite": (ops.linear_attention_backward_composite,
                                                (torch.randn(2, 3, 5, 8), lq.detach(), lk.detach(), lv.detach(), None,
                                                 True, 1e-6)),
        "linear_attention": (ops.linear_attention, (lq, lk, lv, False, pad, 1e-6)),
        "varlen_attn": (ops.varlen_attn, (pq, pk, pv, cu_q, cu_k, 5, 4, True, None, [2, 0], True),
                        {"softcap": 3.0, "sinks": sinks}),
    }


def test_every_op_has_an_opcheck_case():
    names = {n.split(" ")[0] for n in _op_cases()}
    registered = {name for name in dir(ops) if not name.startswith("_") and isinstance(getattr(ops, name),
                                                                                        torch._ops.OpOverloadPacket)}
    assert registered == names, registered ^ names


@pytest.mark.parametrize("case", sorted(_op_cases()))
def test_opcheck(case):
    """Schema, fake (meta) kernel, autograd registration and AOT dispatch with dynamic shapes."""
    op, args, *kwargs = _op_cases()[case]
    torch.library.opcheck(op, args, kwargs[0] if kwargs else {})


# ------------------------------------------------------------------------------------------
# Call paths
# ------------------------------------------------------------------------------------------
def _run(fn, inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach()] + [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.grad is not None]


@pytest.mark.parametrize("family", ["attention", "layer_norm", "linear_attention"])
def test_binding_ops_and_named_backend_agree_bit_for_bit(family):
    """The eager call (the C++ binding), torch.ops.transformer_fast.<op> (the dispatcher) and
    backend="cpp" named explicitly run the same kernels: identical outputs and gradients."""
    (q, k, v), pad, mask = _attention_inputs()
    if family == "attention":
        calls = [lambda q, k, v, m: tf.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, key_padding_mask=pad),
                 lambda q, k, v, m: ops.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, key_padding_mask=pad),
                 lambda q, k, v, m: _explicit.attention(
                     "cpp", q, k, v, m, pad, False, 8 ** -0.5, 0.0, 0)[0]]
        inputs = (q, k, v, mask)
    elif family == "layer_norm":
        x, r, w = torch.randn(3, 4, 40), torch.randn(3, 4, 40), torch.randn(40)
        calls = [lambda x, r, w: tf.layer_norm(x, 40, w, residual=r),
                 lambda x, r, w: ops.layer_norm(x, [40], w, None, 1e-5, r),
                 lambda x, r, w: _explicit.layer_norm("cpp", x.view(12, 40), r.view(12, 40), w, None,
                                                                    1e-5, False)]
        inputs = (x, r, w)
    else:
        calls = [lambda q, k, v: tf.linear_attention(q, k, v, is_causal=True),
                 lambda q, k, v: ops.linear_attention(q, k, v, True),
                 lambda q, k, v: _explicit.linear_attention("cpp", q, k, v, None, True, 1e-6)]
        inputs = (q, k[:, :1].expand(2, 4, 5, 8), v[:, :1].expand(2, 4, 5, 8))
    results = [_run(call, inputs) for call in calls]
    for other in results[1:]:
        assert len(other) == len(results[0])
        for got, expected in zip(other, results[0]):
            assert torch.equal(got.reshape(expected.shape), expected)


def test_dispatch_modes_see_the_kernel_op():
    """A TorchDispatchMode (FakeTensorMode, FlopCounterMode, ...) sees the kernel op, not the ATen
    calls inside the kernel, on the eager path too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(4, 16), torch.randn(16)
    q = torch.randn(1, 2, 3, 8)
    with torch.no_grad(), Recorder() as recorder:
        tf.layer_norm(x, (16,), w)
        tf.scaled_dot_product_attention(q, q, q)
    assert any("transformer_fast.layer_norm_forward" in name for name in recorder.seen), recorder.seen
    assert any("transformer_fast.attention_forward" in name for name in recorder.seen), recorder.seen
    assert not any("aten.bmm" in name or "aten.mm" in name for name in recorder.seen), recorder.seen


def test_fake_tensors_run_the_public_functions():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 7, 16)
        out = tf.scaled_dot_product_attention(q, q, q, is_causal=True)
        y, h = tf.rms_norm(torch.empty(5, 32), 32, torch.empty(32), residual=torch.empty(5, 32))
    assert out.shape == (2, 3, 7, 16) and y.shape == h.shape == (5, 32)


# ------------------------------------------------------------------------------------------
# Backends: the dispatcher chooses by device; backend= and the environment override it
# ------------------------------------------------------------------------------------------
def test_dispatcher_backend_by_device():
    assert _backends.dispatcher_backend("cpu", "attention") == "cpp"
    assert _backends.dispatcher_backend("mps", "layer_norm") == "reference"


def test_explicit_backend():
    cpu = torch.device("cpu")
    assert _backends.explicit_backend("auto", cpu, torch.float32, "attention") is None
    assert _backends.explicit_backend("cpp", cpu, torch.float32, "attention") is None  # the dispatcher's own
    assert _backends.explicit_backend("auto", cpu, torch.float64, "attention") == "reference"  # no fp64 kernels
    assert _backends.explicit_backend("reference", cpu, torch.float32, "attention") == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        _backends.explicit_backend("cuda-magic", cpu, torch.float32, "attention")
    with pytest.raises(RuntimeError, match="unavailable"):
        _backends.explicit_backend("cpp", cpu, torch.float64, "attention")
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        _backends.explicit_backend("cpp", torch.device("cuda"), torch.float16, "layer_norm")


def test_select_backend():
    cpu = torch.device("cpu")
    assert _backends.select_backend(cpu, torch.float64, "auto", "attention") == "reference"
    assert _backends.select_backend(cpu, torch.float32, "auto", "attention") == "cpp"
    assert _backends.select_backend(cpu, torch.float32, "reference", "attention") == "reference"


def test_backend_environment_variable(monkeypatch):
    """TRANSFORMER_FAST_BACKEND overrides "auto" per call: the call leaves the binding."""
    x = torch.randn(3, 8)
    calls = []
    original = _explicit.layer_norm
    monkeypatch.setattr(_explicit, "layer_norm", lambda *a: calls.append(a[0]) or original(*a))
    tf.layer_norm(x, 8)
    assert calls == []
    monkeypatch.setenv("TRANSFORMER_FAST_BACKEND", "reference")
    assert _backends.select_backend(torch.device("cpu"), torch.float32, "auto", "layer_norm") == "reference"
    y = tf.layer_norm(x, 8)
    assert calls == ["reference"]
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))


def test_cpp_backend_on_cuda_tensors_only_for_its_cuda_families():
    """The C++ extension takes CUDA tensors for the families it was built with CUDA kernels for
    (attention, where torch has CUDA), and names them when it cannot."""
    cuda = torch.device("cuda")
    families = tf._C.cuda_families()
    assert families == (["attention"] if _build_config.with_cuda() else [])
    for family in ("attention", "layer_norm", "linear_attention"):
        reason = _backends.unavailable_reason("cpp", cuda, torch.float16, family)
        if family in families:
            assert reason is None
        else:
            assert "CPU tensors only" in reason and (", ".join(families) or "none in this build") in reason


def test_without_the_extension_the_import_says_why(tmp_path):
    """No prebuilt extension and a JIT build that cannot compile: importing the package raises an
    ImportError naming the cause (the ops' schemas live in the extension)."""
    code = ("import sys, warnings; sys.modules['transformer_fast._C'] = None\n"
            "warnings.simplefilter('ignore')\n"
            "try:\n    import transformer_fast\n"
            "except ImportError as exc:\n    print('ImportError:', exc)\n")
    env = dict(os.environ, CXX="/nonexistent/c++", CC="/nonexistent/cc",
               TRANSFORMER_FAST_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert "ImportError: transformer_fast needs its C++ extension" in result.stdout, result.stdout + result.stderr
    assert "JIT build failed" in result.stdout
