"""Hugging Face ``transformers``' norm modules, run by the fused LayerNorm/RMSNorm kernel (``convert``).

transformers defines one RMSNorm class per model family (``LlamaRMSNorm``, ``Qwen3RMSNorm``,
``T5LayerNorm``, ``Gemma3RMSNorm``, ``GptOssRMSNorm``, ... about 180 of them), most of them copies
of five forwards (n = x.float() * rsqrt(mean(x.float()^2) + eps), the input normalised in float32):

    Llama's:    y = weight * n.to(x.dtype)
    T5's:       the same where x and weight have one dtype (they differ only in the output dtype
                of mixed-dtype calls)
    Olmo 2's:   y = (weight * n).to(x.dtype)                  (also GPT-OSS, Olmo 3, DeepSeek V4)
    Gemma's:    y = (n * (1 + weight.float())).to(x.dtype)     (Gemma 1-3, Qwen3-Next, Qwen3.5)
    Gemma 3n's: y = (n * weight.float()).to(x.dtype), or n.to(x.dtype) without a scale (Gemma 4);
                its epsilon is ``eps`` before transformers 5.25, ``variance_epsilon`` since

and Cohere's LayerNorm without bias, y = (weight.float() * LN(x.float())).to(x.dtype) (Cohere,
Cohere 2), which runs the LayerNorm kernel.

A module is recognised by its class's ``forward`` (and ``_norm``, for the Gemma forms) having the
code of one of those, compared with copies kept here (``_llama_forward``, ...): bytecode,
constants and names, so class names, comments and line numbers do not matter, and a family whose
forward differs in any way (gated norms) is not taken. It must also hold a 1-D ``weight``
parameter (Gemma 3n's form: where ``with_scale``) and a number epsilon
(``variance_epsilon``, or ``eps`` where the form's code reads that), and have no ``forward`` of its own on the instance (as
accelerate's hooks install). transformers is never imported: the comparison needs only the modules.

``convert`` turns such a module into a subclass of its own class (so ``isinstance`` checks and
the state dict are unchanged) whose forward calls ``rms_norm`` (Cohere's: ``layer_norm``) where
the result is the same function: a plain tensor (not a subclass such as DTensor, whose dispatch
has no rule for our ops), a weight as long as the last dim (in Llama's and T5's forms, of the
input's dtype), and no autocast for a low-precision input (our ops follow torch's autocast rule
for norms, which on CUDA would change the output dtype). Any other call runs the original
forward; under torch.compile a plain tensor is still one, so the fused op is traced. A float64
input is normalised in float64 (by the plain-torch backend, as every function of the package
takes float64), where transformers' forward computes in float32 and returns float64: a converted
model in float64 is float64-accurate. The fused kernels compute ``n * weight`` in float32 and
round once to the input dtype: the Olmo 2, Gemma and Cohere forms as transformers computes them
(up to float32 rounding); in Llama's and T5's, transformers rounds n before multiplying by the
weight, so bfloat16 and float16 results differ from transformers' by a rounding, closer to exact.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .._backends import KERNEL_DTYPES
from ..layer_norm import layer_norm, rms_norm
from ..nn._drop_in import NotScriptable

_DTYPES = (*KERNEL_DTYPES, torch.float64)  # float64 through the plain-torch backend
_FULL_PRECISION = (torch.float32, torch.float64)
_any_autocast = torch._C._is_any_autocast_enabled


# The forwards as transformers writes them (the code is what is compared, not the text).
def _llama_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _t5_forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states


def _olmo2_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _gemma3n_norm(self, hidden_states):  # transformers < 5.25
    mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
    return hidden_states * torch.pow(mean_squared, -0.5)


def _gemma3n_norm_variance_epsilon(self, hidden_states):  # transformers >= 5.25 names the epsilon so
    mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon
    return hidden_states * torch.pow(mean_squared, -0.5)


def _gemma3n_forward(self, hidden_states):
    normed_output = self._norm(hidden_states.float())
    if self.with_scale:
        normed_output = normed_output * self.weight.float()
    return normed_output.type_as(hidden_states)


def _cohere_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    mean = hidden_states.mean(-1, keepdim=True)
    variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
    hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight.to(torch.float32) * hidden_states
    return hidden_states.to(input_dtype)


def _served(x, weight):
    """Whether the kernel computes what transformers' forward does for input x: a plain floating
    tensor, the weight (if any) as long as its last dim, no autocast for a low-precision x."""
    return (type(x) is torch.Tensor and x.dtype in _DTYPES and x.dim() > 0
            and (weight is None or x.shape[-1:] == weight.shape)
            and (x.dtype in _FULL_PRECISION or not _any_autocast()))


def _product_dtype(dtype):
    """The precision the kernel normalises an input of `dtype` in."""
    return torch.float64 if dtype is torch.float64 else torch.float32


def _widened(weight, dtype):
    """The weight as the kernel multiplies by it: as it is where of the input's dtype or, for a
    low-precision input, float32 (the kernel widens it exactly); else converted to the product's
    precision."""
    if weight.dtype is dtype or weight.dtype is _product_dtype(dtype):
        return weight
    return weight.to(_product_dtype(dtype))


def _fused_llama(self, hidden_states):
    weight = self._parameters["weight"]
    if weight is not None and hidden_states.dtype is weight.dtype and _served(hidden_states, weight):
        return rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
    return self._transformers_forward(hidden_states)


def _fused_olmo2(self, hidden_states):
    weight = self._parameters["weight"]
    if weight is not None and _served(hidden_states, weight):
        return rms_norm(hidden_states, weight.shape, _widened(weight, hidden_states.dtype), self.variance_epsilon)
    return self._transformers_forward(hidden_states)


def _fused_gemma(self, x):
    weight = self._parameters["weight"]
    if weight is not None and _served(x, weight):
        return rms_norm(x, weight.shape, 1.0 + weight.to(_product_dtype(x.dtype)), self.eps)
    return self._transformers_forward(x)


def _fused_gemma3n(self, hidden_states):
    weight = self._parameters.get("weight") if self.with_scale else None
    if (weight is not None or not self.with_scale) and _served(hidden_states, weight):
        scale = None if weight is None else _widened(weight, hidden_states.dtype)
        return rms_norm(hidden_states, hidden_states.shape[-1:], scale, getattr(self, self._epsilon_attribute))
    return self._transformers_forward(hidden_states)


def _fused_cohere(self, hidden_states):
    weight = self._parameters["weight"]
    if weight is not None and _served(hidden_states, weight):  # a per-head (2-D) weight is not the last dim's
        return layer_norm(hidden_states, weight.shape, _widened(weight, hidden_states.dtype), None,
                          self.variance_epsilon)
    return self._transformers_forward(hidden_states)


def _code_key(function):
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    # the flags below 0x400 say what kind of function it is (generator, varargs, ...); the higher
    # ones are the defining module's `from __future__` imports
    return code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_argcount, code.co_flags & 0x3FF


class _Form(NamedTuple):
    methods: tuple  # (name, code key) of each method the forward calls
    eps: str  # the epsilon's attribute
    fused: Callable
    scale_optional: bool = False  # the weight exists where `with_scale` is True


_FORMS = {  # forward's code -> its forms (one per code of the methods it calls)
    _code_key(_llama_forward): (_Form((), "variance_epsilon", _fused_llama),),
    _code_key(_t5_forward): (_Form((), "variance_epsilon", _fused_llama),),
    _code_key(_olmo2_forward): (_Form((), "variance_epsilon", _fused_olmo2),),
    _code_key(_gemma_forward): (_Form((("_norm", _code_key(_gemma_norm)),), "eps", _fused_gemma),),
    _code_key(_gemma3n_forward): (
        _Form((("_norm", _code_key(_gemma3n_norm)),), "eps", _fused_gemma3n, True),
        _Form((("_norm", _code_key(_gemma3n_norm_variance_epsilon)),), "variance_epsilon", _fused_gemma3n, True),
    ),
    _code_key(_cohere_forward): (_Form((), "variance_epsilon", _fused_cohere),),
}
FUSED_FORWARDS = tuple({form.fused for forms in _FORMS.values() for form in forms})


def _form(cls):
    for form in _FORMS.get(_code_key(getattr(cls, "forward", None)), ()):
        if all(_code_key(getattr(cls, name, None)) == key for name, key in form.methods):
            return form
    return None


def is_convertible_norm(module) -> bool:
    """Whether ``module`` is a transformers norm that ``convert`` can run fused (module doc)."""
    form = _form(type(module))
    if form is None or "forward" in module.__dict__:
        return False
    eps = module.__dict__.get(form.eps)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return False
    with_scale = module.__dict__.get("with_scale", True) if form.scale_optional else True
    if not isinstance(with_scale, bool):
        return False
    weight = module._parameters.get("weight")
    return (weight is not None and weight.dim() == 1) if with_scale else True


def _reduce_ex(self, protocol):
    # pickles (and deep-copies) as an instance made by _new_fused from transformers' class, which
    # pickle finds by name (this subclass is made at run time and has no importable name)
    reduced = object.__reduce_ex__(self, protocol)
    return (_new_fused, (self._transformers_class,), *reduced[2:])


def _new_fused(transformers_class):
    return object.__new__(fused_class(transformers_class))


@functools.lru_cache(maxsize=None)
def fused_class(transformers_class):
    """The subclass of ``transformers_class`` (a recognised norm class) whose forward runs the
    fused kernel; made once per class, with the same name."""
    return type(transformers_class.__name__, (NotScriptable, transformers_class), {
        "__module__": __name__,
        "__qualname__": transformers_class.__qualname__,
        "__doc__": f"{transformers_class.__module__}.{transformers_class.__qualname__} running transformer_fast's "
                   f"fused norm kernel (transformer_fast.integrations.huggingface_norms).",
        "forward": _form(transformers_class).fused,
        "_epsilon_attribute": _form(transformers_class).eps,
        "_transformers_class": transformers_class,
        "_transformers_forward": transformers_class.forward,
        "__reduce_ex__": _reduce_ex,
    })
