"""Random linear-attention calls against the float64 reference (transformer_fast.reference.linear_attention)
with the package's comparison policy (tests/helpers.py: at most 2x the error of the reference evaluated
in the call's dtype, or for gradients of the kernels' O(N) equations in that dtype, whichever errs
most: `_linear_form_gradients`): dtypes, batch and head counts, odd lengths (0, 1, 17, 129, ...), unequal query and
key lengths, odd and unequal query/value head dims, (B, N, H, D) strides, q/k/v sliced out of a fused
projection or out of wider rows, keys/values expanded over heads (stride 0), causal or not, key padding
(suffixes, scattered keys, fully padded sequences), eps values and magnitudes, an initial state (strided
or not, passed as a LinearAttentionState or a plain pair) and the final state, with losses on the output,
on the final state or on both; and the recurrent form, linear_attention_step token by token, which must
meet the same rule as the causal parallel call it equals. Checked: the output, the final state, the
gradients of q, k, v and of the initial state, their dtypes, shapes and contiguity. Refused combinations
(a causal call with unequal lengths, mixed dtypes, a state of the wrong dtype, head dims over 256, and
bf16 on the Triton interpreter) must raise with a clear message. Draws are seeded: a failure names its
seed and configuration, and `check_draw(seed)` reruns it.

Slow: about 20 s for the C++ backend's 3,000 draws, 45 s for the Triton backend's 200 under the
interpreter (fp32/fp16, small shapes)."""
import contextlib
import os
import random

import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference
from transformer_fast.linear_attention import LinearAttentionState

from attention_cases import make_qkv
from helpers import TRITON_TESTS, assert_close_to_reference, check_seeded_draw, check_seeded_draws, kernel_device

pytestmark = pytest.mark.slow

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (0, 1, 2, 5, 17, 64, 129)
KEY_LENGTHS = (0, 1, 5, 17, 129, 200)
DIMS = (1, 3, 8, 13, 16, 24, 40, 64, 128)
VALUE_DIMS = (1, 5, 16, 33, 64)
REFUSALS = ("causal lengths", "mixed dtypes", "state dtype", "head dim")


def draw(seed, dtypes=DTYPES, lengths=LENGTHS, key_lengths=KEY_LENGTHS, dims=DIMS, max_bh=6, max_step=17):
    rnd = random.Random(seed)
    dtype = rnd.choice(dtypes)
    B = rnd.choice([1, 2])
    H = rnd.choice([h for h in (1, 2, 3) if B * h <= max_bh])
    causal = rnd.random() < 0.45
    Nq = rnd.choice(lengths)
    Nk = Nq if causal else rnd.choice(key_lengths)
    D = rnd.choice(dims)
    Dv = rnd.choice([D, D] + list(VALUE_DIMS))
    layouts = ["bhnd", "bhnd", "bnhd", "sliced", "head-expanded"] + (["qkv"] if Nq == Nk and D == Dv else [])
    step = causal and 1 <= Nq <= max_step and rnd.random() < 0.25  # token by token with linear_attention_step
    state = rnd.random() < (0.6 if step else 0.4)
    output_final_state = step or rnd.random() < 0.5
    layout = rnd.choice(layouts)
    padding = None if step or not Nk else rnd.choice([None, None, "suffix", "scattered"])
    fully_padded = B > 1 and rnd.random() < 0.3
    state_form, strided_state = rnd.choice(["LinearAttentionState", "tuple"]), rnd.random() < 0.5
    loss_on = rnd.choice([("out", "S", "z"), ("out",), ("S", "z"), ("z",)]) if output_final_state else ("out",)
    # fp16: a query with no unpadded key (and no state) has the denominator eps, whose square in the
    # reference's gradient underflows at 1e-6: NaN there, and no test at all
    eps = rnd.choice([1e-6, 1e-6, 1e-3, 0.1] if dtype != torch.float16 else [1e-3, 0.1, 1e-6 if state else 0.1])
    scale = rnd.choice([1.0, 1.0, 0.1] + ([3.0] if dtype != torch.float16 else []))  # fp16: no overflow
    return dict(dtype=dtype, B=B, H=H, Nq=Nq, Nk=Nk, D=D, Dv=Dv, causal=causal, layout=layout, padding=padding,
                fully_padded=fully_padded, state=state, state_form=state_form, strided_state=strided_state,
                output_final_state=output_final_state, loss_on=loss_on, eps=eps, scale=scale, step=step,
                backend=rnd.choice(["cpp", "auto"]), refusal=rnd.choice(REFUSALS) if rnd.random() < 0.04 else None)


def make_inputs(c, device):
    B, H, Nq, Nk, D, Dv, dtype = (c[k] for k in ("B", "H", "Nq", "Nk", "D", "Dv", "dtype"))
    if c["layout"] in ("bhnd", "bnhd", "qkv"):
        q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, dtype=dtype, layout=c["layout"], device=device)
    elif c["layout"] == "sliced":  # each row a slice of a wider one (a row stride of D + 3)
        q, k, v = (torch.randn(B, H, n, d + 3, dtype=dtype, device=device)[..., 1:d + 1]
                   for n, d in ((Nq, D), (Nk, D), (Nk, Dv)))
    else:  # "head-expanded": one key/value head seen by every head (a stride of 0)
        q = torch.randn(B, H, Nq, D, dtype=dtype, device=device)
        k = torch.randn(B, 1, Nk, D, dtype=dtype, device=device).expand(B, H, Nk, D)
        v = torch.randn(B, 1, Nk, Dv, dtype=dtype, device=device).expand(B, H, Nk, Dv)
    q, k, v = (t * c["scale"] for t in (q, k, v)) if c["scale"] != 1.0 else (q, k, v)
    mask = None
    if c["padding"] == "suffix":
        mask = torch.arange(Nk, device=device)[None, :] >= torch.randint(1, Nk + 1, (B, 1), device=device)
    elif c["padding"] == "scattered":
        mask = torch.rand(B, Nk, device=device) < 0.3
    if mask is not None and c["fully_padded"]:
        mask[-1] = True
    S0 = z0 = None
    if c["state"]:
        # the sums that 9 earlier keys leave (S = sum phi(k)^T v, z = sum phi(k) > 0)
        k0, v0 = torch.randn(B, H, 9, D, dtype=torch.float64), torch.randn(B, H, 9, Dv, dtype=torch.float64)
        _, (S0, z0) = reference.linear_attention(k0[:, :, :0], k0, v0, output_final_state=True)
        S0, z0 = S0.to(device, torch.float32), z0.to(device, torch.float32)
        if c["strided_state"]:  # S a transposed copy's view, z a strided slice
            S0 = S0.transpose(-2, -1).contiguous().transpose(-2, -1)
            z0 = torch.stack([z0, -z0], dim=-1)[..., 0]
    return q, k, v, mask, S0, z0


def _state(c, S0, z0):
    if S0 is None:
        return None
    return LinearAttentionState(S0, z0) if c["state_form"] == "LinearAttentionState" else (S0, z0)


@contextlib.contextmanager
def _backend_env(backend):
    """linear_attention_step has no backend argument: TRANSFORMER_FAST_BACKEND chooses it."""
    before = os.environ.get("TRANSFORMER_FAST_BACKEND")
    if backend not in ("auto", "cpp"):
        os.environ["TRANSFORMER_FAST_BACKEND"] = backend
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRANSFORMER_FAST_BACKEND", None)
        else:
            os.environ["TRANSFORMER_FAST_BACKEND"] = before


def _kernel(c, backend, mask):
    def run(q, k, v, S0, z0):
        state = _state(c, S0, z0)
        if c["step"]:  # the recurrent form, one token at a time
            outs = []
            for i in range(q.shape[2]):
                out, state = tf.linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], state, eps=c["eps"])
                outs.append(out)
            return torch.stack(outs, dim=2), state.S, state.z
        result = tf.linear_attention(q, k, v, is_causal=c["causal"], key_padding_mask=mask, eps=c["eps"],
                                     initial_state=state, output_final_state=c["output_final_state"],
                                     backend=backend)
        if c["output_final_state"]:
            out, final = result
            assert isinstance(final, LinearAttentionState)
            return out, final.S, final.z
        assert isinstance(result, torch.Tensor)
        return result, None, None
    return run


def _reference(c, mask):
    def run(q, k, v, S0, z0):
        result = reference.linear_attention(q, k, v, is_causal=c["causal"], key_padding_mask=mask, eps=c["eps"],
                                            initial_state=None if S0 is None else (S0, z0),
                                            output_final_state=c["output_final_state"])
        return (result[0], *result[1]) if c["output_final_state"] else (result, None, None)
    return run


def _linear_form_gradients(c, mask, tensors, upstream):
    """The kernels' O(N) backward (csrc/cpu/linear_attention.cpp's header) in plain torch, in the call's
    dtype: with V' = [V, 1] (0 for padded keys), S'_i the state row i sees, den_i = n'_i[Dv] + eps
    for n'_i = phi(q_i) S'_i, and G'_i = [dO_i / den_i, -(dO_i . out_i) / den_i]: d phi(q_i) =
    S'_i G'_i; with R'_j = dS'_F + the sum over the rows i that see key j of phi(q_i)^T G'_i,
    d phi(k_j) = R'_j v'_j and dv_j = R'_j[:, :Dv]^T phi(k_j); dS'0 = dS'_F + sum_i phi(q_i)^T G'_i.
    It sums before it cancels, so its error can exceed the per-pair reference's (a key that every
    query leans on: out_i ~ v_j, and d phi(k_j) an eps-sized difference of two sums); admitted as
    a formulation of the gradients, as attention's delta = rowsum(dO * O) is."""
    dt = c["dtype"]
    q, k, v, S0, z0 = (None if t is None else t.detach().to(dt) for t in tensors)
    B, H, Nq, D = q.shape
    Dv = v.shape[-1]
    kept = (torch.ones(B, k.shape[2], device=q.device) if mask is None else (~mask).float()).to(dt)[:, None, :, None]
    phi_q, phi_k = F.elu(q) + 1, (F.elu(k) + 1) * kept
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], -1) * kept
    start = (torch.zeros(B, H, D, Dv + 1, dtype=dt, device=q.device) if S0 is None
             else torch.cat([S0, z0[..., None]], -1))
    keys = phi_k[..., :, None] * v1[..., None, :]  # (B, H, Nk, D, E)
    states = start[:, :, None] + (keys.cumsum(2) if c["causal"] else keys.sum(2, keepdim=True))
    n = (phi_q[..., None, :] @ states).squeeze(-2)
    den = n[..., Dv:] + c["eps"]
    out = n[..., :Dv] / den
    dout, dS, dz = (u.to(q.device, dt) if name in c["loss_on"] else torch.zeros(u.shape, dtype=dt, device=q.device)
                    for name, u in zip(("out", "S", "z"), upstream))
    G = torch.cat([dout / den, -(dout * out).sum(-1, keepdim=True) / den], -1)
    dphi_q = (states @ G[..., :, None]).squeeze(-1)
    rows = phi_q[..., :, None] * G[..., None, :]  # (B, H, Nq, D, E)
    final = torch.cat([dS, dz[..., None]], -1)
    R = final[:, :, None] + (rows.flip(2).cumsum(2).flip(2) if c["causal"] else rows.sum(2, keepdim=True))
    dphi_k = (R @ v1[..., :, None]).squeeze(-1)
    dv = (R[..., :Dv].transpose(-2, -1) @ phi_k[..., :, None]).squeeze(-1)
    elu_grad = [torch.where(x > 0, 1.0, torch.exp(x)) for x in (q, k)]
    d0 = final + rows.sum(2)
    return [dphi_q * elu_grad[0], dphi_k * elu_grad[1] * kept, dv * kept,
            None if S0 is None else d0[..., :Dv], None if S0 is None else d0[..., Dv]]


def _outputs_and_grads(fn, leaves, upstream, loss_on):
    """[out, S, z] and the gradients of the leaves for the upstream gradients of the outputs in
    `loss_on` (zeros for a leaf no gradient reaches)."""
    outs = list(fn(*leaves))
    picked = [(o, g) for name, o, g in zip(("out", "S", "z"), outs, upstream) if name in loss_on and o is not None]
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad([o for o, _ in picked], used, [g.to(o.device, o.dtype) for o, g in picked],
                                     allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads) if t is not None else None
        result.append(torch.zeros_like(t) if t is not None and g is None else g)
    return outs + result


def _check_refusal(c, backend, q, k, v, mask, S0, z0):
    def call(q=q, k=k, v=v, mask=mask, state=_state(c, S0, z0), causal=c["causal"]):
        return tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, initial_state=state,
                                   backend=backend)

    kind = c["refusal"]
    if kind == "causal lengths":
        n = 1 if k.shape[2] + 1 != q.shape[2] else 2  # keys added: their length then differs from the queries'
        with pytest.raises(ValueError, match="causal linear attention needs equal query and key lengths"):
            call(k=torch.cat([k, torch.randn(*k.shape[:2], n, k.shape[3], dtype=k.dtype, device=k.device)], dim=2),
                 v=torch.cat([v, torch.randn(*v.shape[:2], n, v.shape[3], dtype=v.dtype, device=v.device)], dim=2),
                 mask=None, causal=True)
    elif kind == "mixed dtypes":
        other = torch.float16 if q.dtype != torch.float16 else torch.float32
        with pytest.raises(TypeError, match=r"value has dtype .* but query has"):
            call(v=v.to(other))
    elif kind == "state dtype":  # the state of half inputs is float32, as is float32's
        B, H, _, D = q.shape
        wrong = torch.float64 if q.dtype == torch.float32 else q.dtype
        S = torch.zeros(B, H, D, v.shape[-1], dtype=wrong, device=q.device)
        with pytest.raises(TypeError, match=r"initial_state.S must have dtype torch.float32"):
            call(state=(S, torch.zeros(B, H, D, device=q.device)))
    else:
        with pytest.raises(ValueError, match="head dim must be between 1 and 256"):
            call(q=torch.randn(*q.shape[:3], 257, dtype=q.dtype, device=q.device),
                 k=torch.randn(*k.shape[:3], 257, dtype=q.dtype, device=q.device), state=None)


def check(c, backend, device="cpu"):
    """The call of draw `c` on `backend` against the float64 reference, the reference run in the
    inputs' dtype (the initial state cast with them, as tests/test_linear_attention_state.py does)
    giving the yardstick."""
    q, k, v, mask, S0, z0 = make_inputs(c, device)
    if c["refusal"]:
        _check_refusal(c, backend, q, k, v, mask, S0, z0)
        return
    tensors = (q, k, v, S0, z0)
    B, H, Nq, D = q.shape
    Dv = v.shape[-1]
    upstream = [torch.randn(s, dtype=torch.float64).to(dt).double()  # as the outputs' dtypes take them
                for s, dt in (((B, H, Nq, Dv), c["dtype"]), ((B, H, D, Dv), torch.float32), ((B, H, D), torch.float32))]
    leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
    with _backend_env(backend if c["step"] else "auto"):
        got = _outputs_and_grads(_kernel(c, backend, mask), leaves, upstream, c["loss_on"])
    exact = _outputs_and_grads(_reference(c, mask), [None if t is None else t.detach().double().requires_grad_()
                                                     for t in tensors], upstream, c["loss_on"])
    lowp = _outputs_and_grads(_reference(c, mask), [None if t is None else t.detach().to(c["dtype"]).requires_grad_()
                                                    for t in tensors], upstream, c["loss_on"])
    out, S, z = got[:3]
    assert out.dtype == c["dtype"] and out.shape == (B, H, Nq, Dv) and out.is_contiguous(), \
        f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    if c["output_final_state"]:
        for name, t, shape in (("final S", S, (B, H, D, Dv)), ("final z", z, (B, H, D))):
            assert t.dtype == torch.float32 and t.shape == shape and t.is_contiguous(), \
                f"{name}: {t.dtype} {tuple(t.shape)} {t.stride()}"
    formulation = [None] * 3 + _linear_form_gradients(c, mask, tensors, upstream)
    names = ("out", "final S", "final z", "dq", "dk", "dv", "d initial S", "d initial z")
    for name, g, e, l, f, t in zip(names, got, exact, lowp, formulation, (None,) * 3 + tensors):
        if e is None:
            continue
        if t is not None:
            assert g.dtype == t.dtype and g.shape == t.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        # a draw whose references overflow would test nothing
        assert torch.isfinite(e).all() and torch.isfinite(l).all(), f"{name}: the draw's reference is not finite"
        lowps = [l.to(g.dtype)] + ([f.to(g.device, g.dtype)] if f is not None and torch.isfinite(f).all() else [])
        assert_close_to_reference(g, e, lowps, what=name)  # no NaN, and within 2x
    if c["fully_padded"] and mask is not None and not c["state"]:  # a sequence with no key attends to nothing
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "out of the fully padded sequence is not 0"


def check_draw(seed, backend="cpp", device="cpu", **kwargs):
    """Draw `seed` on the C++ backend (named or "auto", as drawn) or on `backend`."""
    check_seeded_draw(draw, check, seed, backend, device, **kwargs)


def check_draws(seeds, *args, **kwargs):
    check_seeded_draws(draw, check, seeds, *args, **kwargs)


@pytest.mark.parametrize("block", range(15))
def test_cpp_linear_attention_random_calls(block):
    check_draws(range(block * 200, (block + 1) * 200))


@pytest.mark.parametrize("block", range(4))
@TRITON_TESTS[0]
@TRITON_TESTS[1]
def test_triton_linear_attention_random_calls(block):
    device = kernel_device()
    if device == "cuda":
        dtypes, small = DTYPES, {}
    else:  # bf16 is refused under the interpreter (docs/design.md); its shapes kept small for its time
        dtypes = (torch.float32, torch.float16)
        small = dict(lengths=(0, 1, 2, 5, 17, 33, 129), key_lengths=(0, 1, 5, 17, 40), dims=(1, 3, 8, 13, 16, 24, 40),
                     max_bh=2, max_step=5)
    check_draws(range(block * 50, (block + 1) * 50), "triton", device, dtypes=dtypes, **small)


@TRITON_TESTS[0]
@TRITON_TESTS[1]
def test_triton_interpreter_refuses_bfloat16():
    """Not drawn above: under the interpreter the Triton backend refuses bf16 linear attention with its reason."""
    if kernel_device() == "cuda":
        pytest.skip("on a GPU bf16 linear attention is served, and the fuzz above draws it")
    q, k, v = make_qkv(1, 2, 5, 5, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"unavailable for torch.bfloat16 .*triton-lang/triton#11584"):
        tf.linear_attention(q, k, v, is_causal=True, backend="triton")
