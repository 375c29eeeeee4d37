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
does), ``softcap`` and attention sinks (``s_aux``), which raise ValueError, paged caches.
"""
from __future__ import annotations

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


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention-function signature: query (B, H, Lq, D), key/value (B, Hkv, Lk, D),
    attention_mask None, or broadcasting to (B, H, Lq, Lk), bool (True = attend) or float (added).
    Returns (output (B, Lq, H, Dv), None)."""
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attn_implementation={NAME!r} does not support {unsupported}; use 'eager'")
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
    ``name``, so that ``attn_implementation=name`` selects it. Safe to call more than once."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("transformer_fast.integrations.huggingface needs the `transformers` package "
                          "(pip install transformers)") from exc
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53 builds masks itself for any registered attention
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
