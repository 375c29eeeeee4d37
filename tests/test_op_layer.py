"""The op layer: every op passes torch.library.opcheck; the ways a call reaches its kernels (the
C++ binding in eager mode, torch.ops, a backend named explicitly) give the same results; the
dispatcher chooses the backend by device, and backend= overrides it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import _backends, _build_config, _device_kernels

from attention_cases import make_qkv
from helpers import BACKENDS, kernel_device, result_strides
from helpers import skip_unavailable_backend  # noqa: F401 (a fixture)

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
    out, lse = ops.attention_forward(q.detach(), k.detach(), v.detach(), mask, pad, True, 0.3, 0.0, None)
    x, r = torch.randn(6, 16, requires_grad=True), torch.randn(6, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    _, h, mean, rstd = ops.layer_norm_forward(x.detach(), r.detach(), w.detach(), b.detach(), 1e-5, False)
    qs, ks, vs = (t.detach() for t in (q, k, v))
    lq, lk, lv = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    lS, lz = torch.rand(2, 3, 8, 8, requires_grad=True), torch.rand(2, 3, 8, requires_grad=True)  # a carried state
    dS, dz = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8)
    dout = torch.randn(2, 4, 5, 8)
    slopes, sinks = torch.rand(2, 4), torch.randn(4, requires_grad=True)
    extras = ([3, 1], 2.0, slopes)
    out_x, lse_x = ops.attention_forward(qs, ks, vs, None, pad, False, 0.3, 0.0, None, *extras, sinks.detach())
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 2, 6, 10], dtype=torch.int32)
    pq, pk, pv = torch.randn(8, 4, 8, requires_grad=True), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    # q, k, v as most models make them: a (B, N, H * D) projection viewed as heads and transposed
    # (the results are laid out the same way: transformer_fast/_result_layout.py)
    tq, tk, tv = (torch.randn(2, 5, h, 8).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    t_out, t_lse = ops.attention_forward(tq.detach(), tk.detach(), tv.detach(), None, pad, False, 0.3, 0.0, None)
    # a bfloat16 query with a float32 mask (added in float32; its gradient dS float32)
    bq, bk, bv = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    b_out, b_lse = ops.attention_forward(bq.detach(), bk.detach(), bv.detach(), mask, pad, True, 0.3, 0.0, None)
    return {
        "attention_forward float32 mask": (ops.attention_forward, (bq, bk, bv, mask, pad, True, 0.3, 0.0, None)),
        "attention_backward float32 mask": (ops.attention_backward,
                                            (dout.bfloat16(), bq.detach(), bk.detach(), bv.detach(), b_out, b_lse,
                                             mask, pad, True, 0.3, 0.0, None, True)),
        "scaled_dot_product_attention float32 mask": (ops.scaled_dot_product_attention,
                                                      (bq, bk, bv, mask.detach().clone().requires_grad_(), 0.0),
                                                      {"enable_gqa": True, "key_padding_mask": pad}),
        "attention_forward": (ops.attention_forward, (q, k, v, mask, pad, True, 0.3, 0.0, None)),
        "attention_forward heads inside rows": (ops.attention_forward, (tq, tk, tv, None, pad, False, 0.3, 0.0, None)),
        "attention_backward heads inside rows": (ops.attention_backward,
                                                 (t_out.detach().clone(), tq.detach(), tk.detach(), tv.detach(), t_out,
                                                  t_lse, None, pad, False, 0.3, 0.0, None, False)),
        "attention_forward extras": (ops.attention_forward,
                                     (q, k, v, None, pad, False, 0.3, 0.0, None, *extras, sinks)),
        "attention_forward packed": (ops.attention_forward, (pq, pk, pv, None, None, False, 0.3, 0.0, None, [-1, 0],
                                                             0.0, torch.rand(3, 4), None, cu_q, cu_k, None, None, 5,
                                                             4)),
        "attention_backward extras": (ops.attention_backward, (dout, qs, ks, vs, out_x, lse_x, None, pad, False, 0.3,
                                                               0.0, None, False, *extras)),
        "attention_backward delta": (ops.attention_backward, (dout, qs, ks, vs, out_x, lse_x, None, pad, False, 0.3,
                                                              0.0, None, False, *extras), {"compute_delta": True}),
        "attention_forward dropout": (ops.attention_forward, (q, k, v, None, None, False, 0.3, 0.25, torch.tensor(7))),
        "attention_backward": (ops.attention_backward,
                               (dout, qs, ks, vs, out, lse, mask, pad, True, 0.3, 0.0, None, True)),
        "attention_backward_composite": (ops.attention_backward_composite, (dout, qs, ks, vs, mask, pad, True, 0.3)),
        "scaled_dot_product_attention": (ops.scaled_dot_product_attention, (q, k, v, None, 0.0, True),
                                         {"enable_gqa": True, "key_padding_mask": pad}),
        "scaled_dot_product_attention dropout": (ops.scaled_dot_product_attention, (q, k, v, None, 0.2, True),
                                                 {"enable_gqa": True, "seed": torch.tensor(3)}),
        "layer_norm_forward": (ops.layer_norm_forward, (x, r, w, b, 1e-5, False)),
        "layer_norm_forward 3d": (ops.layer_norm_forward, (x.view(2, 3, 16), r.view(2, 3, 16), w, b, 1e-5, False)),
        "layer_norm_forward rms": (ops.layer_norm_forward, (x, None, w, None, 1e-6, True)),
        "layer_norm_backward": (ops.layer_norm_backward,
                                (torch.randn(6, 16), torch.randn(6, 16), h, w.detach(), b.detach(), mean, rstd, 1e-5,
                                 False)),
        "layer_norm_backward_composite": (ops.layer_norm_backward_composite,
                                          (torch.randn(6, 16), h, w.detach(), b.detach(), 1e-5, False)),
        "layer_norm": (ops.layer_norm, (x.view(2, 3, 16), [16], w, b, 1e-5, r.view(2, 3, 16), False)),
        "linear_attention_forward": (ops.linear_attention_forward, (lq, lk, lv, pad, True, 1e-6, None, None, False)),
        "linear_attention_forward state": (ops.linear_attention_forward, (lq, lk, lv, pad, True, 1e-6, lS, lz, True)),
        "linear_attention state": (ops.linear_attention, (lq, lk, lv, False, pad, 1e-6, lS, lz, True)),
        "linear_attention_backward": (ops.linear_attention_backward,
                                      (torch.randn(2, 3, 5, 8), lq.detach(), lk.detach(), lv.detach(), pad, False,
                                       1e-6, None, None, None, None)),
        "linear_attention_backward state": (ops.linear_attention_backward,
                                            (torch.randn(2, 3, 5, 8), lq.detach(), lk.detach(), lv.detach(), pad, True,
                                             1e-6, lS.detach(), lz.detach(), dS, dz)),
        "linear_attention_backward_composite": (ops.linear_attention_backward_composite,
                                                (torch.randn(2, 3, 5, 8), lq.detach(), lk.detach(), lv.detach(), None,
                                                 True, 1e-6, lS.detach(), lz.detach(), dS, None)),
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


def _run_named(backend, op, *args):
    """op(*args) run by ``backend``'s kernels named explicitly (below the op's autograd node)."""
    with _backends.named(backend):
        return op(*args)


@pytest.mark.parametrize("family", ["attention", "layer_norm", "linear_attention"])
def test_binding_ops_and_named_backend_agree_bit_for_bit(family):
    """The eager call (the C++ binding), torch.ops.transformer_fast.<op> (the dispatcher) and
    backend="cpp" named explicitly run the same kernels: identical outputs and gradients."""
    (q, k, v), pad, mask = _attention_inputs()
    if family == "attention":
        calls = [lambda q, k, v, m: tf.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, key_padding_mask=pad),
                 lambda q, k, v, m: ops.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, key_padding_mask=pad),
                 lambda q, k, v, m: _run_named("cpp", ops.attention_forward, q, k, v, m, pad, False, 8 ** -0.5, 0.0,
                                               None)[0]]
        inputs = (q, k, v, mask)
    elif family == "layer_norm":
        x, r, w = torch.randn(3, 4, 40), torch.randn(3, 4, 40), torch.randn(40)
        calls = [lambda x, r, w: tf.layer_norm(x, 40, w, residual=r),
                 lambda x, r, w: ops.layer_norm(x, [40], w, None, 1e-5, r),
                 lambda x, r, w: _run_named("cpp", ops.layer_norm_forward, x.view(12, 40), r.view(12, 40), w, None,
                                            1e-5, False)[:2]]
        inputs = (x, r, w)
    else:
        calls = [lambda q, k, v: tf.linear_attention(q, k, v, is_causal=True),
                 lambda q, k, v: ops.linear_attention(q, k, v, True),
                 lambda q, k, v: _run_named("cpp", ops.linear_attention_forward, q, k, v, None, True, 1e-6, None, None,
                                            False)[0]]
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


def test_direct_call_gate(monkeypatch):
    """_fast_path.direct, the eager fast path's gate (csrc/bindings.cpp), refuses every case in which
    something must see the op itself or the kernels cannot take the call."""
    from torch.autograd import forward_ad
    from torch.overrides import TorchFunctionMode

    from transformer_fast._fast_path import direct

    x, m = torch.randn(2, 3), torch.ones(2, dtype=torch.bool)

    class Subclass(torch.Tensor):
        pass

    assert direct(1, x) and direct(3, x, x, x, None, m) and direct(1, torch.nn.Parameter(x), None)
    assert direct(1, x.half()) and direct(1, x.bfloat16())
    assert not direct(1, x.double()) and not direct(1, x.long())  # the first tensor's dtype: no kernel
    assert not direct(3, x, None, x)  # a required tensor missing (the slow path names it)
    assert not direct(1, x.as_subclass(Subclass)) and not direct(2, x, x, x.as_subclass(Subclass))
    assert not direct(1, x, 1.0) and not direct(1, [x])
    with pytest.raises(ValueError, match="n_tensors"):
        direct(2, x)
    with TorchFunctionMode():
        assert not direct(1, x)
    seen = []
    torch.vmap(lambda t: seen.append(direct(1, t)) or t)(x)
    with forward_ad.dual_level():
        seen.append(direct(1, x))
    torch.jit.trace(lambda t: seen.append(direct(1, t)) or t * 2, (x,), check_trace=False)
    assert seen == [False, False, False]
    assert direct(1, x)  # nothing left active
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # torch.export, AOT tracing
    assert not direct(1, x)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
    monkeypatch.setenv("TRANSFORMER_FAST_BACKEND", "reference")
    assert not direct(1, x)
    monkeypatch.delenv("TRANSFORMER_FAST_BACKEND")
    assert direct(1, x)


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


def test_triton_backend_reason_for_bfloat16_under_the_interpreter(monkeypatch):
    """The rule on any machine: under the interpreter (CPU tensors) bfloat16 is refused for every
    family with its reason (products: raw bits; norms: conversions toward zero), float16 is not;
    on CUDA tensors nothing is."""
    monkeypatch.setattr(_backends, "load_triton", lambda: (object(), None))
    monkeypatch.setattr(_backends, "triton_interpreting", lambda: True)
    cpu = torch.device("cpu")
    for family in ("attention", "linear_attention", "layer_norm"):
        reason = "triton-lang/triton#11584" if family != "layer_norm" else "bfloat16 toward zero"
        assert reason in _backends.unavailable_reason("triton", cpu, torch.bfloat16, family)
        assert _backends.unavailable_reason("triton", cpu, torch.float16, family) is None
        assert _backends.unavailable_reason("triton", torch.device("cuda"), torch.bfloat16, family) is None


@pytest.mark.skipif(not _backends.triton_interpreting(), reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_triton_interpreter_refuses_bfloat16():
    """Triton's interpreter multiplies bfloat16 tl.dot operands as raw bits (results ~1e9 off) and
    converts float32 to bfloat16 toward zero: every family refuses bfloat16 there, with the
    reason; float16 runs, and a bfloat16 residual added to a float32 input (computed in float32)."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="triton-lang/triton#11584"):
        tf.scaled_dot_product_attention(q, q, q, backend="triton")
    with pytest.raises(RuntimeError, match="raw bits of bfloat16"):
        tf.linear_attention(q, q, q, backend="triton")
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 to bfloat16 toward zero"):
        tf.layer_norm(x, (16,), backend="triton")
    h = q.half()
    expected = F.scaled_dot_product_attention(h.float(), h.float(), h.float())
    assert (tf.scaled_dot_product_attention(h, h, h, backend="triton").float() - expected).abs().max() < 2e-3
    y, s = tf.layer_norm(x.float(), (16,), residual=x, backend="triton")
    assert s.dtype == torch.float32 and torch.equal(s, 2 * x.float())
    assert (y - F.layer_norm(2 * x.float(), (16,))).abs().max() < 1e-5


def test_select_backend():
    cpu = torch.device("cpu")
    assert _backends.select_backend(cpu, torch.float64, "auto", "attention") == "reference"
    assert _backends.select_backend(cpu, torch.float32, "auto", "attention") == "cpp"
    assert _backends.select_backend(cpu, torch.float32, "reference", "attention") == "reference"


def test_backend_environment_variable(monkeypatch):
    """TRANSFORMER_FAST_BACKEND overrides "auto" per call: the call leaves the binding."""
    x = torch.randn(3, 8)
    calls = []
    original = _device_kernels.op_kernel
    monkeypatch.setattr(_device_kernels, "op_kernel", lambda *a: calls.append(a[:2]) or original(*a))
    tf.layer_norm(x, 8)
    assert calls == []
    monkeypatch.setenv("TRANSFORMER_FAST_BACKEND", "reference")
    assert _backends.select_backend(torch.device("cpu"), torch.float32, "auto", "layer_norm") == "reference"
    y = tf.layer_norm(x, 8)
    assert calls == [("layer_norm_forward", "reference")]
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))


def _count_kernels(monkeypatch):
    """The (op, backend) of every kernel a named backend runs (_device_kernels.run_named)."""
    calls = []
    original = _device_kernels.op_kernel
    monkeypatch.setattr(_device_kernels, "op_kernel", lambda *a: calls.append(a[:2]) or original(*a))
    return calls


_FAMILY_CALLS = {
    "attention": lambda t, backend: tf.scaled_dot_product_attention(t, t, t, is_causal=True, backend=backend),
    "layer_norm": lambda t, backend: tf.layer_norm(t, 8, backend=backend),
    "linear_attention": lambda t, backend: tf.linear_attention(t, t, t, is_causal=True, backend=backend),
}


@pytest.mark.parametrize("family", sorted(_FAMILY_CALLS))
def test_named_backend_runs_below_the_one_autograd_node(family, monkeypatch):
    """backend="reference" takes the op's own C++ autograd node, with the named backend's kernels
    below it, forward and backward (the backward outside the call's context: the node keeps the
    name), and leaves the thread's choice as it was."""
    calls = _count_kernels(monkeypatch)
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    out = _FAMILY_CALLS[family](x, "reference")
    assert out.grad_fn.name().startswith("transformer_fast::") or family == "linear_attention"
    out.sum().backward()
    assert calls == [(f"{family}_forward", "reference"), (f"{family}_backward", "reference")]
    expected = _FAMILY_CALLS[family](x.detach().double().requires_grad_(), "auto")  # float64: plain torch too
    torch.testing.assert_close(out, expected.float())
    calls.clear()
    _FAMILY_CALLS[family](x, "auto").sum().backward()
    assert calls == []  # the choice did not outlive the call


@pytest.mark.parametrize("family", sorted(_FAMILY_CALLS))
def test_named_backend_in_inference_mode_and_other_threads(family, monkeypatch):
    """The choice is made below autograd, so inference mode (no autograd keys) keeps it; a backward
    run by another thread runs the forward's backend."""
    calls = _count_kernels(monkeypatch)
    x = torch.randn(2, 3, 5, 8)
    with torch.inference_mode():
        _FAMILY_CALLS[family](x, "reference")
    assert calls == [(f"{family}_forward", "reference")]
    calls.clear()
    out = _FAMILY_CALLS[family](x.requires_grad_(), "reference")
    import threading

    worker = threading.Thread(target=lambda: out.sum().backward())
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and x.grad is not None
    assert calls == [(f"{family}_forward", "reference"), (f"{family}_backward", "reference")]


def test_named_backend_under_autocast(monkeypatch):
    """Autocast casts the inputs above the autograd node, so the named backend's kernels get them
    cast, forward and backward, and the result matches torch's autocast SDPA."""
    dtypes = []
    original = _device_kernels.op_kernel

    def recording(*key):
        kernel = original(*key)
        return lambda *args: dtypes.append((key[0], {t.dtype for t in args[:3]})) or kernel(*args)

    monkeypatch.setattr(_device_kernels, "op_kernel", recording)
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tf.scaled_dot_product_attention(q, q, q, is_causal=True, backend="reference")
        expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.float().sum().backward()
    assert dtypes == [("attention_forward", {torch.bfloat16}), ("attention_backward", {torch.bfloat16})]
    assert out.dtype == expected.dtype == torch.bfloat16 and q.grad.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_named_backend_error_keeps_its_type_and_restores_the_choice():
    """An error raised by a named backend's Python kernel reaches the caller with its own type,
    and the thread's choice is restored after it."""
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="needs a seed"):
        with _backends.named("reference"):
            ops.attention_forward(q, q, q, None, None, False, 1.0, 0.5, None)
    assert _backends._build.extension().exchange_named_backend(0) == 0


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
    failure = result.stdout.split("JIT build failed: RuntimeError: ")[-1]
    assert "/nonexistent/c++" in failure, result.stdout  # the shell's message, not ninja's last line


def test_a_failed_jit_build_names_the_compilers_error(tmp_path):
    """The ImportError quotes the compiler's first error, not ninja's closing "build stopped" (a
    torch whose headers need another C++ standard said only that)."""
    compiler = tmp_path / "c++"
    message = "csrc/ops/schemas.cpp:1:2: error: this stand-in compiler refuses every source"
    compiler.write_text('#!/bin/sh\ncase " $* " in *" -c "*)\n'
                        f'  echo "{message}" >&2; exit 1;;\n'
                        'esac\nexec c++ "$@"\n')
    compiler.chmod(0o755)
    code = ("import sys, warnings; sys.modules['transformer_fast._C'] = None\n"
            "warnings.simplefilter('ignore')\n"
            "try:\n    import transformer_fast\n"
            "except ImportError as exc:\n    print('ImportError:', exc)\n")
    env = dict(os.environ, CXX=str(compiler), TRANSFORMER_FAST_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert f"JIT build failed: RuntimeError: {message}" in result.stdout, result.stdout + result.stderr


@pytest.mark.usefixtures("skip_unavailable_backend")
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "qkv"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_results_are_laid_out_as_torch_lays_out_attention_results(backend, layout):
    """Each backend's output is laid out in q's row order and each gradient in its input's, as
    torch's own attention does (checked against torch's strides where torch's CPU attention runs
    the case), so a model's transpose back to (B, N, H * D) costs no copy. Packed results are
    contiguous. The dense forward also runs with num_splits=3 (Triton: 3 parts over the 40 keys, and
    the merge kernel writes out; C++ writes split and unsplit rows through the same strides)."""
    device = kernel_device() if backend == "triton" else "cpu"
    q, k, v = make_qkv(2, 4, 40, 40, 16, dtype=torch.float32, layout=layout, device=device)
    forward = _device_kernels.op_kernel("attention_forward", backend, device)
    backward = _device_kernels.op_kernel("attention_backward", backend, device)
    for splits in (0, 3):
        out, lse = forward(q, k, v, None, None, False, 0.25, 0.0, None, num_splits=splits)
        assert out.stride() == result_strides(q, 16), (splits, out.stride())
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25), atol=1e-5, rtol=1e-5)
    if device == "cpu":
        assert out.stride() == F.scaled_dot_product_attention(q, k, v).stride()
    if layout != "bhnd":  # the model's view back to (B, N, H * D) shares out's memory
        assert out.transpose(1, 2).reshape(2, 40, 64).data_ptr() == out.data_ptr()
    dq, dk, dv, _, _ = backward(torch.randn_like(out), q, k, v, out, lse, None, None, False, 0.25, 0.0, None, False)
    for grad, t in ((dq, q), (dk, k), (dv, v)):
        assert grad.stride() == result_strides(t, 16), (grad.stride(), t.stride())

    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    pq, pk, pv = (t[0].transpose(0, 1) for t in (q, k, v))  # (40, 4, 16) token-major views
    out, lse = forward(pq, pk, pv, None, None, False, 0.25, 0.0, None, cu_seq_q=cu, cu_seq_k=cu, max_q=4, max_k=4)
    dq, dk, dv, _, _ = backward(torch.randn_like(out), pq, pk, pv, out, lse, None, None, False, 0.25, 0.0, None, False,
                             cu_seq_q=cu, cu_seq_k=cu, max_q=4, max_k=4)
    assert all(t.is_contiguous() for t in (out, dq, dk, dv))


def test_triton_cuda_kernels_run_on_their_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: the CUDA kernels make it their first argument's
    (as ATen's do) where it differs, and leave it alone where it is already."""
    entered = []

    class Device:  # torch.cuda.device's part used here
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(None)

    class OnDevice:  # a tensor's part used here
        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Device)
    kernel = _device_kernels._on_device_of_first_tensor(lambda x, y: (x.index, y, list(entered)))
    assert kernel(OnDevice(0), "y") == (0, "y", []) and entered == []
    assert kernel(OnDevice(1), "y") == (1, "y", [1]) and entered == [1, None]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_kernels_on_a_device_that_is_not_current():
    """A model spread over GPUs: each op on cuda:1 while cuda:0 is current gives what it gives with
    cuda:1 current."""
    q, k, v = (torch.randn(2, 3, 70, 40, device="cuda:1", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    x = torch.randn(33, 96, device="cuda:1", requires_grad=True)
    w = torch.randn(96, device="cuda:1")

    def run():
        outs = [tf.scaled_dot_product_attention(q, k, v, is_causal=True), tf.layer_norm(x, (96,), w, w),
                tf.rms_norm(x, (96,), w), tf.linear_attention(q.float(), k.float(), v.float(), is_causal=True)]
        grads = torch.autograd.grad(sum(o.float().square().sum() for o in outs), (q, k, v, x))
        return [o.detach() for o in outs] + list(grads)

    with torch.cuda.device(1):
        expected = run()
    with torch.cuda.device(0):
        for _ in range(3):  # the first call, a recorded one, a replayed one
            got = run()
    torch.cuda.synchronize(1)
    for a, b in zip(got, expected):
        assert a.device == b.device and torch.equal(a, b)
