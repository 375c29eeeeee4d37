"""How a public function reaches its op.

In plain eager mode, the Python function calls the public op's C++ function directly through its
binding (``transformer_fast._C.<op>``): the same code the dispatcher runs for
``torch.ops.transformer_fast.<op>``, without the boxed call's ~2-3 us. Wherever something must
see the op itself - torch.compile and torch.jit.trace (which record it), a TorchFunctionMode,
tensor subclasses - the call goes through ``torch.ops``. TorchDispatchModes (FakeTensorMode,
FlopCounterMode) see the kernel ops either way.
"""
from __future__ import annotations

import os

import torch

from ._backends import ENV_BACKEND as _ENV_BACKEND

TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # plain tensors: no __torch_function__ of their own
TENSOR_OR_NONE = TENSORS | {type(None)}

_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_torch_function_mode = torch._C._is_torch_function_mode_enabled


_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
# `name in os.environ` encodes the name on every call (~1 us); the encoded key is looked up in
# the mapping os.environ keeps in sync with the environment (~0.05 us).
_environ_data = getattr(os.environ, "_data", os.environ)
_env_key = os.environ.encodekey(_ENV_BACKEND) if hasattr(os.environ, "encodekey") else _ENV_BACKEND


def direct() -> bool:
    """Whether a call with backend "auto" on plain tensors of a kernel dtype may take the binding:
    no torch.compile, jit.trace, TorchFunctionMode, torch.func transform or forward-mode AD is
    active, and TRANSFORMER_FAST_BACKEND does not name a backend."""
    return not (_is_compiling() or _is_tracing() or _torch_function_mode() or _functorch_active()
                or _forward_ad._current_level >= 0 or _env_key in _environ_data)


def check_tensors(**tensors):
    """TypeError naming the first argument that is not a tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
