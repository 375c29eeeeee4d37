"""Input builders and the check shared by the softmax-attention tests of every backend."""
import functools

import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from helpers import assert_close_to_reference, compare_with_reference, max_error


def make_qkv(B, H, Nq, Nk, D, Dv=None, *, Hk=None, dtype=torch.float32, layout="bhnd", device="cpu"):
    """Fresh random q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv). layout "bhnd" is
    contiguous; "bnhd" returns transposed views of (B, N, H, D) tensors; "qkv" slices q, k, v out
    of one fused projection (B, N, 3, H, D) (needs Nq == Nk, Hk == H, Dv == D). Non-contiguous
    layouts exercise the kernels' stride handling."""
    Dv = D if Dv is None else Dv
    Hk = H if Hk is None else Hk
    if layout == "qkv":
        fused = torch.randn(B, Nq, 3, H, D, dtype=dtype, device=device)
        return tuple(fused[:, :, i].transpose(1, 2) for i in range(3))
    if layout == "bnhd":
        return (torch.randn(B, Nq, H, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Nk, Hk, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Nk, Hk, Dv, dtype=dtype, device=device).transpose(1, 2))
    return (torch.randn(B, H, Nq, D, dtype=dtype, device=device),
            torch.randn(B, Hk, Nk, D, dtype=dtype, device=device),
            torch.randn(B, Hk, Nk, Dv, dtype=dtype, device=device))


def inside_nan(t, margin=3):
    """A copy of `t` as a view into a NaN-filled tensor `margin` elements larger on each side of
    its last two dims: a kernel that reads past a row or past the last row picks up NaN."""
    big = torch.full((*t.shape[:-2], t.shape[-2] + 2 * margin, t.shape[-1] + 2 * margin), float("nan"),
                     dtype=t.dtype, device=t.device)
    view = big[..., margin:margin + t.shape[-2], margin:margin + t.shape[-1]]
    view.copy_(t)
    return view


def random_key_padding(B, Nk, *, fully_padded_row=None, device="cpu"):
    """(B, Nk) bool, True = padded: random valid lengths; `fully_padded_row` pads every key of that row."""
    lengths = torch.randint(1, Nk + 1, (B,), device=device)
    mask = torch.arange(Nk, device=device)[None, :] >= lengths[:, None]
    if fully_padded_row is not None:
        mask[fully_padded_row] = True
    return mask


def random_attn_mask(shape, kind, *, dtype=torch.float32, device="cpu"):
    """A bool (True = allowed, ~70% allowed) or float (random values with some -inf) mask of `shape`."""
    if kind == "bool":
        return torch.rand(shape, device=device) < 0.7
    mask = torch.randn(shape, dtype=dtype, device=device)
    return mask.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))


def check_attention(backend, q, k, v, *, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                    grads=True, atol=None, factor=2.0, attention=None, window_size=None, softcap=None,
                    alibi_slopes=None, sinks=None, dropout=None):
    """Output (and q, k, v gradients, and the sinks' where given) of tf.scaled_dot_product_attention
    on `backend` against the float64 reference, with the package's comparison policy (`factor` x
    the reference's error + `atol`). `attention`: another function with its signature to check
    instead (`backend` then only names it in messages). `dropout`: (p, generator seed, keep mask):
    the call runs with dropout_p = p after torch.manual_seed(generator seed), and the references
    drop what `keep` (the call's own mask, dropout_keep_mask) does not keep."""
    gqa = k.shape[1] != q.shape[1]
    attention = attention or functools.partial(tf.scaled_dot_product_attention, backend=backend)
    extras = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    p, generator_seed, keep = dropout or (0.0, None, None)

    def kernel(q, k, v, sinks=None):
        if p:
            torch.manual_seed(generator_seed)  # the public function draws its seed from torch's generator
        return attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa,
                         key_padding_mask=key_padding_mask, **_given(extras, sinks=sinks, dropout_p=p or None))

    def ref(q, k, v, sinks=None):
        mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
        return reference.scaled_dot_product_attention(q, k, v, mask, is_causal, scale,
                                                      key_padding_mask=key_padding_mask, sinks=sinks, dropout_mask=keep,
                                                      dropout_p=p, **extras)

    def flash(inputs, dout):  # inputs: q, k, v[, sinks]
        return flash_gradients(*inputs[:3], dout, *inputs[3:], attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                               is_causal=is_causal, scale=scale, dropout=None if keep is None else (p, keep), **extras)

    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    return compare_with_reference(kernel, ref, inputs, grad_inputs=tuple(range(len(inputs))) if grads else (),
                                  what=f"attention[{backend}]", atol=atol, factor=factor,
                                  gradient_formulation=flash)


def check_garbage_does_not_leak(q, k, v, key_padding_mask, garbage, what, is_causal=False, backend="cpp"):
    """`backend`'s output and q, k, v gradients with NaN stored in k and inf in v wherever
    `garbage` (broadcasting to k) is True, against the float64 reference on the clean inputs: the
    poisoned keys must be ones no query may attend. Returns compare_with_reference's result."""
    gqa = k.shape[1] != q.shape[1]

    def poisoned(q, k, v):
        k = k.masked_fill(garbage, float("nan"))
        v = v.masked_fill(garbage, float("inf"))
        return tf.scaled_dot_product_attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask,
                                               enable_gqa=gqa, backend=backend)

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask)

    return compare_with_reference(poisoned, ref, (q, k, v), grad_inputs=(0, 1, 2), what=what)


def check_float32_mask(attention, dtype, what, shape=(2, 4, 2, 17, 40, 24)):
    """A float32 attn_mask with a half-precision query, as torch's SDPA accepts it: added in float32,
    its gradient float32. `attention(q, k, v, attn_mask=..., enable_gqa=True)`. The mask's values sit
    near 2000, where the spacing of bf16 is 16 and of fp16 1: rounded to the query's dtype they would
    change every softmax by O(1) (the check asserts that, so it can fail). Output and the four
    gradients against the float64 reference, within 2x the error of torch's own SDPA on the same
    inputs (which keeps the mask in float32) or, for the gradients, of FlashAttention's equations
    (flash_gradients, whose dS the kernels compute). shape: (B, H, Hk, Nq, Nk, D)."""
    torch.manual_seed(3)
    B, H, Hk, Nq, Nk, D = shape
    qkv = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=dtype)
    mask = 2000 + 3 * torch.rand(H, Nq, Nk)
    mask[:, :, 5] = float("-inf")
    dout = torch.randn(B, H, Nq, D, dtype=torch.float64).to(dtype).double()  # as the kernels receive it

    def run(fn, dtype, mask):
        inputs = [t.detach().to(dtype).requires_grad_() for t in qkv] + [mask.detach().clone().requires_grad_()]
        out = fn(*inputs[:3], attn_mask=inputs[3], enable_gqa=True)
        return [out, *torch.autograd.grad(out, inputs, dout.to(out.dtype))]

    expected = run(F.scaled_dot_product_attention, torch.float64, mask.double())
    references = [[r] for r in run(F.scaled_dot_product_attention, dtype, mask)]
    flash = flash_gradients(*qkv, dout.to(dtype), attn_mask=mask, score_gradient=True)
    for alternatives, g in zip(references[1:], (*flash[:3], flash[3].sum(0))):  # the mask is shared by the batch
        alternatives.append(g)
    ours = run(attention, dtype, mask)
    assert ours[4].dtype == torch.float32 and ours[4].shape == mask.shape
    for name, a, b, c in zip(("output", "dq", "dk", "dv", "dmask"), ours, expected, references):
        assert_close_to_reference(a, b, c, what=f"{what} float32 mask: {name}")
    rounded = run(attention, dtype, mask.to(dtype))[0]
    assert max_error(rounded, expected[0]) > 10 * max_error(ours[0], expected[0])


def dropout_keep_mask(backend, q, k, p, generator_seed, **call):
    """The keep mask (B, H, Nq, Nk) bool of tf.scaled_dot_product_attention(q, k, v, **call) with
    dropout_p = p after torch.manual_seed(generator_seed), whatever v: the mask is a function of the
    seed and (batch, head, query, key), so a run with v = identity (Nk <= 256) shows it, as
    out = P * keep / (1 - p). Where P is 0 the mask changes nothing, and reads as dropped."""
    B, Hk, Nk = k.shape[:3]
    eye = torch.eye(Nk, dtype=q.dtype, device=q.device).expand(B, Hk, Nk, Nk)
    torch.manual_seed(generator_seed)
    with torch.no_grad():
        out = tf.scaled_dot_product_attention(q, k, eye, dropout_p=p, enable_gqa=Hk != q.shape[1], backend=backend,
                                              **call)
    return out != 0


def _given(kwargs, **more):
    """The keyword arguments that are not None."""
    return {k: v for k, v in {**kwargs, **more}.items() if v is not None}


def check_value_gradient(attention, q, k, v, *, key_padding_mask=None, factor=2.0, what="dV"):
    """Only dV of attention(q, k, v, enable_gqa=True, key_padding_mask=...) (fp32 inputs) against the
    float64 reference, with `factor` times the reference's error (autograd's or flash_gradients',
    the larger) as the bound and no absolute slack, for tests that pin dV's precision."""
    dout = torch.randn(*q.shape[:3], v.shape[3], dtype=torch.float64).float().double()  # as the kernel receives it

    def dv(fn, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*inputs), inputs[2], dout.to(dtype))[0]

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, None, False, None, key_padding_mask=key_padding_mask)

    def kernel(q, k, v):
        return attention(q, k, v, enable_gqa=True, key_padding_mask=key_padding_mask)

    flash_dv = flash_gradients(q, k, v, dout.float(), key_padding_mask=key_padding_mask)[2]
    assert_close_to_reference(dv(kernel, torch.float32), dv(ref, torch.float64), [dv(ref, torch.float32), flash_dv],
                              what=what, factor=factor, atol=0.0)


def flash_gradients(q, k, v, dout, sinks=None, *, attn_mask=None, key_padding_mask=None, is_causal=False,
                    scale=None, window_size=None, softcap=None, alibi_slopes=None, score_gradient=False, dropout=None):
    """dq, dk, dv (then dsinks, where sinks are given, and the float32 score gradient dS (B, H, Nq,
    Nk), the gradient of a float mask, with score_gradient) by FlashAttention-2's backward equations,
    unfused, with fp32 arithmetic on the inputs' values: P = exp(S - lse), dS = P * (dP - delta)
    with delta = rowsum(dO * O) taken from O as stored (in the inputs' dtype), through the
    soft-capping's tanh. The kernels use this delta, as FlashAttention-2 does, and it carries an
    error that autograd's delta = rowsum(P * dP) does not: where one key takes all of a row's
    probability, autograd's dS cancels to exactly 0 and this one is off by a rounding of |dO| |O|;
    with an fp16/bf16 O, by O's rounding. (Measured: the C++ and PyTorch CPU kernels both show
    it.) So its error, too, counts as the reference's error in the inputs' dtype. dsinks sums
    P_sink * delta over every row, which would add those roundings up: the kernels (and this)
    take it from rowsum(P * dP) instead. dropout (p, keep mask): P and dP with the dropped entries
    0 and the kept ones scaled by 1 / (1 - p), as the kernels' backward regenerates them."""
    dtype = q.dtype
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    group = H // Hk
    qf, kf, vf, dof = (t.detach().float() for t in (q, k, v, dout))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scale = D ** -0.5 if scale is None else scale
    raw = qf @ kf.transpose(-2, -1) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    s = s + reference.attention_bias(
        Nq, Nk, batch=B, heads=H, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
        window_size=window_size, alibi_slopes=alibi_slopes, dtype=torch.float32, device=q.device)
    no_key = torch.isneginf(s).all(dim=-1, keepdim=True)
    columns = s.masked_fill(no_key, float("-inf") if sinks is not None else 0.0)
    if sinks is not None:
        columns = torch.cat([columns, sinks.detach().float()[None, :, None, None].expand(B, H, Nq, 1)], dim=-1)
    lse = torch.logsumexp(columns, dim=-1, keepdim=True)
    p = torch.exp(s - lse).masked_fill(no_key, 0.0)
    drop = 1.0 if dropout is None else dropout[1].float() / (1 - dropout[0])
    out = ((p * drop) @ vf).to(dtype).float()
    dp = (dof @ vf.transpose(-2, -1)) * drop
    delta = (dof * out).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = ds @ kf * scale
    dk = (ds.transpose(-2, -1) @ qf * scale).unflatten(1, (Hk, group)).sum(dim=2)
    dv = ((p * drop).transpose(-2, -1) @ dof).unflatten(1, (Hk, group)).sum(dim=2)
    grads = [dq.to(dtype), dk.to(dtype), dv.to(dtype)]
    if sinks is not None:
        p_sink = torch.exp(sinks.detach().float()[None, :, None, None] - lse)
        grads.append(-(p_sink * (p * dp).sum(dim=-1, keepdim=True)).sum(dim=(0, 2, 3)).to(sinks.dtype))
    if score_gradient:
        grads.append(p * (dp - delta))
    return tuple(grads)


# The full grid on a GPU: every length pair for a head dim, dtype and causality; batch, heads,
# GQA, layout, padding, masks and the value head dim rotate across the cases.
GPU_LENGTHS = [(1, 1), (17, 17), (64, 64), (129, 129), (300, 300), (1, 300), (17, 129), (300, 64), (129, 17)]
GPU_HEAD_DIMS = [16, 40, 64, 80, 128, 256]


def check_gpu_grid(backend, D, dtype, is_causal):
    for i, (Nq, Nk) in enumerate(GPU_LENGTHS):
        case = 2 * i + 1 + int(is_causal)
        B = (1, 3)[case % 2]
        H, Hk = ((1, 1), (4, 4), (4, 2), (4, 1))[case % 4]
        layout = ("bhnd", "bnhd", "qkv")[case % 3] if (Nq == Nk and Hk == H) else ("bhnd", "bnhd")[case % 2]
        Dv = D if layout == "qkv" or case % 5 else max(1, D // 2 + 3)
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv=Dv, Hk=Hk, dtype=dtype, layout=layout, device="cuda")
        pad = random_key_padding(B, Nk, fully_padded_row=0 if B > 1 and case % 3 == 0 else None,
                                 device="cuda") if case % 3 != 1 else None
        mask = None
        if case % 4 == 2:
            mask = random_attn_mask((Nq, Nk), "bool", device="cuda")
        elif case % 4 == 3:
            mask = random_attn_mask((B, 1, Nq, Nk), "float", dtype=dtype, device="cuda")
        try:
            check_attention(backend, q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=is_causal)
        except AssertionError as exc:
            raise AssertionError(f"B={B} H={H} Hk={Hk} Nq={Nq} Nk={Nk} D={D} Dv={Dv} causal={is_causal} "
                                 f"layout={layout} pad={pad is not None} mask={None if mask is None else mask.dtype}"
                                 f": {exc}") from exc


def seed_tensor(seed):
    """A dropout seed as the kernel ops take it (a one-element int64 CPU tensor) from an int."""
    return torch.tensor(seed, dtype=torch.int64) if isinstance(seed, int) else seed


def kernel_attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend):
    """The attention_forward op of ``backend`` (its kernel with the op's contract), called directly."""
    from transformer_fast._device_kernels import op_kernel

    return op_kernel("attention_forward", backend, q.device.type)(q, k, v, attn_mask, key_padding_mask, is_causal,
                                                                  scale, dropout_p, seed_tensor(seed))


def kernel_attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                              backend, compute_dmask=False):
    """The attention_backward op of ``backend``, called directly: (dq, dk, dv, dmask or empty,
    delta (empty))."""
    from transformer_fast._device_kernels import op_kernel

    return op_kernel("attention_backward", backend, q.device.type)(dout, q, k, v, out, lse, attn_mask,
                                                                   key_padding_mask, is_causal, scale, dropout_p,
                                                                   seed_tensor(seed), compute_dmask)


def differentiable_attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend,
                             **extras):
    """The output of the attention_forward op run by ``backend``'s kernels (the path ``backend=``
    takes: the op's own autograd formula, the named backend's kernels below it)."""
    from transformer_fast import _backends

    with _backends.named(backend):
        return torch.ops.transformer_fast.attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale,
                                                            dropout_p, seed_tensor(seed), **extras)[0]


def record_launches(monkeypatch):
    """Replaces the Triton attention launches with recorders: returns the list that collects the
    kernels' names, in launch order (nothing runs)."""
    from transformer_fast.kernels import attention as ka

    launches = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):  # launch[grid](...)
            return lambda *args, **kwargs: launches.append(self.name)

        def __call__(self, key, grid, *args, **kwargs):  # the autotuned kernels' TunedLaunch
            launches.append(self.name)

        def run(self, plan, tensors, seed=0):  # a launch plan's (kernels/_launch.py)
            launches.append(self.name)

    for attr, name in (("launch_fwd", "attention_fwd_kernel"), ("launch_combine", "attention_combine_kernel"),
                       ("launch_preprocess", "attention_bwd_preprocess_kernel"),
                       ("launch_dkdv", "attention_bwd_dkdv_kernel"), ("launch_dq", "attention_bwd_dq_kernel"),
                       ("launch_dq_convert", "attention_bwd_dq_convert_kernel")):
        monkeypatch.setattr(ka, attr, Recorded(name))
    return launches


def record_launches_and_ops(monkeypatch, run):
    """(kernel launches, torch ops) of run(kernels.attention) with the launches recorded, not run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from transformer_fast.kernels import attention as ka

    launches = record_launches(monkeypatch)
    ops = []

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with RecordOps():
        run(ka)
    return launches, ops
