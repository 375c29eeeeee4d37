"""Hugging Face ``transformers`` integration: ``attn_implementation="transformer_fast"``.

    import transformer_fast.integrations.huggingface as tf_hf
    tf_hf.register()
    model = AutoModel.from_config(config, attn_implementation="transformer_fast")

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and, where the
installed transformers has one (>= 4.53), transformers' SDPA mask builder to its
``AttentionMaskInterface`` under the same name: the masks it builds are 4-D bool (True = attend),
the kernel's own convention, and are None whenever ``is_causal`` alone describes the mask.
transformers is imported only by this module, never by ``import transformer_fast``.

Supported: everything the ``sdpa`` implementation does with plain masks (padding, causal,
bidirectional, grouped-query attention, a float ``position_bias`` as in T5), dropout in training.
Not supported: ``output_attentions=True`` (there are no weights; None is returned, as ``sdpa``
does), ``softcap`` and attention sinks (``s_aux``), which raise ValueError, paged caches,
padding-free (packed) inputs.

Only models that support ``sdpa`` through ``AttentionInterface`` can be served (``supports_model``):
any other model would run its own attention code on the masks built for this implementation
(bool masks, or None for "causal"), which it misreads (BLOOM, XGLM lose the causal mask; ConvBERT,
MPNet ignore padding), or rely on masks or options sdpa does not have. ``register()`` therefore
also makes building such a model with this implementation (``from_config``, ``from_pretrained``,
the constructor, ``set_attn_implementation``) raise a ValueError that names the model class and
the implementation to use instead. docs/huggingface_families.md lists every family transformers
ships and its status.
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
import warnings

import torch

from ..attention import scaled_dot_product_attention

NAME = "transformer_fast"


def _position_bias_mask(position_bias, attention_mask, is_causal, q_len, k_len):
    """The float mask ``position_bias`` combined with ``attention_mask`` or the causal mask (what
    transformers' sdpa path does for T5-style biases)."""
    if attention_mask is None:
        if not is_causal:
            return position_bias
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=position_bias.device).tril()
        return position_bias.masked_fill(~causal, torch.finfo(position_bias.dtype).min)
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, torch.finfo(position_bias.dtype).min)
    return position_bias + attention_mask


def supports_model(model) -> bool:
    """Whether ``model`` (a transformers ``PreTrainedModel`` or its class) can run on this
    implementation, as transformers tells: the model supports ``sdpa`` (``_supports_sdpa``), whose
    masks (``sdpa_mask``: bool, or None where ``is_causal`` alone describes them) and reading of
    ``is_causal`` this implementation shares, and its attention goes through ``AttentionInterface``
    (its module dispatches through ``ALL_ATTENTION_FUNCTIONS``, the check behind transformers'
    ``set_attn_implementation``, and picks no attention classes by implementation name).
    A model that refuses sdpa may rely on masks sdpa does not build (PEGASUS-X's decoder
    self-attention declares ``is_causal=False`` and needs an explicit causal mask) or on options it
    does not have (Gemma 2's soft-capping)."""
    cls = model if isinstance(model, type) else type(model)
    if getattr(cls, "_supports_sdpa", False) is not True:  # a property (old composite models): unknown
        return False
    if _picks_attention_classes_by_name(cls):
        return False
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    return bool(can_set()) if can_set is not None else getattr(cls, "_supports_attention_backend", False) is True


@functools.lru_cache(maxsize=None)
def _picks_attention_classes_by_name(cls) -> bool:
    """Whether the module defining ``cls`` picks attention classes from a table keyed by the
    implementation name (``SAM_VISION_ATTENTION_CLASSES[config._attn_implementation]``), which
    knows only transformers' own implementations, though the module may also use the interface."""
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return False
    return re.search(r"_ATTENTION_CLASSES\s*\[", source) is not None


def unsupported_model_message(model, name: str = NAME) -> str:
    cls = model if isinstance(model, type) else type(model)
    if getattr(cls, "_supports_sdpa", False) is not True:
        why, instead = f"the model does not support 'sdpa', and {name!r} builds and reads masks as 'sdpa' does", "eager"
    else:
        why = (f"its attention does not go through transformers' AttentionInterface (it would run its own attention "
               f"code on masks built for {name!r} and misread them)")
        instead = "sdpa"
    return f"{cls.__name__} does not support attn_implementation={name!r}: {why}. Use attn_implementation={instead!r}."


def _refusing_unsupported_models(choose, names):
    """Wraps transformers' method that settles a model's attention implementation (called by
    ``PreTrainedModel.__init__`` and ``set_attn_implementation``) so that it raises for a model
    ``supports_model`` rejects when the implementation settled on is one of ``names``."""
    @functools.wraps(choose)
    def checked(self, *args, **kwargs):
        implementation = choose(self, *args, **kwargs)
        if implementation in names and not supports_model(self):
            raise ValueError(unsupported_model_message(self, implementation))
        return implementation

    checked._transformer_fast_names = names
    return checked


def _install_construction_check(name):
    from transformers import PreTrainedModel
    # Recent transformers settle the implementation in get_correct_attn_implementation (also called
    # for each sub-model by set_attn_implementation); older ones in _check_and_adjust_attn_implementation.
    for method in ("get_correct_attn_implementation", "_check_and_adjust_attn_implementation"):
        choose = PreTrainedModel.__dict__.get(method)
        if not inspect.isfunction(choose):  # absent, or not a plain method in this version
            continue
        names = getattr(choose, "_transformer_fast_names", None)
        if names is None:
            names = set()
            setattr(PreTrainedModel, method, _refusing_unsupported_models(choose, names))
        names.add(name)
        return True
    return False


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention-function signature: query (B, H, Lq, D), key/value (B, Hkv, Lk, D),
    attention_mask None, or broadcasting to (B, H, Lq, Lk), bool (True = attend) or float (added).
    Returns (output (B, Lq, H, Dv), None)."""
    for unsupported, what in (("softcap", "attention logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{type(module).__name__}: attn_implementation={NAME!r} does not support "
                             f"{unsupported} ({what}); use attn_implementation='eager'")
    q_len, k_len = query.shape[2], key.shape[2]
    # As transformers' sdpa: the module's causality counts only when no mask says otherwise.
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if position_bias is not None:
        attention_mask = _position_bias_mask(position_bias, attention_mask, is_causal, q_len, k_len)
        is_causal = False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    if attention_mask is not None and attention_mask.dim() == 2:  # a (B, Lk) padding mask, 1 = attend
        attention_mask = attention_mask.bool()[:, None, None, :]
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=float(dropout),
                                       is_causal=is_causal, scale=scaling,
                                       enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME):
    """Registers ``attention_forward`` (and the matching mask function) with transformers under
    ``name``, so that ``attn_implementation=name`` selects it, and makes building a model that
    ``supports_model`` rejects with it raise ValueError. Safe to call more than once."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("transformer_fast.integrations.huggingface needs the `transformers` package "
                          "(pip install transformers)") from exc
    AttentionInterface.register(name, attention_forward)
    if not _install_construction_check(name):
        warnings.warn(f"this transformers version offers no place to check models when they are built: {name!r} "
                      f"does not refuse the models it cannot serve; check them with "
                      f"transformer_fast.integrations.huggingface.supports_model", stacklevel=2)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53 builds masks itself for any registered attention
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
