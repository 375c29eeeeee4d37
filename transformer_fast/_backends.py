"""Which backend runs a kernel.

Backends:
  * ``triton``    - the kernels in ``transformer_fast.kernels`` (CUDA tensors; CPU tensors only
                    under ``TRITON_INTERPRET=1``, which is how CI tests them);
  * ``cpp``       - the C++ extension ``transformer_fast._C`` (CPU tensors; CUDA tensors for the
                    families it has CUDA kernels for, where torch has CUDA: attention);
  * ``reference`` - the plain-torch kernels of ``transformer_fast._plain_torch`` (anything).

Normally torch's dispatcher chooses, by device: the op's CPU kernel is C++; its CUDA kernel is
Triton where Triton loads, else the C++ CUDA kernel (attention) or plain torch; any other device
runs plain torch (``register_device_kernels``). ``backend=`` and ``TRANSFORMER_FAST_BACKEND``
override that for tests and debugging: ``explicit_backend`` says when a call must run another
backend than the dispatcher's, and ``named`` runs the ops with it, below their autograd node
(csrc/ops/named_backend.h). float64 always takes the plain-torch backend: the compiled kernels
are fp32/bf16/fp16.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from . import _build

BACKENDS = ("triton", "cpp", "reference")
ENV_BACKEND = "TRANSFORMER_FAST_BACKEND"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FAMILIES = ("attention", "layer_norm", "linear_attention")


@functools.lru_cache(maxsize=None)
def load_triton():
    """(the transformer_fast.kernels package, None) or (None, the reason it does not load)."""
    try:
        import triton  # noqa: F401

        return importlib.import_module("transformer_fast.kernels"), None
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(exc).__name__}: {exc}"


def triton_interpreting() -> bool:
    """Whether the Triton kernels run under the interpreter (TRITON_INTERPRET=1 when they load)."""
    module, reason = load_triton()
    return reason is None and module.interpreting()


_FAMILIES_WITH_PRODUCTS = ("attention", "linear_attention")  # their Triton kernels use tl.dot


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result (torch.compile evaluates ``fn`` at trace time: no
    graph break) without the 2.3 s import of torch._dynamo that it costs at import: it only sets
    this attribute (tests/test_foundation.py checks that the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


def _cuda_families():
    module, _ = _build.load()
    return module.cuda_families() if module is not None else []


@_assume_constant_result
def unavailable_reason(backend: str, device: torch.device | None, dtype: torch.dtype | None = None,
                       family: str | None = None) -> str | None:
    """Why ``backend`` cannot run kernel family ``family`` on ``device``/``dtype`` (None: it can).
    None asks about any device or dtype; family None about every family."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend == "reference":
        return None
    if dtype is not None and dtype not in KERNEL_DTYPES:
        return f"it has no {dtype} kernels (supported: {', '.join(str(d) for d in KERNEL_DTYPES)})"
    if backend == "triton":
        _, reason = load_triton()
        if reason is not None:
            return reason
        if device is None:
            return None if (torch.cuda.is_available() or triton_interpreting()) else \
                "no CUDA device, and TRITON_INTERPRET=1 is not set"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpreting():
            if dtype == torch.bfloat16 and family in _FAMILIES_WITH_PRODUCTS:
                return ("Triton's interpreter multiplies the raw bits of bfloat16 tl.dot operands "
                        "(triton-lang/triton#11584), so these kernels' bfloat16 results would be wrong "
                        "under TRITON_INTERPRET=1; use float16 or float32 there, or backend='cpp'")
            if dtype == torch.bfloat16:
                return ("Triton's interpreter converts float32 to bfloat16 toward zero where a GPU rounds "
                        "to nearest, so these kernels' bfloat16 results would be up to an ulp off (errors "
                        "10x torch's) under TRITON_INTERPRET=1; use float16 or float32 there, or backend='cpp'")
            return None
        return f"Triton runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device.type}"
    _, reason = _build.load()
    if reason is not None:
        return reason
    if device is None or device.type == "cpu":
        return None
    cuda_families = _cuda_families()
    if device.type == "cuda" and family in cuda_families:
        return None
    return (f"the C++ extension runs {family or 'every kernel family'} on CPU tensors only (CUDA kernels: "
            f"{', '.join(cuda_families) or 'none in this build'}), got {device.type} tensors")


DEVICE_TYPES = ("cpu", "cuda")


def _device_status(backend: str, device_type: str) -> str:
    if device_type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False)"
    device = torch.device(device_type)
    reasons = {family: unavailable_reason(backend, device, None, family) for family in FAMILIES}
    if all(reason is None for reason in reasons.values()):
        return "ok"
    served = [family for family, reason in reasons.items() if reason is None]
    if not served:
        return next(iter(reasons.values()))
    others = [family for family in FAMILIES if family not in served]
    return f"ok for {', '.join(served)} only; {', '.join(others)}: {reasons[others[0]]}"


def available_backends() -> dict:
    """Which backend runs on which device here: {backend: {"cpu": status, "cuda": status}}, a
    status being "ok" (every kernel family runs on that device's tensors) or why it does not (for
    a backend serving some families only: "ok for <families> only; <the others>: <why>"). The
    Triton backend is "ok" on CPU tensors under TRITON_INTERPRET=1, where its bfloat16 kernels
    are refused (the interpreter's bfloat16 arithmetic is wrong; the error says so)."""
    return {name: {device: _device_status(name, device) for device in DEVICE_TYPES} for name in BACKENDS}


def _triton_on_cuda() -> bool:
    return load_triton()[1] is None and not triton_interpreting()


def dispatcher_backend(device_type: str, family: str) -> str:
    """The backend whose kernel torch's dispatcher runs for ``family`` on ``device_type``."""
    if device_type == "cpu":
        return "cpp"
    if device_type == "cuda":
        if _triton_on_cuda():
            return "triton"
        return "cpp" if family in _cuda_families() else "reference"
    return "reference"


def requested_backend(backend: str) -> str:
    """``backend``, with "auto" (or None) resolved through TRANSFORMER_FAST_BACKEND."""
    if backend is None or backend == "auto":
        return os.environ.get(ENV_BACKEND) or "auto"
    return backend


def explicit_backend(backend: str, device: torch.device, dtype: torch.dtype, family: str) -> str | None:
    """The backend a call must run outside the dispatcher, or None where the dispatcher's kernel is
    the one asked for. A requested backend that cannot run raises RuntimeError with the reason."""
    backend = requested_backend(backend)
    if backend == "auto":
        return None if dtype in KERNEL_DTYPES else "reference"
    reason = unavailable_reason(backend, device, dtype, family)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} is unavailable for {dtype} {device.type} tensors: {reason}")
    return None if backend == dispatcher_backend(device.type, family) else backend


class _Named:
    """The context of ``named``: the calling thread's named backend set, and restored on exit."""
    __slots__ = ("code", "previous")

    def __init__(self, code):
        self.code = code

    def __enter__(self):
        self.previous = _build.extension().exchange_named_backend(self.code)

    def __exit__(self, *exc):
        _build.extension().exchange_named_backend(self.previous)


_DISPATCHER = contextlib.nullcontext()


def named(backend: str | None):
    """A context in which the kernel ops run ``backend``'s kernels (None: the dispatcher's, and no
    context at all, which torch.compile traces through)."""
    return _DISPATCHER if backend is None else _Named(1 + BACKENDS.index(backend))


def select_backend(device: torch.device, dtype: torch.dtype, requested: str | None = "auto",
                   family: str | None = None) -> str:
    """The backend that runs ``family`` for a call with ``requested`` on ``dtype`` ``device`` tensors."""
    explicit = explicit_backend(requested, device, dtype, family)
    return dispatcher_backend(device.type, family) if explicit is None else explicit


@functools.lru_cache(maxsize=None)
def kernel(name: str, backend: str, device_type: str = "cpu"):
    """The kernel-level function ``name`` ("attention_forward", ...) of ``backend`` (for the C++
    backend, its kernel for ``device_type``)."""
    if backend == "cpp":
        return getattr(_build.extension(), name + ("_cuda" if device_type == "cuda" else ""))
    if backend == "triton":
        module, reason = load_triton()
        if module is None:
            raise RuntimeError(f"the Triton backend is unavailable: {reason}")
        family = name.rsplit("_", 1)[0]
        return getattr(importlib.import_module(f"transformer_fast.kernels.{family}"), name)
    if backend == "reference":
        from . import _plain_torch

        return getattr(_plain_torch, name)
    raise ValueError(f"unknown backend {backend!r}")
