"""Hugging Face ``transformers``' RMSNorm modules, run by the fused RMSNorm kernel (``convert``).

transformers defines one RMSNorm class per model family (``LlamaRMSNorm``, ``Qwen3RMSNorm``,
``T5LayerNorm``, ``Gemma3RMSNorm``, ... about 160 of them), most of them copies of three forwards:

    Llama's: y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
    T5's:    the same where x and weight have one dtype (they differ only in the output dtype
             of mixed-dtype calls)
    Gemma's: y = (x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).to(x.dtype)

A module is recognised by its class's ``forward`` (and for Gemma's form, ``_norm``) having the
code of one of those, compared with copies kept here (``_llama_forward``, ...): bytecode,
constants and names, so class names, comments and line numbers do not matter, and a family whose
forward differs in any way (Cohere's mean subtraction, gated norms, Gemma 3n's optional scale) is
not taken. It must also hold a 1-D ``weight`` parameter and a number epsilon
(``variance_epsilon``, Gemma's ``eps``), and have no ``forward`` of its own on the instance (as
accelerate's hooks install). transformers is never imported: the comparison needs only the modules.

``convert`` turns such a module into a subclass of its own class (so ``isinstance`` checks and
the state dict are unchanged) whose forward calls ``rms_norm`` where the result is the same
function: a plain tensor (not a subclass such as DTensor, whose dispatch has no rule for our op)
in float32, bfloat16 or float16, a weight as long as the last dim and of the input's dtype (Llama's
and T5's forms; Gemma's computes ``1 + weight`` in float32 whatever its dtype), and no autocast for
a low-precision input (our op follows torch's autocast rule for norms, which on CUDA would change
the output dtype). Any other call runs the original forward; under torch.compile a plain tensor
is still one, so the fused op is traced.
The fused kernel rounds once (``x * rstd * weight`` in float32, then to the input dtype): Gemma's
form exactly as transformers computes it; for Llama's and T5's, transformers rounds the
normalised input before multiplying by the weight, so bfloat16 and float16 results differ from
transformers' by a rounding, closer to exact.
"""
from __future__ import annotations

import functools

import torch

from ..layer_norm import rms_norm
from ..modules import _NotScriptable

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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


def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _fused_weight_as_is(self, hidden_states):
    weight = self._parameters["weight"]
    if (type(hidden_states) is torch.Tensor and weight is not None and hidden_states.dtype is weight.dtype
            and hidden_states.dtype in _KERNEL_DTYPES and hidden_states.shape[-1:] == weight.shape
            and (hidden_states.dtype is torch.float32 or not _any_autocast())):
        return rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
    return self._transformers_forward(hidden_states)


def _fused_one_plus_weight(self, x):
    weight = self._parameters["weight"]
    if (type(x) is torch.Tensor and weight is not None and x.dtype in _KERNEL_DTYPES and x.shape[-1:] == weight.shape
            and (x.dtype is torch.float32 or not _any_autocast())):
        return rms_norm(x, weight.shape, 1.0 + weight.float(), self.eps)
    return self._transformers_forward(x)


def _code_key(function):
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    # the flags below 0x400 say what kind of function it is (generator, varargs, ...); the higher
    # ones are the defining module's `from __future__` imports
    return code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_argcount, code.co_flags & 0x3FF


# forward's code -> (the methods it calls and their code, the epsilon's attribute, the fused forward)
_FORMS = {
    _code_key(_llama_forward): ((), "variance_epsilon", _fused_weight_as_is),
    _code_key(_t5_forward): ((), "variance_epsilon", _fused_weight_as_is),
    _code_key(_gemma_forward): ((("_norm", _code_key(_gemma_norm)),), "eps", _fused_one_plus_weight),
}
FUSED_FORWARDS = (_fused_weight_as_is, _fused_one_plus_weight)


def _form(cls):
    form = _FORMS.get(_code_key(getattr(cls, "forward", None)))
    if form is None or any(_code_key(getattr(cls, name, None)) != key for name, key in form[0]):
        return None
    return form


def is_rms_norm(module) -> bool:
    """Whether ``module`` is a transformers RMSNorm that ``convert`` can run fused (module doc)."""
    form = _form(type(module))
    if form is None:
        return False
    weight = module._parameters.get("weight")
    eps = module.__dict__.get(form[1])
    return ("forward" not in module.__dict__ and weight is not None and weight.dim() == 1
            and isinstance(eps, (int, float)) and not isinstance(eps, bool))


def _reduce_ex(self, protocol):
    # pickles (and deep-copies) as an instance made by _new_fused from transformers' class, which
    # pickle finds by name (this subclass is made at run time and has no importable name)
    reduced = object.__reduce_ex__(self, protocol)
    return (_new_fused, (self._transformers_class,), *reduced[2:])


def _new_fused(transformers_class):
    return object.__new__(fused_class(transformers_class))


@functools.lru_cache(maxsize=None)
def fused_class(transformers_class):
    """The subclass of ``transformers_class`` (a recognised RMSNorm class) whose forward runs the
    fused kernel; made once per class, with the same name."""
    return type(transformers_class.__name__, (_NotScriptable, transformers_class), {
        "__module__": __name__,
        "__qualname__": transformers_class.__qualname__,
        "__doc__": f"{transformers_class.__module__}.{transformers_class.__qualname__} running transformer_fast's "
                   f"fused RMSNorm kernel (transformer_fast.integrations.huggingface_norms).",
        "forward": _form(transformers_class)[2],
        "_transformers_class": transformers_class,
        "_transformers_forward": transformers_class.forward,
        "__reduce_ex__": _reduce_ex,
    })
