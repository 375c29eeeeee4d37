"""The plain-torch backend ("reference"): the kernel-level functions (same signatures as the
Triton and C++ kernels) in plain PyTorch, materialising everything. It serves float64, devices
with no compiled kernels, and tests. Backward passes are the textbook formulas (they run inside
an op's backward, where autograd does not record). Computes in float32 at least and returns the
input dtype, as the kernels do."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def dropout_keep_mask(seed, shape, dropout_p, device):
    """The reference backend's dropout mask: True = kept, drawn from a generator seeded with `seed`
    so the backward regenerates exactly the forward's mask."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def _attention_probs(q, k, attn_mask, key_padding_mask, is_causal, scale):
    """softmax of the masked, scaled scores (B, H, Nq, Nk), 0 on rows with no allowed key,
    and the log-sum-exp of each row (+inf on those rows)."""
    B, H, Nq, _ = q.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(Nq, k.shape[2], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(q.dtype))
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(scores - lse[..., None]), lse


def attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed):
    c = _compute_dtype(q)
    probs, lse = _attention_probs(q.to(c), k.to(c), attn_mask, key_padding_mask, is_causal, scale)
    if dropout_p > 0:
        probs = probs * dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1 - dropout_p)
    v = v.to(c).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return (probs @ v).to(q.dtype), lse.float()


def _sum_groups(t, heads):
    """(B, H, ...) -> (B, heads, ...): sums each group of H // heads query heads (GQA)."""
    B, H = t.shape[:2]
    return t.reshape(B, heads, H // heads, *t.shape[2:]).sum(2)


def attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                       compute_dmask):
    c = _compute_dtype(q)
    qc, kc, vc, doutc = q.to(c), k.to(c), v.to(c), dout.to(c)
    H, Hk = q.shape[1], k.shape[1]
    probs, _ = _attention_probs(qc, kc, attn_mask, key_padding_mask, is_causal, scale)
    keep = 1.0
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, probs.shape, dropout_p, q.device) / (1 - dropout_p)
    k_full, v_full = kc.repeat_interleave(H // Hk, dim=1), vc.repeat_interleave(H // Hk, dim=1)
    dv = _sum_groups((probs * keep).transpose(-2, -1) @ doutc, Hk)
    dprobs = (doutc @ v_full.transpose(-2, -1)) * keep
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    dq = dscores @ k_full * scale
    dk = _sum_groups(dscores.transpose(-2, -1) @ qc * scale, Hk)
    dmask = dscores.to(q.dtype) if compute_dmask else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
    h = x if residual is None else x + residual  # rounded to the input dtype, as torch's x + r is
    hc = h.to(_compute_dtype(x))
    mean = None if is_rms else hc.mean(dim=-1)
    centered = hc if is_rms else hc - mean[:, None]
    rstd = torch.rsqrt((centered * centered).mean(dim=-1) + eps)
    y = centered * rstd[:, None]
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    stats = torch.promote_types(x.dtype, torch.float32)
    return (y.to(x.dtype), None if residual is None else h.contiguous(),
            None if mean is None else mean.to(stats), rstd.to(stats))


def layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    c = _compute_dtype(h)
    hc, dyc, rstd = h.to(c), dy.to(c), rstd.to(c)[:, None]
    xhat = (hc if is_rms else hc - mean.to(c)[:, None]) * rstd
    g = dyc if weight is None else dyc * weight.to(c)
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - g.mean(-1, keepdim=True)
    dx = dx * rstd
    if dh is not None:
        dx = dx + dh.to(c)
    dweight = None if weight is None else (dyc * xhat).sum(0).to(weight.dtype)
    dbias = None if bias is None else dyc.sum(0).to(bias.dtype)
    return dx.to(h.dtype), dweight, dbias


def _elu_feature_map(x):
    return F.elu(x) + 1


def _linear_attention_weights(q, k, key_padding_mask, is_causal):
    """phi(q_i).phi(k_j), zeroed where key j is padded or (causal) j > i."""
    weights = _elu_feature_map(q) @ _elu_feature_map(k).transpose(-2, -1)
    if is_causal:
        weights = weights.tril()
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return weights


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps):
    c = _compute_dtype(q)
    weights = _linear_attention_weights(q.to(c), k.to(c), key_padding_mask, is_causal)
    return ((weights @ v.to(c)) / (weights.sum(-1, keepdim=True) + eps)).to(q.dtype)


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps):
    c = _compute_dtype(q)
    qc, kc, vc, doutc = q.to(c), k.to(c), v.to(c), dout.to(c)
    weights = _linear_attention_weights(qc, kc, key_padding_mask, is_causal)
    denominator = weights.sum(-1, keepdim=True) + eps
    out = (weights @ vc) / denominator
    dnumerator = doutc / denominator
    dweights = dnumerator @ vc.transpose(-2, -1) - (doutc * out).sum(-1, keepdim=True) / denominator
    if is_causal:
        dweights = dweights.tril()
    if key_padding_mask is not None:
        dweights = dweights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    dv = weights.transpose(-2, -1) @ dnumerator
    # d phi(x)/dx = elu'(x): 1 for x > 0, exp(x) otherwise.
    dq = (dweights @ _elu_feature_map(kc)) * torch.where(qc > 0, 1.0, torch.exp(qc))
    dk = (dweights.transpose(-2, -1) @ _elu_feature_map(qc)) * torch.where(kc > 0, 1.0, torch.exp(kc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
