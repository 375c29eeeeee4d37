"""``convert``: swaps the torch.nn attention, normalisation and Transformer modules of any model
(and Hugging Face transformers' norm modules) for transformer_fast's drop-ins."""
from __future__ import annotations

import copy
import logging
from typing import NamedTuple

from torch import nn

from ..integrations.huggingface_norms import fused_class, is_convertible_norm
from ._drop_in import adopt, check_attention
from .multihead_attention import MultiheadAttention
from .normalization import LayerNorm, RMSNorm
from .transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                          TransformerEncoderLayer)

logger = logging.getLogger("transformer_fast.convert")  # named for the public function, as its docstring says

# torch.nn class -> ours. Only these exact classes are converted: a user subclass may override
# forward, so it is left alone (its children are still visited).
_REPLACEMENTS = {
    nn.Transformer: Transformer,
    nn.TransformerEncoder: TransformerEncoder,
    nn.TransformerDecoder: TransformerDecoder,
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.TransformerDecoderLayer: TransformerDecoderLayer,
    nn.MultiheadAttention: MultiheadAttention,
    nn.LayerNorm: LayerNorm,
    nn.RMSNorm: RMSNorm,
}


class Replacement(NamedTuple):
    """One converted module: its qualified name in the model ("" for the model itself) and the
    class it had and has now."""
    name: str
    old: type
    new: type


def convert(model, attention="softmax", inplace=True, *, return_report=False):
    """Replaces every ``torch.nn`` MultiheadAttention, LayerNorm, RMSNorm, TransformerEncoderLayer,
    TransformerDecoderLayer, TransformerEncoder, TransformerDecoder and Transformer inside
    ``model`` (``model`` itself included) with the transformer_fast drop-in, leaving everything
    else alone. Hugging Face transformers' norm modules of the Llama, T5, Olmo 2, Gemma, Gemma 3n
    and Cohere forms (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``T5LayerNorm``, ``GptOssRMSNorm``,
    ``Gemma3RMSNorm``, ``CohereLayerNorm`` and the other families' copies, recognised by their
    code) are turned into subclasses of their own class that run the fused kernels
    (``transformer_fast.integrations.huggingface_norms`` says which calls, and how the results
    differ: by a rounding in bfloat16 and float16).

    The modules keep their parameters, buffers, hooks, device, dtype and train/eval mode (each is
    turned into the drop-in subclass, which has the same parameter names and state-dict keys).
    Only those exact classes are converted, not user subclasses of them (whose forward may
    differ) nor transformer_fast modules (never converted twice). ``attention`` ("softmax" or
    "linear") is given to every converted attention; "linear" changes the model's function, and is
    refused (ValueError, nothing converted) where a user subclass of ``nn.TransformerEncoderLayer``
    holds a ``self_attn``: torch's inference fast path in its forward would bypass it.

    The conversion is in place: ``model`` itself is returned, its modules keep the same
    ``Parameter`` objects (an optimizer built before the call trains the converted model) and
    nothing is copied. ``inplace=False`` converts a deep copy instead and leaves ``model``
    untouched. Returns the converted model, or ``(model, report)`` with ``return_report=True``,
    where ``report`` lists a ``Replacement(name, old, new)`` per converted module (nested ones
    included, in module order). The same list is logged at INFO level on the ``transformer_fast.convert`` logger.
    """
    check_attention(attention)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if attention == "linear":
        _check_no_fast_path_bypass(model)
    if not inplace:
        model = copy.deepcopy(model)
    modules = list(model.named_modules())
    before = [type(module) for _, module in modules]
    for _, module in modules:  # pre-order: a converted stack converts its own layers first
        cls = _REPLACEMENTS.get(type(module))
        if cls is None:
            if is_convertible_norm(module):
                adopt(module, fused_class(type(module)))
            continue
        if hasattr(cls, "from_torch"):
            cls.from_torch(module, attention)
        else:
            adopt(module, cls)
    report = [Replacement(name, old, type(module)) for (name, module), old in zip(modules, before)
              if type(module) is not old]
    for item in report:
        logger.info("transformer_fast.convert: %s: %s.%s -> %s.%s", item.name or "<model>", item.old.__module__,
                    item.old.__qualname__, item.new.__module__, item.new.__qualname__)
    return (model, report) if return_report else model


def _check_no_fast_path_bypass(model):
    """A user subclass of torch.nn.TransformerEncoderLayer is left as it is, but its self_attn would
    become linear attention, which torch's inference fast path (eval mode, no grad) bypasses: it
    reads self_attn's weights and computes softmax attention. Refused, before anything changes."""
    for name, module in model.named_modules():
        if (isinstance(module, nn.TransformerEncoderLayer) and type(module) is not nn.TransformerEncoderLayer
                and not isinstance(module, TransformerEncoderLayer)
                and isinstance(getattr(module, "self_attn", None), nn.MultiheadAttention)):
            raise ValueError(
                f"convert(attention='linear'): {name or 'the model'} is a {type(module).__qualname__}, a subclass of "
                f"torch.nn.TransformerEncoderLayer, which convert leaves as it is; its forward's inference fast "
                f"path would bypass the linear attention given to its self_attn and compute softmax attention. "
                f"Build it from torch.nn.TransformerEncoderLayer or transformer_fast.TransformerEncoderLayer")
