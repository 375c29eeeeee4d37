"""Native calls: the CUDA kernels of the Triton attention and norm ops in C++ (csrc/launch/native_calls.cpp).

On a GPU with Triton (unless TRANSFORMER_FAST_NATIVE_LAUNCH=0), `attention_forward`,
`attention_backward`, `layer_norm_forward` and `layer_norm_backward` get one boxed C++ kernel for the
CUDA key. For a call signature it has a recipe for, it makes the call's new tensors, launches the
packed launches (csrc/launch/triton_launch.cpp) with the call's tensors and seed and returns the results,
running no Python. Otherwise it calls `call` below, which runs the op's Python kernel (the Triton
launcher, transformer_fast/_device_kernels.py) and, when asked to record, describes what that call
did as a recipe.

A recipe is sound only for launchers that make every tensor they launch with or return through
kernels/_new_tensors.py's helpers (new_output, new_scratch, contiguous) and change them only by launches:
the attention and norm launchers do. Anything else a call does (a launch that was not packed, a
tensor from elsewhere, a result that is not one of its new tensors or empty) leaves that signature
without a recipe. Linear attention computes part of its results with torch ops, and keeps the
Python kernel.
"""
from __future__ import annotations

import torch

from . import _build
from .kernels import _call_recording, _launch, _new_tensors

OPS = ("attention_forward", "attention_backward", "layer_norm_forward", "layer_norm_backward")
_kernels = {}


def call(name, args, record, seed):
    """The Python kernel of the op `name` ("namespace::name") on `args`: (its results, a recipe for
    the call's signature or None). `seed`: the call's dropout seed (0 for an op without one)."""
    kernel = _kernels[name.split("::")[-1]]
    if not record:
        return tuple(kernel(*args)), None
    with _call_recording.record_call() as rec:
        results = tuple(kernel(*args))
    return results, recipe(rec, args, results, seed)


def _template(t):
    """A tensor of t's dtype and device, for the C++ side's tensor options."""
    return torch.empty(0, dtype=t.dtype, device=t.device)


def recipe(rec, args, results, seed):
    """What the recorded call `rec` did, for csrc/launch/native_calls.cpp's parse_recipe, or None where it
    did anything a recipe cannot describe (module docstring):
      news:     (kind, sizes, template, argument copied, its sizes, its strides), contiguous each;
      launches: (packed launch, [(is new, index)] for each of its tensors);
      results:  (new tensor viewed or -1 for an empty one, sizes, strides, storage offset, template)."""
    if not rec.complete or not rec.launches:
        return None
    by_address = {}  # an argument tensor's address -> its index (the first of those sharing it)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            by_address.setdefault(a.data_ptr(), i)
    news, new_by_address = [], {}
    for kind, t, source in rec.news:
        if not t.is_contiguous() or t.numel() == 0 or t.data_ptr() in new_by_address or t.data_ptr() in by_address:
            return None
        if kind == _call_recording.CallRecording.COPY:
            index = by_address.get(source.data_ptr())
            if index is None or args[index].dtype != source.dtype:  # read from the argument's start, as it is
                return None
            news.append((kind, list(t.shape), _template(t), index, list(source.shape), list(source.stride())))
        else:
            news.append((kind, list(t.shape), _template(t), -1, [], []))
        new_by_address[t.data_ptr()] = len(news) - 1
    launches = []
    for packed, tensors, launch_seed in rec.launches:
        if packed.seed_param >= 0 and launch_seed != seed:
            return None
        refs = []
        for t in tensors:
            address = t.data_ptr()
            if address in new_by_address:
                refs.append((True, new_by_address[address]))
            elif address in by_address:
                refs.append((False, by_address[address]))
            else:
                return None
        launches.append((packed, refs))
    described = []
    for r in results:
        if r.numel() == 0:
            described.append((-1, list(r.shape), list(r.stride()), 0, _template(r)))
            continue
        index = new_by_address.get(r.untyped_storage().data_ptr())
        if index is None or r.dtype != rec.news[index][1].dtype:
            return None
        described.append((index, list(r.shape), list(r.stride()), r.storage_offset(), _template(r)))
    return news, launches, described


def setup(kernels, namespace="transformer_fast", dispatch_key="CUDA"):
    """Makes the ops in `kernels` ({name: Python kernel}) native calls, registered as their kernels
    for `dispatch_key`; the tests and tools make twin ops of another `namespace` native calls for
    the CPU (tests/launch/check_native_calls.py)."""
    _kernels.update(kernels)
    if clear not in _launch._forget_hooks:
        _launch._forget_hooks.append(clear)
    _build.extension().native_calls_setup([f"{namespace}::{name}" for name in kernels], call,
                                          _new_tensors._POISON, dispatch_key)


def clear():
    """Drops every recipe (their packed launches belong to forgotten plans or kernels)."""
    _build.extension().native_calls_clear()
