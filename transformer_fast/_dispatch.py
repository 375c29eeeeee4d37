"""The one place that decides which backend runs a kernel.

Backends:
  * ``triton``    - the kernels in ``transformer_fast.kernels`` (CUDA tensors; CPU tensors only
                    under ``TRITON_INTERPRET=1``, which is how CI tests them);
  * ``cpp``       - the C++ extension ``transformer_fast._C`` (CPU tensors; CUDA tensors for the
                    families it has CUDA kernels for, where torch has CUDA: attention);
  * ``reference`` - the plain PyTorch code in ``transformer_fast.reference`` (anything).

``select_backend`` picks one per call; ``kernel`` returns that backend's implementation of a
kernel-level function. Everything else in the package goes through these two functions.
``run_op`` decides whether a call goes through its custom op or straight to the op's function.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import warnings

import torch

BACKENDS = ("triton", "cpp", "reference")
_ENV_BACKEND = "TRANSFORMER_FAST_BACKEND"

# Kernel-level functions and the family module that defines them in each backend.
_FAMILY = {
    "attention_forward": "attention",
    "attention_backward": "attention",
    "layer_norm_forward": "layer_norm",
    "layer_norm_backward": "layer_norm",
    "linear_attention_forward": "linear_attention",
    "linear_attention_backward": "linear_attention",
}


def triton_interpreting() -> bool:
    """Whether the Triton kernels run under the interpreter (TRITON_INTERPRET=1 when they load)."""
    module, reason = _load_triton()
    return reason is None and module.interpreting()


# --------------------------------------------------------------------------------------------
# Loading the backends (each once per process; the failure reason is kept for the report)
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _load_triton():
    """Returns (module, None) or (None, reason)."""
    try:
        import triton  # noqa: F401

        return importlib.import_module("transformer_fast.kernels"), None
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(exc).__name__}: {exc}"


def _csrc_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")):
        if os.path.isfile(os.path.join(candidate, "bindings.cpp")):
            return candidate
    return None


def build_directory(*key_parts, prefix=""):
    """A JIT build folder under TRANSFORMER_FAST_CACHE (default ~/.cache/transformer_fast), named
    by a hash of key_parts and the torch version, created if missing."""
    key = "|".join([*key_parts, torch.__version__])
    cache_root = os.environ.get(
        "TRANSFORMER_FAST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "transformer_fast"))
    build_dir = os.path.join(cache_root, prefix + hashlib.sha256(key.encode()).hexdigest()[:16])
    os.makedirs(build_dir, exist_ok=True)
    return build_dir


def _jit_build():
    """Builds csrc/ with torch.utils.cpp_extension.load into a cache directory keyed on the
    source folder, the flags and the torch version; ninja rebuilds what changed. Where torch has
    CUDA, the CUDA kernels are built too; if that build fails, the CPU kernels alone (warned)."""
    from . import _build_config

    csrc = _csrc_dir()
    if csrc is None:
        raise RuntimeError("the C++ sources (csrc/) are not shipped with this installation")
    if _build_config.with_cuda():
        try:
            return _jit_build_variant(csrc, cuda=True)
        except Exception as exc:  # noqa: BLE001 - nvcc missing or too old, a compile error, ...
            warnings.warn(f"transformer_fast: building the C++ extension's CUDA kernels failed, building its CPU "
                          f"kernels alone ({type(exc).__name__}: {str(exc).strip()[-500:]})", RuntimeWarning,
                          stacklevel=4)
    return _jit_build_variant(csrc, cuda=False)


def _jit_build_variant(csrc, cuda):
    from torch.utils import cpp_extension

    from . import _build_config

    cflags = _build_config.extra_cflags(cuda)
    build_dir = build_directory(os.path.realpath(csrc), " ".join(cflags))
    return cpp_extension.load(
        name="transformer_fast_C",
        sources=_build_config.source_paths(csrc, cuda),
        extra_cflags=cflags,
        extra_cuda_cflags=_build_config.extra_cuda_cflags() if cuda else None,
        extra_ldflags=_build_config.extra_ldflags(),
        build_directory=build_dir,
        verbose=os.environ.get("TRANSFORMER_FAST_VERBOSE_BUILD") == "1",
    )


@functools.lru_cache(maxsize=None)
def _load_cpp():
    """Returns (module, None) or (None, reason). Loaded once: a second cpp_extension.load of
    the same extension in one process is not safe, so the result is cached for good."""
    try:
        from . import _C  # built by setup.py

        return _C, None
    except ImportError as exc:
        prebuilt_error = exc
    try:
        return _jit_build(), None
    except Exception as exc:  # noqa: BLE001 - compiler missing, build error, ...
        reason = (f"no prebuilt transformer_fast._C ({prebuilt_error}) and the JIT build failed: "
                  f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        warnings.warn(f"transformer_fast: the C++ backend is unavailable, CPU tensors use the "
                      f"reference implementation instead. Cause: {reason}", RuntimeWarning, stacklevel=3)
        return None, reason


def cpp_extension():
    """The loaded C++ extension module (raises RuntimeError with the cause if unavailable)."""
    module, reason = _load_cpp()
    if module is None:
        raise RuntimeError(f"the C++ backend is unavailable: {reason}")
    return module


# The dtypes each compiled backend has kernels for; the reference takes any floating dtype.
_DTYPES = {
    "triton": (torch.float16, torch.bfloat16, torch.float32),
    "cpp": (torch.float16, torch.bfloat16, torch.float32),
}


@torch.compiler.assume_constant_result  # torch.compile: evaluated at trace time, no graph break
def _unavailable_reason(backend: str, device: torch.device | None, dtype: torch.dtype | None = None,
                        family: str | None = None) -> str | None:
    """Why `backend` cannot run kernel family `family` ("attention", ...) on `device`/`dtype`
    (None: it can). None asks about any device or dtype; family None about every family."""
    if backend == "reference":
        return None
    if backend in _DTYPES and dtype is not None and dtype not in _DTYPES[backend]:
        return f"it has no {dtype} kernels (supported: {', '.join(str(d) for d in _DTYPES[backend])})"
    if backend == "triton":
        _, reason = _load_triton()
        if reason is not None:
            return reason
        if device is None:
            return None if (torch.cuda.is_available() or triton_interpreting()) else \
                "no CUDA device, and TRITON_INTERPRET=1 is not set"
        if device.type == "cuda" or (device.type == "cpu" and triton_interpreting()):
            return None
        return f"Triton runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device.type}"
    if backend == "cpp":
        module, reason = _load_cpp()
        if reason is not None:
            return reason
        if device is None or device.type == "cpu":
            return None
        cuda_families = module.cuda_families() if hasattr(module, "cuda_families") else []
        if device.type == "cuda" and family in cuda_families:
            return None
        return (f"the C++ extension runs {family or 'every kernel family'} on CPU tensors only (CUDA kernels: "
                f"{', '.join(cuda_families) or 'none in this build'}), got {device.type} tensors")
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")


def available_backends() -> dict:
    """{backend: None if it works on this machine, else the reason it does not}."""
    return {name: _unavailable_reason(name, None) for name in BACKENDS}


def select_backend(device: torch.device, dtype: torch.dtype, requested: str | None = "auto",
                   family: str | None = None) -> str:
    """Chooses the backend for kernel family `family` on tensors of `dtype` on `device`.

    `requested` is a backend name or "auto"; "auto" reads TRANSFORMER_FAST_BACKEND and otherwise
    prefers Triton on CUDA (then the C++ extension's CUDA kernels), C++ on CPU, and the reference
    where neither works. An explicitly requested backend that cannot run raises RuntimeError with
    the reason.
    """
    if requested is None or requested == "auto":
        requested = os.environ.get(_ENV_BACKEND, "auto") or "auto"
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {requested!r}")
        reason = _unavailable_reason(requested, device, dtype, family)
        if reason is not None:
            raise RuntimeError(f"backend {requested!r} is unavailable for {dtype} {device.type} tensors: {reason}")
        return requested
    preference = ("triton", "cpp") if device.type == "cuda" else ("cpp",)
    for name in preference:
        if _unavailable_reason(name, device, dtype, family) is None:
            return name
    return "reference"


@functools.lru_cache(maxsize=None)
def _triton_family(family: str):
    return importlib.import_module(f"transformer_fast.kernels.{family}")


def kernel(name: str, backend: str):
    """The implementation of kernel-level function `name` in `backend`."""
    if backend == "cpp":
        return getattr(cpp_extension(), name)
    if backend == "triton":
        module, reason = _load_triton()
        if module is None:
            raise RuntimeError(f"the Triton backend is unavailable: {reason}")
        return getattr(_triton_family(_FAMILY[name]), name)
    if backend == "reference":
        from . import _reference_kernels

        return getattr(_reference_kernels, name)
    raise ValueError(f"unknown backend {backend!r}")


# --------------------------------------------------------------------------------------------
# Autocast
# --------------------------------------------------------------------------------------------
_AUTOCAST_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_dtype(policy: str, device: torch.device):
    """The dtype that autocast, where it is on for ``device``, gives the inputs of an op with
    ``policy`` (None: autocast is off or leaves them alone), as torch's own autocast does:
    "lower" for ops on its lower-precision list (scaled_dot_product_attention, matmul): the
    autocast dtype; "norm" for layer_norm and rms_norm, which CUDA autocast runs in float32 and
    CPU autocast leaves on no list."""
    if not torch._C._is_any_autocast_enabled() or device.type not in _AUTOCAST_DEVICES:
        return None
    if not torch.is_autocast_enabled(device.type):
        return None
    if policy == "lower":
        return torch.get_autocast_dtype(device.type)
    return torch.float32 if device.type == "cuda" else None


def _autocast_cast(dtype, t):
    """``t`` in ``dtype`` if autocast would cast it (a floating tensor, not float64, as torch's
    cached_cast decides), else ``t`` itself."""
    if (dtype is None or not isinstance(t, torch.Tensor) or not t.is_floating_point()
            or t.dtype in (dtype, torch.float64)):
        return t
    return t.to(dtype)


def autocast_inputs(policy: str, *tensors):
    """``tensors`` (the first one a tensor; None and non-tensors pass through) as autocast gives
    them to an op with ``policy`` (see autocast_dtype): a tuple, the inputs themselves where
    autocast is off."""
    if not torch._C._is_any_autocast_enabled():
        return tensors
    dtype = autocast_dtype(policy, tensors[0].device)
    return tensors if dtype is None else tuple(_autocast_cast(dtype, t) for t in tensors)


def autocast_off():
    """A context in which torch ops are not autocast (a no-op where autocast is off)."""
    if torch._C._is_any_autocast_enabled():
        return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)
    return contextlib.nullcontext()


_autocast_library = torch.library.Library("transformer_fast", "IMPL")


def register_autocast(op, name: str, policy: str, cast_args: tuple = ()):
    """Registers the autocast kernels (CPU and CUDA) of custom op ``op``, named
    ``transformer_fast::<name>``: the args at ``cast_args`` are cast by ``policy`` (see
    autocast_dtype), then the op runs with autocast off, so that no torch op inside a kernel is
    autocast. The public functions apply the same rule before they call the op."""

    def kernel(_keyset, *args):
        cast = autocast_inputs(policy, *(args[i] for i in cast_args)) if cast_args else ()
        args = tuple(cast[cast_args.index(i)] if i in cast_args else a for i, a in enumerate(args))
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return op(*args)

    for key in ("AutocastCPU", "AutocastCUDA"):
        _autocast_library.impl(name, kernel, key, with_keyset=True)


# --------------------------------------------------------------------------------------------
# Calling a custom op
# --------------------------------------------------------------------------------------------
# Both private to torch (present since 2.0); where one is missing, every call takes the op.
_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def _forward_ad_active() -> bool:
    return getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0


def _python_modes_active() -> bool:
    """A TorchDispatchMode (FakeTensorMode, FlopCounterMode, ...) or TorchFunctionMode is on: it
    must see the op, not the ATen calls inside a kernel."""
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)()
    return dispatch_modes > 0 or getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)()


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager_autograd(fn, setup_context, backward):
    """An autograd.Function running ``fn`` with the autograd formula registered on its custom op
    (the same ``setup_context`` and ``backward``), for run_op: in eager mode it records the same
    graph node as the op, for a fifth of the op's Python overhead (~25 us against ~100 us)."""
    class _EagerOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output = fn(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    _EagerOp.__name__ = _EagerOp.__qualname__ = f"{fn.__name__.lstrip('_')}_eager"
    return _EagerOp.apply


def run_op(op, fn, *args, autograd=None, composite=None):
    """Runs custom op ``op`` on ``args``, or, where that computes the same thing for less Python
    overhead, the function ``fn`` it was made from: directly when no autograd graph is recorded,
    or through ``autograd`` (from eager_autograd) when one is. The op's dispatch (autograd
    wrapper, schema checks) costs 30-100 us per call, more than the kernels on small inputs (a
    decoding step, LayerNorm over a few rows; docs/design.md).

    The op itself runs under torch.compile and torch.jit.trace (which must record the op, not
    bake its result into the graph), under Python dispatch or function modes, for tensor
    subclasses and fake tensors, and where an input needs grad but no ``autograd`` is given.
    Inside torch.func transforms (vmap, grad, jvp) and forward-mode AD, which the op's autograd
    formula cannot serve, ``composite`` (the op as differentiable torch code) runs instead.
    Whatever runs, runs with autocast off: the callers have cast the inputs already."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return op(*args)
    if torch._C._is_any_autocast_enabled():
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return _run_op(op, fn, args, autograd, composite)
    return _run_op(op, fn, args, autograd, composite)


def _run_op(op, fn, args, autograd, composite):
    if _functorch_transforms_active() or _forward_ad_active():
        return op(*args) if composite is None else composite(*args)
    if _python_modes_active():
        return op(*args)
    needs_grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN_TENSOR_TYPES:
                return op(*args)
            needs_grad = needs_grad or a.requires_grad
    if needs_grad and torch.is_grad_enabled():
        return op(*args) if autograd is None else autograd(*args)
    return fn(*args)
