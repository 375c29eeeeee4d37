"""How a public function reaches its op.

In plain eager mode, the Python function calls the public op's C++ function directly through its
binding (``transformer_fast._C.<op>``): the same code the dispatcher runs for
``torch.ops.transformer_fast.<op>``, without the boxed call's ~2-3 us. Wherever something must
see the op itself - torch.compile and torch.jit.trace (which record it), a TorchFunctionMode,
tensor subclasses - the call goes through ``torch.ops``. TorchDispatchModes (FakeTensorMode,
FlopCounterMode) see the kernel ops either way.
"""
from __future__ import annotations

import torch

from . import _build

# The fast path's gate: `not dynamo_compiling() and direct(n_tensors, *args)`; what direct checks
# is in csrc/bindings.cpp. Dynamo folds dynamo_compiling() to True, so it never meets the C function.
dynamo_compiling = torch.compiler.is_dynamo_compiling


def _without_extension(n_tensors, *args):
    return False


_C, _ = _build.load()
direct = _C.direct if _C is not None else _without_extension
