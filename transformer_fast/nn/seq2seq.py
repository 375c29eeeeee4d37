"""An encoder-decoder Transformer (Vaswani et al. 2017) built from transformer_fast's layers, with
incremental greedy decoding.

``Seq2SeqTransformer`` embeds (B, N) token tensors (scaled by sqrt(d_model)), adds the sinusoidal
``PositionalEncoding``, runs an encoder stack and a decoder stack (causal self-attention, then
cross-attention over the encoder output) and projects to the vocabulary. ``attention="linear"``
swaps every attention for linear attention (``transformer_fast.linear_attention``).

``generate`` decodes greedily and incrementally: the source is encoded once, every decoder
layer's cross-attention keys/values (softmax) or key/value sums (linear: the final state of
``linear_attention(..., output_final_state=True)`` over the memory) are computed from the memory
once, and each new token only runs its own row through the decoder, appending its key and value
to the self-attention cache (softmax, O(N) per token) or folding them into the recurrent state
with ``linear_attention_step`` (linear, O(1) per token); linear cross-attention then queries the
memory's state (``linear_attention`` with that state as the initial state and no keys).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import scaled_dot_product_attention
from ..linear_attention import LinearAttentionState, linear_attention, linear_attention_step
from .normalization import LayerNorm
from .transformer import TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer

__all__ = ["PositionalEncoding", "Seq2SeqTransformer", "DecoderCache", "LayerCache"]

LINEAR_ATTENTION_EPS = 1e-6  # linear_attention's default eps, which the layers use


class PositionalEncoding(nn.Module):
    """Adds PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))
    to (B, N, d_model) inputs, starting at position ``offset``, then applies dropout."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        if d_model < 1 or max_len < 1:
            raise ValueError(f"d_model and max_len must be >= 1, got {d_model} and {max_len}")
        position = torch.arange(max_len, dtype=torch.float64)[:, None]
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 2i for the even columns
        angle = position / 10000.0 ** (two_i / d_model)           # (max_len, ceil(d_model / 2))
        pe = torch.empty(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
        self.register_buffer("pe", pe.to(torch.get_default_dtype()), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.max_len = max_len

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        n = x.shape[-2]
        if offset + n > self.max_len:
            raise ValueError(f"positions {offset}..{offset + n - 1} exceed max_len={self.max_len}")
        return self.dropout(x + self.pe[offset:offset + n].to(x.dtype))


@dataclass
class LayerCache:
    """What one decoder layer keeps between decoding steps. Softmax: the self-attention keys and
    values so far (B, H, t, hd) and the memory's keys/values (B, H, S, hd). Linear: the recurrent
    self-attention state and the memory's sums S = sum phi(k)^T v, z = sum phi(k) (unpadded keys)."""
    self_k: Optional[torch.Tensor] = None
    self_v: Optional[torch.Tensor] = None
    self_state: Optional[LinearAttentionState] = None
    cross_k: Optional[torch.Tensor] = None
    cross_v: Optional[torch.Tensor] = None
    cross_state: Optional[LinearAttentionState] = None


@dataclass
class DecoderCache:
    memory_key_padding_mask: Optional[torch.Tensor]  # (B, S) bool, True = padded source token
    layers: List[LayerCache] = field(default_factory=list)
    position: int = 0  # number of target tokens decoded so far


def _split_heads(x: torch.Tensor, nhead: int) -> torch.Tensor:
    """(B, N, E) -> (B, H, N, E / H)."""
    B, N, E = x.shape
    return x.view(B, N, nhead, E // nhead).transpose(1, 2)


def _in_projection(attn: nn.Module):
    """The (W_q, W_k, W_v), (b_q, b_k, b_v) of a MultiheadAttention (packed in_proj_weight)."""
    w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
    if attn.in_proj_bias is None:
        return (w_q, w_k, w_v), (None, None, None)
    return (w_q, w_k, w_v), tuple(attn.in_proj_bias.chunk(3))


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer over token ids.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (tgt defaults to src).
        pad_id: the padding token; source padding is masked in every encoder self-attention and
            every decoder cross-attention, target padding in the decoder self-attention.
        d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout,
        activation, norm_first: as ``torch.nn.Transformer`` (a final LayerNorm closes each stack
            when ``norm_first``, as pre-norm Transformers need).
        attention: "softmax" or "linear".
        max_len: the longest source or target sequence (positional-encoding table size).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: Optional[int] = None, *, pad_id: int = 0,
                 d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, activation="relu", norm_first: bool = False,
                 attention: str = "softmax", max_len: int = 512, layer_norm_eps: float = 1e-5):
        super().__init__()
        if attention not in ("softmax", "linear"):
            raise ValueError(f"attention must be 'softmax' or 'linear', got {attention!r}")
        if d_model % nhead != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by nhead ({nhead})")
        tgt_vocab_size = src_vocab_size if tgt_vocab_size is None else tgt_vocab_size
        if not (0 <= pad_id < src_vocab_size and pad_id < tgt_vocab_size):
            raise ValueError(f"pad_id must be a token id of both vocabularies, got {pad_id}")

        self.d_model, self.nhead, self.pad_id, self.attention = d_model, nhead, pad_id, attention
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        self.positional_encoding = PositionalEncoding(d_model, dropout, max_len)
        encoder_layer = TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first=True,
            norm_first=norm_first, attention=attention)
        decoder_layer = TransformerDecoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first=True,
            norm_first=norm_first, attention=attention)
        final_norm = (lambda: LayerNorm(d_model, eps=layer_norm_eps)) if norm_first else (lambda: None)
        self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, norm=final_norm(),
                                                 enable_nested_tensor=False)
        self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, norm=final_norm())
        self.generator = nn.Linear(d_model, tgt_vocab_size)
        self._reset_parameters()

    def _reset_parameters(self):
        for p in self.parameters():  # as torch.nn.Transformer does
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        nn.init.normal_(self.src_embedding.weight, std=self.d_model ** -0.5)
        nn.init.normal_(self.tgt_embedding.weight, std=self.d_model ** -0.5)

    # ------------------------------------------------------------------------------------------
    # Teacher forcing
    # ------------------------------------------------------------------------------------------
    def _check_tokens(self, name, tokens):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            got = f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise ValueError(f"{name} must be a (B, N) integer tensor of token ids, got {got}")

    def encode(self, src: torch.Tensor, src_key_padding_mask: Optional[torch.Tensor] = None):
        """(B, S) source tokens -> (memory (B, S, d_model), source padding mask (B, S) bool).
        The mask (True = padded) defaults to ``src == pad_id``."""
        self._check_tokens("src", src)
        if src_key_padding_mask is None:
            src_key_padding_mask = src == self.pad_id
        elif src_key_padding_mask.shape != src.shape or src_key_padding_mask.dtype != torch.bool:
            raise ValueError(f"src_key_padding_mask must be a bool tensor of src's shape {tuple(src.shape)}, got "
                             f"{src_key_padding_mask.dtype} of shape {tuple(src_key_padding_mask.shape)}")
        x = self.positional_encoding(self.src_embedding(src) * math.sqrt(self.d_model))
        memory = self.encoder(x, src_key_padding_mask=src_key_padding_mask)
        return memory, src_key_padding_mask

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, memory_key_padding_mask: Optional[torch.Tensor],
               tgt_key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced decoder: (B, T) target tokens -> logits (B, T, tgt_vocab_size)."""
        self._check_tokens("tgt", tgt)
        T = tgt.shape[1]
        x = self.positional_encoding(self.tgt_embedding(tgt) * math.sqrt(self.d_model))
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # True = may not attend
        x = self.decoder(x, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True)
        return self.generator(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_key_padding_mask: Optional[torch.Tensor] = None,
                tgt_key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """src (B, S), tgt (B, T) token ids (tgt starts with BOS) -> logits (B, T, tgt_vocab_size).
        The padding masks (bool, True = padded) default to ``src == pad_id`` and ``tgt == pad_id``."""
        self._check_tokens("tgt", tgt)
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src and tgt must have the same batch size, got {src.shape[0]} and {tgt.shape[0]}")
        memory, src_key_padding_mask = self.encode(src, src_key_padding_mask)
        if tgt_key_padding_mask is None:
            tgt_key_padding_mask = tgt == self.pad_id
        return self.decode(tgt, memory, src_key_padding_mask, tgt_key_padding_mask)

    # ------------------------------------------------------------------------------------------
    # Incremental decoding
    # ------------------------------------------------------------------------------------------
    def init_cache(self, memory: torch.Tensor, memory_key_padding_mask: Optional[torch.Tensor]) -> DecoderCache:
        """Projects the memory once per decoder layer for its cross-attention."""
        cache = DecoderCache(memory_key_padding_mask)
        for layer in self.decoder.layers:
            attn = layer.multihead_attn
            (_, w_k, w_v), (_, b_k, b_v) = _in_projection(attn)
            k = _split_heads(F.linear(memory, w_k, b_k), self.nhead)
            v = _split_heads(F.linear(memory, w_v, b_v), self.nhead)
            if self.attention == "softmax":
                cache.layers.append(LayerCache(cross_k=k, cross_v=v))
            else:  # the memory's sums, as the final state of a call that queries nothing
                no_query = k.new_empty(*k.shape[:2], 0, k.shape[3])
                _, state = linear_attention(no_query, k, v, key_padding_mask=memory_key_padding_mask,
                                            eps=LINEAR_ATTENTION_EPS, output_final_state=True)
                cache.layers.append(LayerCache(cross_state=state))
        return cache

    def _self_attention_step(self, attn, x, layer_cache):
        """x (B, 1, E): the new token's input to the self-attention; appends to the cache."""
        (w_q, w_k, w_v), (b_q, b_k, b_v) = _in_projection(attn)
        q, k, v = (_split_heads(F.linear(x, w, b), self.nhead) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
        if self.attention == "softmax":
            if layer_cache.self_k is None:
                layer_cache.self_k, layer_cache.self_v = k, v
            else:
                layer_cache.self_k = torch.cat([layer_cache.self_k, k], dim=2)
                layer_cache.self_v = torch.cat([layer_cache.self_v, v], dim=2)
            out = scaled_dot_product_attention(q, layer_cache.self_k, layer_cache.self_v)
        else:
            out, layer_cache.self_state = linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                                                layer_cache.self_state, eps=LINEAR_ATTENTION_EPS)
            out = out[:, :, None]
        return attn.out_proj(out.transpose(1, 2).reshape(x.shape))

    def _cross_attention_step(self, attn, x, layer_cache, memory_key_padding_mask):
        (w_q, _, _), (b_q, _, _) = _in_projection(attn)
        q = _split_heads(F.linear(x, w_q, b_q), self.nhead)
        if self.attention == "softmax":
            out = scaled_dot_product_attention(q, layer_cache.cross_k, layer_cache.cross_v,
                                               key_padding_mask=memory_key_padding_mask)
        else:  # the memory's state queried: no keys of this call's own
            no_key = q.new_empty(*q.shape[:2], 0, q.shape[3])
            out = linear_attention(q, no_key, no_key, eps=LINEAR_ATTENTION_EPS,
                                   initial_state=layer_cache.cross_state)
        return attn.out_proj(out.transpose(1, 2).reshape(x.shape))

    def _decoder_layer_step(self, layer, x, layer_cache, memory_key_padding_mask):
        """One token through a TransformerDecoderLayer, mirroring its forward."""
        def feed_forward(h):
            return layer.dropout3(layer.linear2(layer.dropout(layer.activation(layer.linear1(h)))))

        if layer.norm_first:
            x = x + layer.dropout1(self._self_attention_step(layer.self_attn, layer.norm1(x), layer_cache))
            x = x + layer.dropout2(self._cross_attention_step(layer.multihead_attn, layer.norm2(x), layer_cache,
                                                              memory_key_padding_mask))
            x = x + feed_forward(layer.norm3(x))
        else:
            x = layer.norm1(x + layer.dropout1(self._self_attention_step(layer.self_attn, x, layer_cache)))
            x = layer.norm2(x + layer.dropout2(self._cross_attention_step(layer.multihead_attn, x, layer_cache,
                                                                          memory_key_padding_mask)))
            x = layer.norm3(x + feed_forward(x))
        return x

    def decode_step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Feeds one new target token per sequence, (B,), at position ``cache.position``; returns
        its logits (B, tgt_vocab_size) and updates ``cache`` in place."""
        if tokens.dim() != 1:
            raise ValueError(f"tokens must have shape (B,), got {tuple(tokens.shape)}")
        x = self.tgt_embedding(tokens[:, None]) * math.sqrt(self.d_model)
        x = self.positional_encoding(x, offset=cache.position)
        for layer, layer_cache in zip(self.decoder.layers, cache.layers):
            x = self._decoder_layer_step(layer, x, layer_cache, cache.memory_key_padding_mask)
        if self.decoder.norm is not None:
            x = self.decoder.norm(x)
        cache.position += 1
        return self.generator(x[:, 0])

    @torch.no_grad()
    def generate(self, src: torch.Tensor, max_new_tokens: int, bos_id: int, eos_id: Optional[int] = None, *,
                 use_cache: bool = True, return_logits: bool = False):
        """Greedy decoding (in eval mode; the training mode is restored afterwards).

        Returns (B, 1 + n) tokens starting with ``bos_id``, n <= max_new_tokens; a sequence that
        has produced ``eos_id`` is padded with ``pad_id`` after it, and decoding stops once every
        sequence has. ``use_cache=False`` re-runs the whole decoder over the prefix each step (the
        slow reference). ``return_logits=True`` also returns the step logits (B, n, vocab).
        """
        self._check_tokens("src", src)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        max_len = self.positional_encoding.max_len
        if max_new_tokens > max_len or src.shape[1] > max_len:
            # Token t is fed at position t - 1: checked up front, not mid-decode.
            raise ValueError(f"generate needs positions up to max(max_new_tokens, source length) = "
                             f"{max(max_new_tokens, src.shape[1])}, beyond the model's max_len={max_len}")
        was_training = self.training
        self.eval()
        try:
            B = src.shape[0]
            memory, src_key_padding_mask = self.encode(src)
            tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
            finished = torch.zeros(B, dtype=torch.bool, device=src.device)
            cache = self.init_cache(memory, src_key_padding_mask) if use_cache else None
            all_logits = []
            for _ in range(max_new_tokens):
                if use_cache:
                    logits = self.decode_step(tokens[:, -1], cache)
                else:
                    logits = self.decode(tokens, memory, src_key_padding_mask)[:, -1]
                all_logits.append(logits)
                next_token = logits.argmax(-1)
                next_token = torch.where(finished, torch.full_like(next_token, self.pad_id), next_token)
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                if eos_id is not None:
                    finished |= next_token == eos_id
                    if bool(finished.all()):
                        break
        finally:
            self.train(was_training)
        if return_logits:
            empty = memory.new_zeros(B, 0, self.generator.out_features)
            return tokens, (torch.stack(all_logits, 1) if all_logits else empty)
        return tokens
