"""Random ``varlen_attn`` calls against the float64 reference (one dense attention per sequence)
with the package's comparison policy (tests/helpers.py): packs of 1-5 sequences with empty,
one-token and odd lengths, self- and cross-attention lengths (more queries than keys included),
grouped-query heads, odd head dims and unequal value head dims, strided and fused-QKV layouts,
full/causal/sliding/two-sided windows, soft-capping, ALiBi ((H,) and (B, H)), sinks and scales;
training packs check outputs and gradients (the sinks' too), inference-only packs check outputs
and log-sum-exps over ``seqused_k`` slots, paged caches with pages in any order, and decoding with
forced or automatic key splits. Seeded: a failure names its seed, and `draw(seed)` rebuilds the
call. Dropout is not drawn here (its packed form is checked in test_varlen.py and
test_attention_triton_extras.py). Slow: the C++ backend's 2,000 draws take about 30 s, the Triton
backend's 120 (shorter sequences and head dims) under the interpreter about 45 s."""
import random

import pytest
import torch

import transformer_fast as tf
from transformer_fast import reference

from helpers import TRITON_TESTS, assert_close_to_reference, kernel_device
from varlen_cases import check_varlen, offsets

pytestmark = pytest.mark.slow


def draw(seed, dtypes, small=False):
    rnd = random.Random(seed)
    B = rnd.choice([1, 2, 3, 5])
    mode = rnd.choice(["train", "train", "seqused", "paged", "decode"])
    if mode == "decode":
        q_lens = [1] * B
    else:
        q_lens = [rnd.choice([0, 1, 1, 2, 7, 17, 40] + ([] if small else [64, 129])) for _ in range(B)]
    self_attention = mode == "train" and rnd.random() < 0.5
    k_lens = list(q_lens) if self_attention else [
        rnd.choice([0, 1, 5, 17, 40] + ([] if small else [64, 129, 200, 700 if mode == "decode" else 129]))
        for _ in range(B)]
    Hk = rnd.choice([1, 2])
    D = rnd.choice([8, 13, 16, 24, 40, 64] + ([] if small else [80, 128]))
    same = self_attention and rnd.random() < 0.4  # q, k, v sliced out of one fused (T, 3, H, D) projection
    H = Hk if same else Hk * rnd.choice([1, 1, 3])
    Dv = D if same else rnd.choice([D, D, 16, 33])
    layout = "qkv" if same else rnd.choice(["packed", "packed", "row_gaps", "head_major"])
    window = rnd.choice([(-1, -1), (-1, -1), (-1, 0), (-1, 0), (rnd.choice([0, 3, 16]), 0),
                         (rnd.choice([0, 5]), rnd.choice([0, 4]))])
    return dict(dtype=rnd.choice(dtypes), mode=mode, q_lens=q_lens, k_lens=k_lens, H=H, Hk=Hk, D=D, Dv=Dv,
                layout=layout, window_size=window, scale=rnd.choice([None, None, 0.3]),
                softcap=rnd.choice([None, None, 5.0]), alibi=rnd.choice([None, None, "H", "BH"]),
                sinks=rnd.random() < 0.25, page_size=rnd.choice([1, 5, 16, 64]),
                slack=rnd.choice([0, 3, 30]), num_splits=rnd.choice([None, None, 1, 2, 3]))


def tokens(T, H, D, dtype, layout, device):
    """(T, H, D) in the given memory layout: contiguous, rows with gaps, or heads outermost."""
    if layout == "row_gaps":
        return torch.randn(T, H, D + 3, dtype=dtype, device=device)[..., :D]
    if layout == "head_major":
        return torch.randn(H, T, D, dtype=dtype, device=device).transpose(0, 1)
    return torch.randn(T, H, D, dtype=dtype, device=device)


def build(c, device):
    """The call's q, k, v, offsets and inference-only arguments (seqused_k, block_table)."""
    dtype, H, Hk, D, Dv = c["dtype"], c["H"], c["Hk"], c["D"], c["Dv"]
    Tq = sum(c["q_lens"])
    q = tokens(Tq, H, D, dtype, c["layout"], device)
    extra = {}
    if c["layout"] == "qkv":
        q, k, v = torch.randn(Tq, 3, H, D, dtype=dtype, device=device).unbind(1)
        cu_k = offsets(c["k_lens"])
    elif c["mode"] == "paged":
        page = c["page_size"]
        per_seq = max(1, max(-(-n // page) for n in c["k_lens"]))
        pool = per_seq * len(c["k_lens"]) + 2
        table = torch.randperm(pool)[:per_seq * len(c["k_lens"])].view(len(c["k_lens"]), per_seq)
        k = torch.randn(pool, page, Hk, D, dtype=dtype, device=device)
        v = torch.randn(pool, page, Hk, Dv, dtype=dtype, device=device)
        cu_k = None
        extra = dict(block_table=table.to(torch.int32).to(device),
                     seqused_k=torch.tensor(c["k_lens"], dtype=torch.int32, device=device))
    else:
        slots = [n + c["slack"] for n in c["k_lens"]] if c["mode"] == "seqused" else c["k_lens"]
        k = tokens(sum(slots), Hk, D, dtype, c["layout"], device)
        v = tokens(sum(slots), Hk, Dv, dtype, c["layout"], device)
        cu_k = offsets(slots)
        if c["mode"] == "seqused":
            extra = dict(seqused_k=torch.tensor(c["k_lens"], dtype=torch.int32, device=device))
    if c["mode"] in ("paged", "decode", "seqused"):
        extra["num_splits"] = c["num_splits"]
    return q, k, v, offsets(c["q_lens"]), cu_k, extra


def check_lse(backend, q, k, v, cu_q, cu_k, kwargs, sinks):
    """The log-sum-exp (H, Tq) against the reference's; +inf exactly where a row has no key and no sink."""
    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    max_k = int(kwargs["seqused_k"].max()) if "seqused_k" in kwargs else int((cu_k[1:] - cu_k[:-1]).max())
    more = {} if sinks is None else {"sinks": sinks}
    _, lse = tf.varlen_attn(q, k, v, cu_q, cu_k, max(q_lens), max_k, return_aux=tf.AuxRequest(lse=True),
                            enable_gqa=k.shape[-2] != q.shape[1], backend=backend, **kwargs, **more)
    ref = {name: kwargs[name] for name in ("scale", "window_size", "softcap", "alibi_slopes", "seqused_k",
                                          "block_table") if name in kwargs}
    refs = [reference.varlen_attention(*(t.to(dtype) for t in (q, k, v)), cu_q, cu_k, return_lse=True, **ref,
                                       **({} if sinks is None else {"sinks": sinks.to(dtype)}))[1]
            for dtype in (torch.float64, q.dtype)]
    assert lse.dtype == torch.float32 and lse.shape == refs[0].shape
    empty = torch.isinf(refs[0])
    assert torch.equal(torch.isposinf(lse), empty), "lse: +inf must mark exactly the rows with no key"
    assert_close_to_reference(lse[~empty], refs[0][~empty], refs[1][~empty].float(), what="lse")


def check_draw(seed, backend, dtypes, device="cpu", small=False):
    c = draw(seed, dtypes, small)
    torch.manual_seed(seed)
    q, k, v, cu_q, cu_k, kwargs = build(c, device)
    B = len(c["q_lens"])
    kwargs.update(window_size=c["window_size"], scale=c["scale"], softcap=c["softcap"])
    if c["alibi"] is not None:
        kwargs["alibi_slopes"] = torch.rand((c["H"],) if c["alibi"] == "H" else (B, c["H"]), device=device)
    sinks = torch.randn(c["H"], device=device).to(c["dtype"]) if c["sinks"] else None
    try:
        if c["mode"] == "train":
            check_varlen(backend, q, k, v, cu_q, cu_k, sinks=sinks, **kwargs)
        else:
            with torch.no_grad():
                check_varlen(backend, q, k, v, cu_q, cu_k, sinks=sinks, grads=False, **kwargs)
                if sum(c["q_lens"]):
                    check_lse(backend, q, k, v, cu_q, cu_k, kwargs, sinks)
    except AssertionError as e:
        raise AssertionError(f"draw {seed} ({c}): {e}") from e


@pytest.mark.parametrize("block", range(20))
def test_cpp_varlen_random_calls(block):
    for seed in range(block * 100, (block + 1) * 100):
        check_draw(seed, "cpp", (torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("block", range(3))
@TRITON_TESTS[0]
@TRITON_TESTS[1]
def test_triton_varlen_random_calls(block):
    device = kernel_device()
    # bf16 is refused under the interpreter, whose bf16 tl.dot is wrong (docs/design.md)
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if device == "cuda" else ())
    for seed in range(block * 40, (block + 1) * 40):
        check_draw(seed, "triton", dtypes, device, small=device == "cpu")
