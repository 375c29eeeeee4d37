"""Drop-in replacements for the ``torch.nn`` Transformer classes (the encoder and decoder layers,
their stacks and ``Transformer``), built on ``MultiheadAttention`` (``multihead_attention.py``)
and the fused ``LayerNorm`` (``normalization.py``).

Each class subclasses its ``torch.nn`` counterpart: same constructor (plus ``attention=``, passed
to their attentions), same parameter names and state-dict keys (state dicts load both ways with
``strict=True``), same forward signature and results. The layers use
``transformer_fast.LayerNorm`` with the residual add fused into it: post-norm computes
``norm(x + sublayer(x))`` in one kernel, and pre-norm stacks (``norm_first=True``) carry
``(sublayer_output, residual)`` pairs so that each norm adds the residual and returns both the
normalised input and the new residual stream, across layers within a
``TransformerEncoder``/``TransformerDecoder``.

Where torch's machinery or user code would see the difference, the modules do what torch does: a
norm with hooks (or an overridden forward) is called as torch calls it, on the sum, and a stack
calls a pre-norm layer as a module (unchained) where the layer has hooks or overrides ``forward``.
A stack calls layers that are not ours with torch's arguments (by keyword; the encoder's masks in
torch's canonical float form).

Differences from torch: ``TransformerEncoder`` never converts to nested tensors
(``enable_nested_tensor`` is accepted and ignored), so in eval mode under ``torch.no_grad`` the
outputs at padded positions are computed like every other position (torch's nested fast path
returns 0 there).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ._drop_in import NotScriptable, adopt, calls_forward_alone, check_attention
from .multihead_attention import adopt_attention
from .normalization import adopt_norm, norm_add

__all__ = ["TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
           "Transformer"]


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------
class TransformerEncoderLayer(NotScriptable, nn.TransformerEncoderLayer):
    """Drop-in ``torch.nn.TransformerEncoderLayer`` (same arguments, parameters and forward) built
    on our MultiheadAttention and fused LayerNorm; ``attention=`` is passed to the attention."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu, layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, bias=True, device=None, dtype=None, *, attention="softmax"):
        check_attention(attention)
        super().__init__(d_model, nhead, dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                         layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first, bias=bias,
                         device=device, dtype=dtype)
        self._adopt_children(attention)

    def _adopt_children(self, attention):
        adopt_attention(self.self_attn, attention)
        self.norm1, self.norm2 = adopt_norm(self.norm1), adopt_norm(self.norm2)

    @classmethod
    def from_torch(cls, module, attention="softmax"):
        """Turns ``module`` (a ``torch.nn.TransformerEncoderLayer``) into this class in place."""
        adopt(module, cls)._adopt_children(attention)
        return module

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if self.norm_first:
            delta, residual = self._forward_pre_norm(src, None, src_mask, src_key_padding_mask, is_causal)
            return delta + residual
        x, _ = norm_add(self.norm1, self._sa_block(src, src_mask, src_key_padding_mask, is_causal=is_causal), src)
        x, _ = norm_add(self.norm2, self._ff_block(x), x)
        return x

    def _forward_pre_norm(self, x, residual, src_mask, src_key_padding_mask, is_causal):
        """Pre-norm layer on the input ``x + residual`` (``x`` alone when residual is None),
        returning ``(delta, residual)`` whose sum is the output: the caller (or the next layer's
        norm1) adds them, fused into its LayerNorm."""
        if residual is None:
            y, residual = self.norm1(x), x
        else:
            y, residual = norm_add(self.norm1, x, residual)
        y, residual = norm_add(self.norm2, self._sa_block(y, src_mask, src_key_padding_mask, is_causal=is_causal),
                               residual)
        return self._ff_block(y), residual


class TransformerDecoderLayer(NotScriptable, nn.TransformerDecoderLayer):
    """Drop-in ``torch.nn.TransformerDecoderLayer`` (same arguments, parameters and forward) built
    on our MultiheadAttention and fused LayerNorm; ``attention=`` is passed to both attentions."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu, layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, bias=True, device=None, dtype=None, *, attention="softmax"):
        check_attention(attention)
        super().__init__(d_model, nhead, dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                         layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first, bias=bias,
                         device=device, dtype=dtype)
        self._adopt_children(attention)

    def _adopt_children(self, attention):
        adopt_attention(self.self_attn, attention)
        adopt_attention(self.multihead_attn, attention)
        self.norm1, self.norm2, self.norm3 = (adopt_norm(self.norm1), adopt_norm(self.norm2),
                                              adopt_norm(self.norm3))

    @classmethod
    def from_torch(cls, module, attention="softmax"):
        """Turns ``module`` (a ``torch.nn.TransformerDecoderLayer``) into this class in place."""
        adopt(module, cls)._adopt_children(attention)
        return module

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        if self.norm_first:
            delta, residual = self._forward_pre_norm(tgt, None, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                                     memory_key_padding_mask, tgt_is_causal, memory_is_causal)
            return delta + residual
        x = tgt
        x, _ = norm_add(self.norm1, self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal), x)
        x, _ = norm_add(self.norm2, self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                                    memory_is_causal), x)
        x, _ = norm_add(self.norm3, self._ff_block(x), x)
        return x

    def _forward_pre_norm(self, x, residual, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                          memory_key_padding_mask, tgt_is_causal, memory_is_causal):
        """As TransformerEncoderLayer._forward_pre_norm: returns (delta, residual), summing to the output."""
        if residual is None:
            y, residual = self.norm1(x), x
        else:
            y, residual = norm_add(self.norm1, x, residual)
        y, residual = norm_add(self.norm2, self._sa_block(y, tgt_mask, tgt_key_padding_mask, tgt_is_causal),
                               residual)
        y, residual = norm_add(self.norm3, self._mha_block(y, memory, memory_mask, memory_key_padding_mask,
                                                           memory_is_causal), residual)
        return self._ff_block(y), residual


# --------------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------------
def _detect_is_causal_mask(mask, is_causal, size):
    from torch.nn.modules.transformer import _detect_is_causal_mask as detect

    return detect(mask, is_causal, size)


def _seq_len(x, batch_first):
    return x.shape[0] if x.dim() == 2 else x.shape[1 if batch_first else 0]


def _finish_stack(norm, delta, residual):
    """The stack's output from the last pre-norm layer's (delta, residual), with its final norm."""
    if residual is None:
        return delta if norm is None else norm(delta)
    if norm is None:
        return delta + residual
    return norm_add(norm, delta, residual)[0]


def _chains_pre_norm(layer, cls):
    """Whether a stack may call ``layer._forward_pre_norm`` in place of ``layer(...)``: a pre-norm
    ``cls`` whose call would run ``cls.forward`` alone."""
    return isinstance(layer, cls) and layer.norm_first and calls_forward_alone(layer, cls.forward)


def _canonical_masks(src, mask, src_key_padding_mask):
    """torch.nn.TransformerEncoder's masks as it passes them to its layers: bool ones as float ones
    of the input's dtype (-inf where masked), with torch's checks and warnings."""
    src_key_padding_mask = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                             other_type=F._none_or_dtype(mask), other_name="mask",
                                             target_type=src.dtype)
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype,
                             check_other=False)
    return mask, src_key_padding_mask


class _LayerStack:
    """The encoder and decoder stacks' conversion: the torch.nn layers (type ``_torch_layer``) in
    ``self.layers`` become ours (``_our_layer``), and the final norm ours."""

    def _adopt_children(self, attention=None):
        for layer in self.layers:  # attention=None: torch layers get softmax, ours keep theirs
            if type(layer) is self._torch_layer:
                self._our_layer.from_torch(layer, attention or "softmax")
            elif isinstance(layer, self._our_layer) and attention is not None:
                layer._adopt_children(attention)
        self.norm = adopt_norm(self.norm) if self.norm is not None else None

    @classmethod
    def from_torch(cls, module, attention="softmax"):
        """Turns ``module`` (the torch.nn stack this class replaces) into this class in place."""
        adopt(module, cls)._adopt_children(attention)
        return module


class TransformerEncoder(_LayerStack, NotScriptable, nn.TransformerEncoder):
    """Drop-in ``torch.nn.TransformerEncoder``. torch.nn layers (and the norm) given to it are
    turned into ours; pre-norm layers pass (delta, residual) pairs to each other so that every
    residual add is fused into the next LayerNorm. ``enable_nested_tensor`` is accepted and
    ignored (no nested-tensor conversion)."""
    _torch_layer, _our_layer = nn.TransformerEncoderLayer, TransformerEncoderLayer

    def __init__(self, encoder_layer, num_layers, norm=None, enable_nested_tensor=True, mask_check=True, *,
                 attention=None):
        # No nested-tensor fast path here (and so no warning from torch about it).
        super().__init__(encoder_layer, num_layers, norm=norm, enable_nested_tensor=False, mask_check=mask_check)
        self.enable_nested_tensor = enable_nested_tensor
        self._adopt_children(attention)

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        first = self.layers[0] if len(self.layers) else None
        batch_first = getattr(getattr(first, "self_attn", None), "batch_first", False)
        is_causal = _detect_is_causal_mask(mask, is_causal, _seq_len(src, batch_first))
        delta, residual = src, None
        canonical = None  # the masks torch would pass, made for the first layer that is not ours
        for layer in self.layers:
            if _chains_pre_norm(layer, TransformerEncoderLayer):
                delta, residual = layer._forward_pre_norm(delta, residual, mask, src_key_padding_mask, is_causal)
                continue
            x = delta if residual is None else delta + residual
            if calls_forward_alone(layer, TransformerEncoderLayer.forward):  # ours: takes bool masks as they are
                layer_masks = mask, src_key_padding_mask
            else:
                layer_masks = canonical = canonical or _canonical_masks(src, mask, src_key_padding_mask)
            delta, residual = layer(x, src_mask=layer_masks[0], is_causal=is_causal,
                                    src_key_padding_mask=layer_masks[1]), None
        return _finish_stack(self.norm, delta, residual)


class TransformerDecoder(_LayerStack, NotScriptable, nn.TransformerDecoder):
    """Drop-in ``torch.nn.TransformerDecoder``; see ``TransformerEncoder``."""
    _torch_layer, _our_layer = nn.TransformerDecoderLayer, TransformerDecoderLayer

    def __init__(self, decoder_layer, num_layers, norm=None, *, attention=None):
        super().__init__(decoder_layer, num_layers, norm=norm)
        self._adopt_children(attention)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        first = self.layers[0] if len(self.layers) else None
        batch_first = getattr(getattr(first, "self_attn", None), "batch_first", False)
        tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(tgt, batch_first))
        masks = (tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal,
                 memory_is_causal)
        delta, residual = tgt, None
        for layer in self.layers:
            if _chains_pre_norm(layer, TransformerDecoderLayer):
                delta, residual = layer._forward_pre_norm(delta, residual, memory, *masks)
            else:
                x = delta if residual is None else delta + residual
                delta, residual = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                                        tgt_key_padding_mask=tgt_key_padding_mask,
                                        memory_key_padding_mask=memory_key_padding_mask,
                                        tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal), None
        return _finish_stack(self.norm, delta, residual)


class Transformer(NotScriptable, nn.Transformer):
    """Drop-in ``torch.nn.Transformer`` (same arguments, parameters, initialisation and forward,
    ``generate_square_subsequent_mask`` included) built from our encoder and decoder;
    ``attention=`` is passed to every attention (custom encoders/decoders made of torch.nn
    Transformer layers are converted too; ``attention=None`` means softmax for those and leaves
    transformer_fast ones as they are)."""

    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=2048,
                 dropout=0.1, activation=F.relu, custom_encoder=None, custom_decoder=None, layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, bias=True, device=None, dtype=None, *, attention=None):
        if attention is not None:
            check_attention(attention)
        super().__init__(d_model=d_model, nhead=nhead, num_encoder_layers=num_encoder_layers,
                         num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward, dropout=dropout,
                         activation=activation, custom_encoder=custom_encoder, custom_decoder=custom_decoder,
                         layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first, bias=bias,
                         device=device, dtype=dtype)
        self._adopt_children(attention)

    def _adopt_children(self, attention=None):
        for name, cls, torch_cls in (("encoder", TransformerEncoder, nn.TransformerEncoder),
                                     ("decoder", TransformerDecoder, nn.TransformerDecoder)):
            child = getattr(self, name)
            if type(child) is torch_cls:
                cls.from_torch(child, attention or "softmax")
            elif isinstance(child, cls) and attention is not None:
                child._adopt_children(attention)

    @classmethod
    def from_torch(cls, module, attention="softmax"):
        """Turns ``module`` (a ``torch.nn.Transformer``) into this class in place."""
        adopt(module, cls)._adopt_children(attention)
        return module
