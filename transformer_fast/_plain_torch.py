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


def _elu_derivative(x):
    """d phi(x)/dx = elu'(x): 1 for x > 0, exp(x) otherwise."""
    return torch.where(x > 0, 1.0, torch.exp(x))


def _linear_attention_weights(q, k, key_padding_mask, is_causal):
    """phi(q_i).phi(k_j), zeroed where key j is padded or (causal) j > i."""
    weights = _elu_feature_map(q) @ _elu_feature_map(k).transpose(-2, -1)
    if is_causal:
        weights = weights.tril()
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return weights


def _unpadded(x, key_padding_mask):
    """x (B, H, Nk, .) with the rows of padded keys set to 0 (whatever they held)."""
    return x if key_padding_mask is None else x.masked_fill(key_padding_mask[:, None, :, None], 0.0)


def _linear_attention_terms(q, k, v, key_padding_mask, is_causal, initial_S, initial_z):
    """(weights, numerator, denominator without eps) in the compute dtype: the keys' sums plus the
    initial state's terms phi(q) S0 and phi(q) . z0."""
    weights = _linear_attention_weights(q, k, key_padding_mask, is_causal)
    numerator = weights @ _unpadded(v, key_padding_mask)
    denominator = weights.sum(-1, keepdim=True)
    if initial_S is not None:
        phi_q = _elu_feature_map(q)
        numerator = numerator + phi_q @ initial_S.to(q.dtype)
        denominator = denominator + phi_q @ initial_z.to(q.dtype)[..., None]
    return weights, numerator, denominator


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    c = _compute_dtype(q)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    _, numerator, denominator = _linear_attention_terms(qc, kc, vc, key_padding_mask, is_causal, initial_S,
                                                        initial_z)
    out = (numerator / (denominator + eps)).to(q.dtype)
    if not output_final_state:
        return out, None, None
    phi_k = _unpadded(_elu_feature_map(kc), key_padding_mask)
    S = phi_k.transpose(-2, -1) @ _unpadded(vc, key_padding_mask)
    z = phi_k.sum(-2)
    if initial_S is not None:
        S, z = S + initial_S, z + initial_z
    return out, S, z


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                              grad_final_z):
    """With W_ij = phi(q_i).phi(k_j) (allowed pairs), out_i = n_i / d_i, G_i = dout_i / d_i and
    g_i = -(dout_i . out_i) / d_i: dW_ij = G_i . v_j + g_i; d phi(q_i) = sum_j dW_ij phi(k_j) +
    S0 G_i + g_i z0; d phi(k_j) = sum_i dW_ij phi(q_i) + dS_F v_j + dz_F; dv_j = sum_i W_ij G_i +
    phi(k_j) dS_F (unpadded j); dS0 = sum_i phi(q_i)^T G_i + dS_F, dz0 = sum_i g_i phi(q_i) + dz_F."""
    c = _compute_dtype(q)
    qc, kc, vc, doutc = q.to(c), k.to(c), _unpadded(v.to(c), key_padding_mask), dout.to(c)
    weights, numerator, denominator = _linear_attention_terms(qc, kc, vc, key_padding_mask, is_causal, initial_S,
                                                              initial_z)
    denominator = denominator + eps
    out = numerator / denominator
    G = doutc / denominator
    g = -(doutc * out).sum(-1, keepdim=True) / denominator
    dweights = G @ vc.transpose(-2, -1) + g
    if is_causal:
        dweights = dweights.tril()
    if key_padding_mask is not None:
        dweights = dweights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    phi_q, phi_k = _elu_feature_map(qc), _unpadded(_elu_feature_map(kc), key_padding_mask)
    dphi_q = dweights @ phi_k
    dphi_k = dweights.transpose(-2, -1) @ phi_q
    dv = weights.transpose(-2, -1) @ G
    if initial_S is not None:
        dphi_q = dphi_q + G @ initial_S.to(c).transpose(-2, -1) + g * initial_z.to(c)[..., None, :]
    if grad_final_S is not None:
        dphi_k = dphi_k + vc @ grad_final_S.to(c).transpose(-2, -1)
        dv = dv + phi_k @ grad_final_S.to(c)
    if grad_final_z is not None:
        dphi_k = dphi_k + grad_final_z.to(c)[..., None, :]
    dq = dphi_q * _elu_derivative(qc)
    dk = _unpadded(dphi_k * _elu_derivative(kc), key_padding_mask)
    dv = _unpadded(dv, key_padding_mask)
    dS0 = dz0 = None
    if initial_S is not None:
        dS0 = phi_q.transpose(-2, -1) @ G
        dz0 = (g * phi_q).sum(-2)
        if grad_final_S is not None:
            dS0 = dS0 + grad_final_S.to(c)
        if grad_final_z is not None:
            dz0 = dz0 + grad_final_z.to(c)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dz0
