"""The kernels the dispatcher runs on devices other than the CPU, registered from Python: on
CUDA the Triton kernels where Triton loads (the attention and norm ops' as native calls unless
TRANSFORMER_FAST_NATIVE_LAUNCH=0, transformer_fast/_native_calls.py), else the C++ CUDA kernels
(attention) and plain torch; on any other device plain torch (as CompositeExplicitAutograd, the
kernel of every backend key that has none of its own). The C++ CPU kernels register themselves (csrc/cpu/<family>.cpp).

``op_kernel`` adapts a backend's kernel-level function to its op's contract: empty problems
answered without a launch, results a call does not produce as empty tensors (never None).
"""
from __future__ import annotations

import functools

import torch

from . import _backends, _build, _native_calls
from ._result_layout import empty_in_rows_of
from ._attention_call import AttentionBackwardCall, AttentionForwardCall

_INF = float("inf")


def _empty(ref):
    return ref.new_empty(0)


def _attention_forward(kernel):
    check_seed = _build.extension().dropout_seed  # csrc/ops/op_utils.h: what a seed is, and its messages

    def attention_forward(*args, **kwargs):
        c = AttentionForwardCall(*args, **kwargs)
        check_seed("attention_forward", c.seed, c.dropout_p)
        q = c.q
        if c.cu_seq_q is None:
            B, H, Nq, _ = q.shape
            if Nq == 0 or c.k.shape[2] == 0:  # no queries, or no keys: every row is empty -> 0
                lse = q.new_full((B, H, Nq), _INF, dtype=_stats_dtype(q)) if c.sinks is None else \
                    c.sinks.to(_stats_dtype(q))[None, :, None].expand(B, H, Nq).contiguous()
                return empty_in_rows_of(q, c.v.shape[-1]).zero_(), lse
        elif q.shape[0] == 0:
            return q.new_empty(0, q.shape[1], c.v.shape[-1]), q.new_empty(q.shape[1], 0, dtype=_stats_dtype(q))
        return kernel(c)
    return attention_forward


def _attention_backward(kernel):
    check_seed = _build.extension().dropout_seed

    def attention_backward(*args, **kwargs):
        c = AttentionBackwardCall(*args, **kwargs)
        check_seed("attention_backward", c.seed, c.dropout_p)
        q, k = c.q, c.k
        rows, keys = (q.shape[2], k.shape[2]) if c.cu_seq_q is None else (q.shape[0], k.shape[0])
        if rows == 0 or keys == 0:
            dmask = q.new_zeros(*q.shape[:3], k.shape[2]) if c.compute_dmask else _empty(q)
            delta = c.lse.new_zeros(c.lse.shape) if c.compute_delta else _empty(q)
            return (*(empty_in_rows_of(t, t.shape[-1]).zero_() for t in (q, k, c.v)), dmask, delta)
        dq, dk, dv, dmask, delta = kernel(c)
        return dq, dk, dv, _empty(q) if dmask is None else dmask, _empty(q) if delta is None else delta
    return attention_backward


def _stats_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _rows(t, width):
    """t as (rows, width): 2-D tensors (and None) as they are, with no reshape (1-2 us a call)."""
    return t if t is None or t.dim() == 2 else t.reshape(-1, width)


def _layer_norm_forward(kernel):
    def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
        shape = x.shape
        if x.numel() == 0:
            stats = x.new_empty(0, dtype=_stats_dtype(x))
            return x.new_empty(shape), (x.new_empty(shape) if residual is not None else _empty(x)), stats, stats
        y, h, mean, rstd = kernel(_rows(x, shape[-1]), _rows(residual, shape[-1]), weight, bias, eps, is_rms)
        if x.dim() != 2:  # sizes unpacked: view(torch.Size) parses ~2 us slower than view(*sizes)
            y, h = y.view(*shape), (None if h is None else h.view(*shape))
        return y, _empty(x) if h is None else h, _empty(rstd) if mean is None else mean, rstd
    return layer_norm_forward


def _layer_norm_backward(kernel):
    def layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
        if h.numel() == 0:
            return (torch.zeros_like(h), torch.zeros_like(weight) if weight is not None else _empty(h),
                    torch.zeros_like(bias) if bias is not None else _empty(h))
        width = h.shape[-1]
        dx, dweight, dbias = kernel(_rows(dy, width), _rows(dh, width), _rows(h, width), weight, bias,
                                    None if is_rms else mean, rstd, eps, is_rms)
        if h.dim() != 2:
            dx = dx.view(*h.shape)
        return dx, _empty(h) if dweight is None else dweight, _empty(h) if dbias is None else dbias
    return layer_norm_backward


def _empty_state(q):
    """An absent state result: an empty tensor in the state's dtype."""
    return q.new_empty(0, dtype=_stats_dtype(q))


def _initial_or_zeros(initial, shape, ref):
    """A contiguous copy of the initial state's tensor, or zeros without one (state dtype)."""
    if initial is not None:
        return initial.clone(memory_format=torch.contiguous_format)
    return ref.new_zeros(shape, dtype=_stats_dtype(ref))


def _linear_attention_forward(kernel):
    def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
        B, H, Nq, D = q.shape
        Dv = v.shape[-1]
        if Nq == 0 and k.shape[2] == 0:  # nothing to answer, nothing to add: the state passes through
            if not output_final_state:
                return q.new_zeros(B, H, 0, Dv), _empty_state(q), _empty_state(q)
            return (q.new_zeros(B, H, 0, Dv), _initial_or_zeros(initial_S, (B, H, D, Dv), q),
                    _initial_or_zeros(initial_z, (B, H, D), q))
        out, S, z = kernel(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state)
        return out, (_empty_state(q) if S is None else S), (_empty_state(q) if z is None else z)
    return linear_attention_forward


def _linear_attention_backward(kernel):
    def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                                  grad_final_z):
        B, H, _, D = q.shape
        Dv = v.shape[-1]
        if q.shape[2] == 0 and k.shape[2] == 0:  # the initial state's gradient is the final state's
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            if initial_S is None:
                return dq, dk, dv, _empty_state(q), _empty_state(q)
            return (dq, dk, dv, _initial_or_zeros(grad_final_S, (B, H, D, Dv), q),
                    _initial_or_zeros(grad_final_z, (B, H, D), q))
        dq, dk, dv, dS0, dz0 = kernel(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                      grad_final_S, grad_final_z)
        return dq, dk, dv, (_empty_state(q) if dS0 is None else dS0), (_empty_state(q) if dz0 is None else dz0)
    return linear_attention_backward


_CONTRACT = {
    "attention_forward": _attention_forward, "attention_backward": _attention_backward,
    "layer_norm_forward": _layer_norm_forward, "layer_norm_backward": _layer_norm_backward,
    "linear_attention_forward": _linear_attention_forward, "linear_attention_backward": _linear_attention_backward,
}
OPS = tuple(_CONTRACT)


@functools.lru_cache(maxsize=None)
def op_kernel(name: str, backend: str, device_type: str = "cpu"):
    """``backend``'s kernel-level function ``name`` with the op's contract (see the module doc)."""
    kernel = _backends.kernel(name, backend, device_type)
    if backend == "cpp" and name in _TAKE_A_CALL:  # the C++ bindings take the arguments one by one
        kernel = functools.partial(_spread, kernel)
    return _CONTRACT[name](kernel)


_TAKE_A_CALL = ("attention_forward", "attention_backward")  # the Python kernels of these take one call object


def _spread(kernel, call):
    return kernel(*call)


def run_named(name: str, code: int, *args):
    """The kernel op ``name`` run by a backend chosen by name (``_backends.named``): called by
    its BackendSelect kernel (csrc/ops/named_backend.h) with the op's arguments."""
    return op_kernel(name, _backends.BACKENDS[code - 1], args[0].device.type)(*args)


def _on_device_of_first_tensor(kernel):
    """``kernel`` run with the current CUDA device its first argument's: Triton launches on the
    current device, and ATen's CUDA kernels set it from their arguments (a device guard), so a
    model spread over several GPUs runs each layer's kernels on that layer's."""
    def on_device(*args):
        index = args[0].get_device()
        if index == torch.cuda.current_device():
            return kernel(*args)
        with torch.cuda.device(index):
            return kernel(*args)
    return on_device


_library = None


def register():
    """Registers the CUDA and fallback kernels of every kernel op (once)."""
    global _library
    if _library is not None:
        return
    _build.extension().set_named_kernel_runner(run_named)
    _library = torch.library.Library("transformer_fast", "IMPL")
    for name in OPS:
        _library.impl(name, op_kernel(name, "reference"), "CompositeExplicitAutograd")
    if not torch.cuda.is_available():
        return
    native = {}
    for family in _backends.FAMILIES:
        backend = _backends.dispatcher_backend("cuda", family)
        if backend == "triton":
            for name in (f"{family}_forward", f"{family}_backward"):
                kernel = op_kernel(name, "triton", "cuda")
                if _native_calls_on() and name in _native_calls.OPS:
                    native[name] = kernel  # csrc/launch/native_calls.cpp sets the device before it
                else:
                    _library.impl(name, _on_device_of_first_tensor(kernel), "CUDA")
        elif backend == "cpp":  # the C++ CUDA kernels register themselves (csrc/cuda/attention_cuda.cu)
            _build.extension().register_cuda_kernels()
    if native:
        _native_calls.setup(native)


def _native_calls_on():
    """Native calls replay packed launches: on where those are (compiled kernels, unless
    TRANSFORMER_FAST_NATIVE_LAUNCH=0)."""
    from .kernels import _launch

    return _launch._NATIVE and not _launch.interpreting()
