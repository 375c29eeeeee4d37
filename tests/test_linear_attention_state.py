"""Linear attention with a carried state: ``initial_state`` in, the final state out.

Every backend (plain torch, C++, Triton under the interpreter) against the float64 oracle with the
project's policy (helpers.py: at most 2x the oracle's own error in the inputs' dtype), for the
output, the final state and the gradients of q, k, v and the initial state; a prefill split into
calls that carry the state against one call; token-by-token decoding against the causal call;
the state's checks; NaN in padded keys; compile, transforms and autocast with a state.
"""
import pytest
import torch
from torch.func import jvp

import transformer_fast as tf
from transformer_fast import _backends, reference
from transformer_fast.linear_attention import LinearAttentionState

from attention_cases import make_qkv, random_key_padding
from helpers import assert_close_to_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPP_STATUS = tf.available_backends()["cpp"]["cpu"]
CPP_REASON = None if CPP_STATUS == "ok" else CPP_STATUS
TRITON_REASON = _backends.unavailable_reason("triton", torch.device(DEVICE))
CPP = pytest.param("cpp", marks=pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON)))
TRITON = pytest.param("triton", marks=[pytest.mark.triton,
                                       pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))])
BACKENDS = ["reference", CPP, TRITON]


def _device(backend):
    return DEVICE if backend == "triton" else "cpu"


def earlier_state(B, H, D, Dv, *, n=9, strided=False, device="cpu", dtype=torch.float32):
    """The state n earlier random keys leave (S = sum phi(k)^T v, z = sum phi(k) > 0), as a prefix
    would. strided: S a transposed view, z a strided slice (the kernels read any strides)."""
    k = torch.randn(B, H, n, D, dtype=torch.float64)
    v = torch.randn(B, H, n, Dv, dtype=torch.float64)
    _, (S, z) = reference.linear_attention(k[:, :, :0], k, v, output_final_state=True)
    S, z = S.to(device, dtype), z.to(device, dtype)
    if strided:
        S = S.transpose(-2, -1).contiguous().transpose(-2, -1)
        z = torch.stack([z, -z], dim=-1)[..., 0]
    return S, z


def ours(backend, causal, mask):
    def fn(q, k, v, S0, z0):
        state = None if S0 is None else LinearAttentionState(S0, z0)
        return tf.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, initial_state=state,
                                   output_final_state=True, backend=backend)
    return fn


def oracle(causal, mask):
    def fn(q, k, v, S0, z0):
        state = None if S0 is None else (S0, z0)
        return reference.linear_attention(q, k, v, is_causal=causal, key_padding_mask=mask, initial_state=state,
                                          output_final_state=True)
    return fn


def outputs_and_gradients(fn, tensors, dtype, upstream, loss_on):
    """[out, S, z, dq, dk, dv, dS0, dz0] of fn on `tensors` cast to `dtype` (None: as given), the
    gradients for the upstream gradients of the outputs named in `loss_on` (0 where none reaches)."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    out, (S, z) = fn(*leaves)
    outs = [out, S, z]
    picked = [(o, g.to(o.dtype)) for name, o, g in zip(("out", "S", "z"), outs, upstream) if name in loss_on]
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad([o for o, _ in picked], used, [g for _, g in picked], allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads) if t is not None else None
        result.append(torch.zeros_like(t) if t is not None and g is None else g)
    return outs + result


def check(backend, q, k, v, S0, z0, *, causal, mask, what, loss_on=("out", "S", "z")):
    """Ours against the float64 oracle: each output and gradient's error at most 2x the oracle's
    in the inputs' dtype (the initial state cast with them)."""
    tensors = (q, k, v, S0, z0)
    upstream = _upstream(q, k, v)
    got = outputs_and_gradients(ours(backend, causal, mask), tensors, None, upstream, loss_on)
    exact = outputs_and_gradients(oracle(causal, mask), tensors, torch.float64, upstream, loss_on)
    lowp = outputs_and_gradients(oracle(causal, mask), tensors, q.dtype, upstream, loss_on)
    names = ("out", "final S", "final z", "dq", "dk", "dv", "d initial S", "d initial z")
    for name, g, e, l in zip(names, got, exact, lowp):
        if e is None:
            continue
        assert g.shape == e.shape, f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        assert_close_to_reference(g, e, l, what=f"{what} {name}")
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    assert got[1].dtype == got[2].dtype == state_dtype and got[1].is_contiguous() and got[2].is_contiguous()
    return got


def _upstream(q, k, v):
    g = torch.Generator().manual_seed(7)
    B, H, Nq, D = q.shape
    Dv = v.shape[-1]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(q.device)
            for s in ((B, H, Nq, Dv), (B, H, D, Dv), (B, H, D))]


# (B, H, Nq, Nk, D, Dv, causal, padded, layout): one token, 17 and 129 tokens (across the C++
# kernel's 64-token chunks), unequal lengths, non-power-of-two head dims, padding with a fully
# padded sequence, transposed inputs and state; N = 0 (the state passes through), a query of a
# stored memory (no keys), and the state of keys alone (no queries).
CASES = {
    "causal-17": (2, 2, 17, 17, 24, 40, True, True, "bnhd"),
    "causal-129": (1, 2, 129, 129, 40, 16, True, False, "bhnd"),
    "causal-1": (2, 3, 1, 1, 16, 24, True, True, "bhnd"),
    "full-17x129": (2, 2, 17, 129, 24, 40, False, True, "bnhd"),
    "full-9x33": (2, 2, 9, 33, 24, 16, False, True, "bnhd"),
    "full-129x17": (2, 2, 129, 17, 40, 24, False, False, "bhnd"),
    "causal-0": (2, 2, 0, 0, 24, 16, True, False, "bhnd"),
    "memory-query": (2, 2, 5, 0, 24, 16, False, False, "bnhd"),
    "keys-only": (2, 2, 0, 17, 24, 16, False, True, "bhnd"),
}
LOWP_CASES = ("causal-17", "causal-129", "full-17x129", "memory-query")
TRITON_CASES = ("causal-17", "causal-1", "full-9x33", "causal-0", "memory-query", "keys-only")  # interpreter time


def _inputs(case, dtype, device):
    B, H, Nq, Nk, D, Dv, causal, padded, layout = CASES[case]
    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv, dtype=dtype, layout=layout, device=device)
    S0, z0 = earlier_state(B, H, D, Dv, strided=layout == "bnhd", device=device)
    if dtype == torch.float64:
        S0, z0 = S0.double(), z0.double()
    mask = random_key_padding(B, Nk, fully_padded_row=B - 1, device=device) if padded and Nk else None
    return q, k, v, S0, z0, causal, mask


def _grid():
    for backend in BACKENDS:
        name = backend if isinstance(backend, str) else backend.values[0]
        for case in CASES:
            dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if case in LOWP_CASES else [])
            if name == "triton":
                if case not in TRITON_CASES:
                    continue
                dtypes = [torch.float32] + ([torch.float16] if case == "causal-17" else [])
            for dtype in dtypes:
                yield pytest.param(name, case, dtype, id=f"{name}-{case}-{str(dtype)[6:]}",
                                   marks=backend.marks if not isinstance(backend, str) else ())


@pytest.mark.parametrize("backend,case,dtype", list(_grid()))
def test_matches_oracle(backend, case, dtype):
    q, k, v, S0, z0, causal, mask = _inputs(case, dtype, _device(backend))
    got = check(backend, q, k, v, S0, z0, causal=causal, mask=mask, what=f"{backend} {case} {dtype}")
    if mask is not None:  # the fully padded sequence sees the initial state alone, and leaves it as it was
        B = q.shape[0]
        torch.testing.assert_close(got[1][B - 1], S0[B - 1], rtol=0, atol=0)
        torch.testing.assert_close(got[2][B - 1], z0[B - 1], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["causal-17", "full-17x129"])
def test_float64_takes_the_reference_backend_exactly(case):
    q, k, v, S0, z0, causal, mask = _inputs(case, torch.float64, "cpu")
    check("auto", q, k, v, S0, z0, causal=causal, mask=mask, what=f"float64 {case}")


def _losses():
    for backend in BACKENDS:
        name, marks = (backend, ()) if isinstance(backend, str) else (backend.values[0], backend.marks)
        for loss_on, what in ((("out",), "out-only"), (("S", "z"), "state-only"), (("z",), "z-only")):
            if name != "triton" or what != "z-only":  # interpreter time
                yield pytest.param(name, loss_on, id=f"{name}-{what}", marks=marks)


@pytest.mark.parametrize("backend,loss_on", list(_losses()))
def test_gradients_from_each_output_alone(backend, loss_on):
    """A loss on the output alone (the final state gets no gradient), on the final state alone
    (the output gets none: the backward starts from the state's gradient), or on z alone."""
    for case in ("causal-17", "full-9x33"):
        q, k, v, S0, z0, causal, mask = _inputs(case, torch.float32, _device(backend))
        check(backend, q, k, v, S0, z0, causal=causal, mask=mask, what=f"{backend} {case} loss on {loss_on}",
              loss_on=loss_on)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_initial_state_the_final_state_is_the_keys_sums(backend):
    device = _device(backend)
    q, k, v = make_qkv(2, 2, 17, 17, 24, 40, device=device)
    mask = random_key_padding(2, 17, fully_padded_row=1, device=device)
    got = check(backend, q, k, v, None, None, causal=True, mask=mask, what=f"{backend} no initial state")
    assert torch.equal(got[1][1], torch.zeros_like(got[1][1])) and torch.equal(got[2][1], torch.zeros_like(got[2][1]))


# ----------------------------------------------------------------------------------------------
# Carrying the state: split prefill, token-by-token decoding
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [CPP, TRITON])
@pytest.mark.parametrize("is_causal", [False, True])
def test_final_state_of_a_long_sequence_within_the_rule(backend, is_causal):
    """The final state after 8,192 keys (z sums positive terms, and values with a mean make S do so
    too) within the 2x rule: summed in float32 as it grows, its rounding grew with the length (the
    C++ final z 2.6-6x torch's summation error at 20k keys, Triton's 2.7-6x at 2k-8k)."""
    device = _device(backend)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 8192, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 1, 8192, 16, generator=gen) + 0.5
    _, state = tf.linear_attention(*(t.to(device) for t in (q, k, v)), is_causal=is_causal, output_final_state=True,
                                   backend=backend)
    exact = reference.linear_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                       output_final_state=True)[1]
    rounded = reference.linear_attention(q, k, v, is_causal=is_causal, output_final_state=True)[1]
    for name, got, ref64, ref32 in zip("Sz", state, exact, rounded):
        assert_close_to_reference(got.cpu(), ref64, ref32, what=f"final {name}")


def _split_run(fn, q, k, v, S0, z0, mask, cuts):
    """(out, S, z) of the causal call over [0, N) cut at `cuts`, each part starting from the state
    the previous part left."""
    outs, state = [], (S0, z0)
    bounds = [0, *cuts, q.shape[2]]
    for a, b in zip(bounds, bounds[1:]):
        out, state = fn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], *state, None if mask is None else mask[:, a:b])
        outs.append(out)
    return torch.cat(outs, dim=2), *state


def _prefill(backend):
    def fn(q, k, v, S0, z0, mask):
        out, state = tf.linear_attention(q, k, v, is_causal=True, key_padding_mask=mask,
                                         initial_state=LinearAttentionState(S0, z0), output_final_state=True,
                                         backend=backend)
        return out, tuple(state)
    return fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["at-a-chunk", "anywhere"])
def test_split_prefill_equals_one_call(backend, where):
    """Outputs, the final state and every gradient (q, k, v and the initial state, for a loss on
    the outputs and the final state) of a causal prefill cut into calls that carry the state equal
    those of one call, to the rounding of the carried state (float32 between calls; the C++ kernel
    sums it in float64 within a call)."""
    device = _device(backend)
    # (N, cuts): the C++ kernel's chunks are 64 tokens, the fp32 Triton scan's 16 (shorter: interpreter time)
    N, cuts = {("at-a-chunk", False): (129, (64,)), ("anywhere", False): (129, (50, 51, 100)),
               ("at-a-chunk", True): (40, (16,)), ("anywhere", True): (40, (13, 30))}[where, backend == "triton"]
    B = 2 if backend != "triton" else 1
    q, k, v = make_qkv(B, 2, N, N, 24, 40, layout="bnhd", device=device)
    S0, z0 = earlier_state(B, 2, 24, 40, device=device)
    mask = random_key_padding(B, N, device=device) | (torch.rand(B, N, device=device) < 0.2)
    fn = _prefill(backend)
    upstream = [u.float() for u in _upstream(q, k, v)]

    def one_call(*args):
        out, state = fn(*args, mask)
        return out, *state

    results = []
    for run in (one_call, lambda *args: _split_run(fn, *args, mask, cuts)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, S0, z0)]
        outs = run(*leaves)
        results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, upstream)))
    for name, one, split in zip(("out", "S", "z", "dq", "dk", "dv", "dS0", "dz0"), *results):
        torch.testing.assert_close(split, one, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=TRITON.marks)])
def test_decoding_token_by_token_equals_the_causal_call(backend, monkeypatch):
    """linear_attention_step over the tokens from an initial state gives the causal call's outputs,
    final state and gradients (for a loss on every output and the last state), the initial state's
    included."""
    if backend == "triton":
        monkeypatch.setenv("TRANSFORMER_FAST_BACKEND", "triton")
    device = _device(backend)
    B, H, N, D, Dv = (2, 3, 23, 24, 40) if backend == "auto" else (1, 2, 4, 16, 16)  # interpreter time
    q, k, v = make_qkv(B, H, N, N, D, Dv, device=device)
    S0, z0 = earlier_state(B, H, D, Dv, device=device)
    upstream = [u.float() for u in _upstream(q, k, v)]
    results = []
    for decode in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, S0, z0)]
        ql, kl, vl, S, z = leaves
        if decode:
            state, steps = LinearAttentionState(S, z), []
            for i in range(N):
                out, state = tf.linear_attention_step(ql[:, :, i], kl[:, :, i], vl[:, :, i], state)
                steps.append(out)
            outs = [torch.stack(steps, dim=2), *state]
        else:
            out, state = tf.linear_attention(ql, kl, vl, is_causal=True, initial_state=(S, z), output_final_state=True)
            outs = [out, *state]
        results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, upstream)))
    for name, parallel, recurrent in zip(("out", "S", "z", "dq", "dk", "dv", "dS0", "dz0"), *results):
        torch.testing.assert_close(recurrent, parallel, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", [CPP, TRITON])
def test_nan_in_padded_keys_stays_out_of_the_state(backend):
    device = _device(backend)
    q, k, v = make_qkv(2, 2, 20, 20, 16, 24, device=device)
    S0, z0 = earlier_state(2, 2, 16, 24, device=device)
    mask = random_key_padding(2, 20, device=device)
    mask[0, -5:] = True
    mask[1] = True
    results = []
    for poison in (False, True):
        kk = k.masked_fill(mask[:, None, :, None], float("nan")) if poison else k
        vv = v.masked_fill(mask[:, None, :, None], float("inf")) if poison else v
        for causal in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, kk, vv, S0, z0)]
            out, state = tf.linear_attention(*leaves[:3], is_causal=causal, key_padding_mask=mask,
                                             initial_state=tuple(leaves[3:]), output_final_state=True, backend=backend)
            outs = [out, *state]
            grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
            results.append([o.detach() for o in outs] + list(grads))
    for clean, dirty in zip(results[:2], results[2:]):
        for c, d in zip(clean, dirty):
            assert torch.isfinite(d).all() and torch.equal(c, d)


# ----------------------------------------------------------------------------------------------
# Checks of the state
# ----------------------------------------------------------------------------------------------
def test_bad_states_are_rejected_naming_the_argument():
    q, k, v = make_qkv(2, 3, 5, 5, 8, 6)
    S0, z0 = earlier_state(2, 3, 8, 6)

    def call(state, q=q):
        return tf.linear_attention(q, k.to(q.dtype), v.to(q.dtype), initial_state=state)

    with pytest.raises(ValueError, match=r"initial_state.S must have shape \(B, H, D, Dv\) = \(2, 3, 8, 6\), "
                                         r"got \(2, 3, 6, 8\)"):
        call((S0.transpose(-2, -1), z0))
    with pytest.raises(ValueError, match=r"initial_state.z must have shape \(B, H, D\) = \(2, 3, 8\), got \(2, 8\)"):
        call((S0, z0[:, 0]))
    with pytest.raises(TypeError, match=r"initial_state.S must have dtype torch.float32 \(the state of "
                                        r"torch.bfloat16 inputs\), got torch.bfloat16"):
        call((S0.bfloat16(), z0), q=q.bfloat16())
    with pytest.raises(TypeError, match=r"initial_state.z must have dtype torch.float64 \(the state of "
                                        r"torch.float64 inputs\), got torch.float32"):
        call((S0.double(), z0), q=q.double())
    with pytest.raises(ValueError, match="initial_state.S is on meta but query is on cpu"):
        call((S0.to("meta"), z0))
    with pytest.raises(ValueError, match="initial_state must hold both S and z, got S without z"):
        call((S0, None))
    with pytest.raises(TypeError, match="initial_state must be a LinearAttentionState .* got Tensor"):
        call(S0)
    with pytest.raises(TypeError, match="initial_state.z must be a torch.Tensor, got list"):
        call((S0, [0.0]))
    # the kernel ops' own checks (direct calls of the extension)
    with pytest.raises(TypeError, match="initial_state.S must have dtype torch.float32"):
        torch.ops.transformer_fast.linear_attention(q, k, v, False, None, 1e-6, S0.half(), z0, False)
    # the step names its state `state`
    _, state = tf.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(TypeError, match=r"state.S must have dtype torch.float32 .* got torch.float64"):
        tf.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], LinearAttentionState(state.S.double(), state.z))
    with pytest.raises(TypeError, match="state must be a LinearAttentionState"):
        tf.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state.S)


# ----------------------------------------------------------------------------------------------
# The op layer with a state: call paths, compile, transforms, autocast
# ----------------------------------------------------------------------------------------------
def _run_named(backend, op, *args):
    """op(*args) with its kernels those of ``backend`` named explicitly (below the op's autograd)."""
    with _backends.named(backend):
        return op(*args)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
def test_call_paths_agree_bit_for_bit():
    """The eager binding, torch.ops (the dispatcher) and the C++ backend named explicitly run the
    same kernels with a state: identical outputs, final states and gradients."""
    q, k, v = make_qkv(2, 2, 9, 9, 8, 8)
    S0, z0 = earlier_state(2, 2, 8, 8)
    mask = random_key_padding(2, 9)
    calls = [
        lambda q, k, v, S, z: (lambda o, s: (o, *s))(*tf.linear_attention(
            q, k, v, is_causal=True, key_padding_mask=mask, initial_state=(S, z), output_final_state=True)),
        lambda q, k, v, S, z: torch.ops.transformer_fast.linear_attention(q, k, v, True, mask, 1e-6, S, z, True),
        lambda q, k, v, S, z: _run_named("cpp", torch.ops.transformer_fast.linear_attention, q, k, v, True, mask, 1e-6,
                                         S, z, True),
    ]
    results = []
    for call in calls:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, S0, z0)]
        outs = call(*leaves)
        results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, [o * 0 + 1 for o in outs])))
    for other in results[1:]:
        for got, expected in zip(other, results[0]):
            assert torch.equal(got, expected)


@pytest.mark.skipif(CPP_REASON is not None, reason=str(CPP_REASON))
def test_torch_compile_fullgraph_with_a_state():
    q, k, v = (torch.randn(2, 2, 33, 16, requires_grad=True) for _ in range(3))
    S0, z0 = (t.requires_grad_() for t in earlier_state(2, 2, 16, 16))
    mask = random_key_padding(2, 33)

    def f(q, k, v, S0, z0):
        out, state = tf.linear_attention(q, k, v, is_causal=True, key_padding_mask=mask,
                                         initial_state=LinearAttentionState(S0, z0), output_final_state=True)
        return out.sum(-1), state.S, state.z

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, expected = compiled(q, k, v, S0, z0), f(q, k, v, S0, z0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    loss = lambda outs: sum(o.square().sum() for o in outs)  # noqa: E731
    torch.testing.assert_close(torch.autograd.grad(loss(got), (q, k, v, S0, z0)),
                               torch.autograd.grad(loss(expected), (q, k, v, S0, z0)))


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_ad_and_second_derivatives_with_a_state(is_causal):
    """jvp (the composite form) and a second derivative (create_graph=True: the composite backward
    op) through the initial and the final state, in float32 against the float64 oracle."""
    q, k, v = make_qkv(2, 2, 9, 9, 6, 5)
    S0, z0 = earlier_state(2, 2, 6, 5)
    mask = random_key_padding(2, 9)
    inputs = (q, k, v, S0, z0)
    ours_fn, ref_fn = ours("auto", is_causal, mask), oracle(is_causal, mask)

    def flat(fn):
        return lambda *a: (lambda o, s: (o, *s))(*fn(*a))

    tangents = tuple(torch.randn_like(t) for t in inputs)
    _, t_ours = jvp(flat(ours_fn), inputs, tangents)
    _, t64 = jvp(flat(ref_fn), tuple(t.double() for t in inputs), tuple(t.double() for t in tangents))
    _, t32 = jvp(flat(ref_fn), inputs, tangents)
    for name, a, b, c in zip(("out", "S", "z"), t_ours, t64, t32):
        assert a.abs().max() > 0
        assert_close_to_reference(a, b, c, what=f"tangent of {name}")

    def second(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        outs = flat(fn)(*leaves)
        firsts = torch.autograd.grad(sum(o.square().sum() for o in outs), leaves, create_graph=True)
        total = sum((f * torch.linspace(0.5, 1.5, f.numel(), dtype=f.dtype).view(f.shape)).sum() for f in firsts)
        return torch.autograd.grad(total, leaves)

    got, exact, lowp = second(ours_fn, inputs), second(ref_fn, [t.double() for t in inputs]), second(ref_fn, inputs)
    for i, (a, b, c) in enumerate(zip(got, exact, lowp)):
        assert_close_to_reference(a, b, c, what=f"second derivative {i}")


def test_autocast_keeps_the_state_float32():
    q, k, v = make_qkv(1, 2, 7, 7, 8, 8)
    S0, z0 = earlier_state(1, 2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = tf.linear_attention(q, k, v, is_causal=True, initial_state=(S0, z0), output_final_state=True)
        step, step_state = tf.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], LinearAttentionState(S0, z0))
    assert out.dtype == step.dtype == torch.bfloat16
    assert state.S.dtype == state.z.dtype == step_state.S.dtype == torch.float32
    expected, expected_state = tf.linear_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True,
                                                   initial_state=(S0, z0), output_final_state=True)
    assert torch.equal(out, expected) and torch.equal(state.S, expected_state.S)
    # The recurrent step against the float64 reference, with the bf16 prefill as the reference's
    # own bf16 error.
    exact, _ = reference.linear_attention(*(t.bfloat16().double() for t in (q, k, v)), is_causal=True,
                                          initial_state=(S0.double(), z0.double()), output_final_state=True)
    assert_close_to_reference(step, exact[:, :, 0], expected[:, :, 0], what="step under autocast")


def test_the_forward_op_casts_under_autocast_but_not_the_state():
    """Called through the dispatcher (as compiled graphs call it), the kernel op's autocast kernel
    casts q, k, v and leaves the float32 state alone."""
    q, k, v = make_qkv(1, 2, 7, 7, 8, 8)
    S0, z0 = earlier_state(1, 2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, S, z = torch.ops.transformer_fast.linear_attention_forward(q, k, v, None, True, 1e-6, S0, z0, True)
    assert out.dtype == torch.bfloat16 and S.dtype == z.dtype == torch.float32
    expected = torch.ops.transformer_fast.linear_attention_forward(*(t.bfloat16() for t in (q, k, v)), None, True,
                                                                   1e-6, S0, z0, True)
    for got, want in zip((out, S, z), expected):
        assert torch.equal(got, want)
