"""Drop-in ``torch.nn.MultiheadAttention`` on transformer_fast's kernels.

It subclasses torch's: same constructor (plus ``attention=``), parameter names, state-dict keys
(state dicts load both ways with ``strict=True``), forward signature and results. What changes is
how the forward is computed:

* Self-attention (``query is key is value``) projects Q, K and V with one matmul and hands
  strided (B, H, N, D) views of its output to ``transformer_fast.scaled_dot_product_attention``
  without copies; masks are passed to the kernel as views (a bool ``key_padding_mask`` as the
  kernel's own, an (L, S) mask broadcast, a (B*H, L, S) mask viewed as (B, H, L, S)).
  ``need_weights=True`` (torch's default) needs the attention matrix, which the fused kernel never
  forms: that call runs torch's own unfused implementation (results identical to
  ``torch.nn.MultiheadAttention``). Pass ``need_weights=False`` (as the Transformer layers do)
  for the fused path.
* ``attention="linear"`` swaps softmax attention for ``transformer_fast.linear_attention``
  (phi = elu + 1) on the projected heads. It cannot express arbitrary masks: ``is_causal=True``
  or an ``attn_mask`` equal to the causal mask selects causal linear attention, any other
  ``attn_mask`` raises ValueError; a float ``key_padding_mask`` must hold only 0 and -inf. There
  is no attention matrix, so the weights are returned as None whatever ``need_weights`` says,
  and attention dropout is not applied (there are no probabilities to drop).

Differences from torch: ``is_causal=True`` is accepted without an ``attn_mask`` (torch raises);
fully masked query rows give 0 (as torch's ``need_weights=False`` path does); with
``add_bias_kv``/``add_zero_attn``, ``is_causal=True`` means the causal mask with the appended keys
visible to every query (what torch computes with ``need_weights=True``; its ``need_weights=False``
path hides them too). Nested-tensor inputs, and head dims above the kernels' limit, run torch's
implementation with softmax attention; linear attention refuses nested tensors.
"""
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .. import attention as _attention_module
from .._validation import MAX_HEAD_DIM
from ..attention import scaled_dot_product_attention
from ..linear_attention import linear_attention
from ._drop_in import NotScriptable, adopt, check_attention

__all__ = ["MultiheadAttention"]


def _causal_mask(nq, nk, device):
    """True above the diagonal: the bool causal mask in nn.MultiheadAttention's convention."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).triu(1)


def _additive(mask, dtype):
    """A float mask for the kernels: float32 as it is (they add it in float32, as torch's SDPA
    does), any other float dtype in the query's `dtype`."""
    return mask if mask.dtype == torch.float32 else mask.to(dtype)


def _pad_last(mask, fill):
    """One more key column (for add_bias_kv / add_zero_attn), filled with `fill`."""
    return torch.cat([mask, mask.new_full((*mask.shape[:-1], 1), fill)], dim=-1)


def _is_causal_attn_mask(mask, nq, nk):
    """Whether an nn.MultiheadAttention-style attn_mask (bool True = masked, or float added; any
    shape broadcasting to (..., nq, nk)) equals the causal mask."""
    above = _causal_mask(nq, nk, mask.device)
    if mask.dtype == torch.bool:
        return bool((mask == above).all())
    return bool((torch.isneginf(mask) == above).all() and (mask.masked_fill(above, 0) == 0).all())


# --------------------------------------------------------------------------------------------
# MultiheadAttention
# --------------------------------------------------------------------------------------------
class MultiheadAttention(NotScriptable, nn.MultiheadAttention):
    """Drop-in ``torch.nn.MultiheadAttention`` on transformer_fast's kernels.

    Same constructor, parameters, state dict and ``forward`` as torch's, plus
    ``attention="softmax" | "linear"`` (see the module docstring). ``need_weights=True`` runs
    torch's unfused implementation (it has to form the weights); ``need_weights=False`` runs the
    fused kernel.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, attention="softmax"):
        if not (isinstance(num_heads, numbers.Integral) and num_heads > 0):
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if not (isinstance(embed_dim, numbers.Integral) and embed_dim > 0) or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim must be a positive multiple of num_heads, got embed_dim={embed_dim!r} "
                             f"and num_heads={num_heads}")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        self.attention = check_attention(attention)

    @classmethod
    def from_torch(cls, module, attention="softmax"):
        """Turns ``module`` (a ``torch.nn.MultiheadAttention``) into this class in place."""
        return adopt(module, cls, attention=check_attention(attention))

    def extra_repr(self):
        return f"attention={getattr(self, 'attention', 'softmax')!r}"

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        attention = getattr(self, "attention", "softmax")
        if attention == "softmax" and (need_weights or self.head_dim > MAX_HEAD_DIM or query.is_nested):
            # The weights need the unfused computation: torch's own (which takes an attn_mask
            # with is_causal; we accept is_causal alone and build the mask for it). So do head
            # dims beyond the kernels' limit and nested-tensor inputs.
            if _attention_module._context_parallel is not None:  # not routed: refused in a context_parallel block
                _attention_module._context_parallel.refuse_unrouted(
                    "MultiheadAttention with need_weights=True (nn.MultiheadAttention's default), a head dim above "
                    f"{MAX_HEAD_DIM} or nested tensors", "it runs torch's unfused attention on the shard alone; pass "
                    "need_weights=False")
            if is_causal and attn_mask is None:
                nq = query.shape[1 if (self.batch_first and query.dim() == 3) else 0]
                nk = key.shape[1 if (self.batch_first and key.dim() == 3) else 0]
                attn_mask = _causal_mask(nq, nk, query.device)
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        if query.is_nested:
            raise ValueError("attention='linear' does not take nested tensors: pass padded ones with a "
                             "key_padding_mask (torch.nn.TransformerEncoder makes nested tensors in eval mode "
                             "unless built with enable_nested_tensor=False)")
        batched = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        self_attention = query is key and key is value
        kv_shared = key is value
        if not batched:  # one sequence: add a batch dim of 1 where this layout has it
            bdim = 0 if self.batch_first else 1
            query, key, value = query.unsqueeze(bdim), key.unsqueeze(bdim), value.unsqueeze(bdim)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out = self._fused_forward(query, key, value, key_padding_mask, attn_mask, is_causal,
                                  self_attention, kv_shared, attention)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
        return out, None

    # -- checks --------------------------------------------------------------------------------
    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask):
        """Torch's shape rules, as ValueErrors naming the argument. Returns whether batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched: L, E) or 3-D (batched), got shape {tuple(query.shape)}")
        batched = query.dim() == 3
        want = query.dim()
        for name, t in (("key", key), ("value", value)):
            if t.dim() != want:
                raise ValueError(f"{name} must have {want} dimensions like query (shape {tuple(query.shape)}), "
                                 f"got shape {tuple(t.shape)}")
        bdim, ldim = (0, 1) if self.batch_first else (1, 0)
        if batched:
            B = query.shape[bdim]
            for name, t in (("key", key), ("value", value)):
                if t.shape[bdim] != B:
                    raise ValueError(f"{name} has batch size {t.shape[bdim]} but query has {B} "
                                     f"(batch_first={self.batch_first})")
        else:
            B, ldim = 1, 0
        L, S = query.shape[ldim], key.shape[ldim]
        if value.shape[ldim] != S:
            raise ValueError(f"key and value must have the same sequence length, got shapes "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's last dim must be embed_dim={self.embed_dim}, got shape {tuple(query.shape)}")
        if key.shape[-1] != self.kdim:
            raise ValueError(f"key's last dim must be kdim={self.kdim}, got shape {tuple(key.shape)}")
        if value.shape[-1] != self.vdim:
            raise ValueError(f"value's last dim must be vdim={self.vdim}, got shape {tuple(value.shape)}")
        if key_padding_mask is not None:
            want_kpm = (B, S) if batched else (S,)
            if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != want_kpm:
                raise ValueError(f"key_padding_mask must have shape {want_kpm} (batch, source length), got "
                                 f"{getattr(key_padding_mask, 'shape', key_padding_mask)}")
            if key_padding_mask.dtype != torch.bool and not key_padding_mask.is_floating_point():
                raise TypeError(f"key_padding_mask must be bool (True = padded) or float (added), got "
                                f"{key_padding_mask.dtype}")
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise TypeError(f"attn_mask must be bool (True = not allowed) or float (added), got {attn_mask.dtype}")
            allowed = [(L, S), (B * self.num_heads, L, S)]
            if tuple(attn_mask.shape) not in allowed:
                raise ValueError(f"attn_mask must have shape (L, S) = {(L, S)} or (batch * num_heads, L, S) = "
                                 f"{(B * self.num_heads, L, S)}, got {tuple(attn_mask.shape)}")
        return batched

    # -- computation ---------------------------------------------------------------------------
    def _split_heads(self, t, n):
        """(B, N, n*E) or (N, B, n*E) -> n strided (B, H, N, D) views (no copy)."""
        H, D = self.num_heads, self.head_dim
        t = t.view(t.shape[0], t.shape[1], n, H, D)
        t = t.permute(2, 0, 3, 1, 4) if self.batch_first else t.permute(2, 1, 3, 0, 4)
        return t.unbind(0)

    def _project(self, query, key, value, self_attention, kv_shared):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if not self._qkv_same_embed_dim:
            q = F.linear(query, self.q_proj_weight, bq)
            k = F.linear(key, self.k_proj_weight, bk)
            v = F.linear(value, self.v_proj_weight, bv)
            return self._split_heads(q, 1)[0], self._split_heads(k, 1)[0], self._split_heads(v, 1)[0]
        w = self.in_proj_weight
        if self_attention:  # one matmul for Q, K and V
            return self._split_heads(F.linear(query, w, b), 3)
        q = self._split_heads(F.linear(query, w[:E], bq), 1)[0]
        if kv_shared:  # cross-attention on one memory: one matmul for K and V
            k, v = self._split_heads(F.linear(key, w[E:], None if b is None else b[E:]), 2)
        else:
            k = self._split_heads(F.linear(key, w[E:2 * E], bk), 1)[0]
            v = self._split_heads(F.linear(value, w[2 * E:], bv), 1)[0]
        return q, k, v

    def _fused_forward(self, query, key, value, key_padding_mask, attn_mask, is_causal, self_attention,
                       kv_shared, attention):
        q, k, v = self._project(query, key, value, self_attention, kv_shared)
        B, H, L, D = q.shape
        extra_keys = []  # (k, v) columns appended after the source: bias_k/bias_v, then zeros
        if self.bias_k is not None:
            extra_keys.append((self.bias_k.view(1, H, 1, D).expand(B, H, 1, D),
                               self.bias_v.view(1, H, 1, D).expand(B, H, 1, D)))
        if self.add_zero_attn:
            extra_keys.append((k.new_zeros(B, H, 1, D), v.new_zeros(B, H, 1, D)))

        if attention == "linear":
            out = self._linear_attention(q, k, v, key_padding_mask, attn_mask, is_causal, extra_keys)
        else:
            out = self._softmax_attention(q, k, v, key_padding_mask, attn_mask, is_causal, extra_keys)
        # (B, H, L, D) -> the input layout, then the output projection
        out = out.transpose(1, 2).reshape(B, L, self.embed_dim) if self.batch_first else \
            out.permute(2, 0, 1, 3).reshape(L, B, self.embed_dim)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias)

    def _softmax_attention(self, q, k, v, key_padding_mask, attn_mask, is_causal, extra_keys):
        B, H, L, D = q.shape
        S = k.shape[2]
        dtype = q.dtype
        if is_causal and extra_keys:
            # The kernel's causal flag would also hide the appended key columns: use the mask.
            attn_mask = _causal_mask(L, S, q.device) if attn_mask is None else attn_mask
            is_causal = False
        elif is_causal:
            attn_mask = None  # the hint says attn_mask is the causal mask (as torch trusts it)
        # attn_mask -> the kernel's convention (bool True = allowed, or float added) as a view
        # that broadcasts to (B, H, L, S). A float32 mask stays float32, as torch passes it on.
        if attn_mask is not None:
            attn_mask = ~attn_mask if attn_mask.dtype == torch.bool else _additive(attn_mask, dtype)
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.view(B, H, L, S)
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            # A float key_padding_mask is added to the scores, like a float attn_mask.
            additive = _additive(key_padding_mask, dtype)[:, None, None, :]
            if attn_mask is None:
                attn_mask = additive
            elif attn_mask.dtype == torch.bool:
                attn_mask = additive.masked_fill(~attn_mask, float("-inf"))
            else:
                attn_mask = attn_mask + additive
            key_padding_mask = None
        if extra_keys:
            k = torch.cat([k] + [ek for ek, _ in extra_keys], dim=2)
            v = torch.cat([v] + [ev for _, ev in extra_keys], dim=2)
            for _ in extra_keys:  # the appended keys are never masked
                if attn_mask is not None:
                    attn_mask = _pad_last(attn_mask, True if attn_mask.dtype == torch.bool else 0.0)
                if key_padding_mask is not None:
                    key_padding_mask = _pad_last(key_padding_mask, False)
        dropout_p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=bool(is_causal), key_padding_mask=key_padding_mask)

    def _linear_attention(self, q, k, v, key_padding_mask, attn_mask, is_causal, extra_keys):
        L, S = q.shape[2], k.shape[2]
        causal = bool(is_causal)
        if attn_mask is not None and not causal:
            if not _is_causal_attn_mask(attn_mask, L, S):
                raise ValueError("attention='linear' supports no attn_mask other than the causal mask "
                                 "(pass is_causal=True or the causal mask); use key_padding_mask for padding")
            causal = True
        if causal and (L != S or extra_keys):
            raise ValueError(f"causal linear attention needs equal query and key lengths and no "
                             f"add_bias_kv/add_zero_attn, got L={L}, S={S}")
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            padded = torch.isneginf(key_padding_mask)
            if not bool((key_padding_mask.masked_fill(padded, 0) == 0).all()):
                raise ValueError("attention='linear' takes a float key_padding_mask only if it holds just 0 "
                                 "(keep) and -inf (padded); other values cannot be expressed")
            key_padding_mask = padded
        for ek, ev in extra_keys:
            k, v = torch.cat([k, ek], dim=2), torch.cat([v, ev], dim=2)
            if key_padding_mask is not None:
                key_padding_mask = _pad_last(key_padding_mask, False)
        return linear_attention(q, k, v, is_causal=causal, key_padding_mask=key_padding_mask)


def adopt_attention(module, attention):
    """Our MultiheadAttention, computing ``attention``, in place of a torch.nn one (ours take the
    kind; anything else is left alone)."""
    if type(module) is nn.MultiheadAttention:
        MultiheadAttention.from_torch(module, attention)
    elif isinstance(module, MultiheadAttention):
        module.attention = check_attention(attention)
    return module
