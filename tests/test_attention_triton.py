"""The Triton softmax-attention kernels (kernels/attention.py) against the float64 reference.

`triton`-marked tests run under the interpreter on CPU (small shapes; the interpreter uses 32x16
forward and 16x32 backward tiles, so these lengths span several unequal query and key tiles); the
`gpu` tests run the full grid in
fp16/bf16 (and a slice in fp32) on a real GPU.
"""
import itertools

import pytest
import torch

from transformer_fast._attention_call import AttentionBackwardCall, AttentionForwardCall
import transformer_fast as tf
from transformer_fast import reference

from attention_cases import (GPU_HEAD_DIMS, check_attention, check_gpu_grid, differentiable_attention,
                             kernel_attention_forward, make_qkv, random_attn_mask, random_key_padding,
                             record_launches_and_ops)
from helpers import TRITON_TESTS, kernel_device as _device

pytestmark = TRITON_TESTS
ops = torch.ops.transformer_fast


# ------------------------------------------------------------------------------------------
# Interpreter (CPU) tests
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Nq,Nk,D", [(17, 40, 16), (40, 17, 40), (1, 17, 16), (17, 1, 40)])
def test_lengths_and_causal(Nq, Nk, D, is_causal, dtype):
    q, k, v = make_qkv(2, 2, Nq, Nk, D, dtype=dtype, device=_device())
    check_attention("triton", q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_key_padding_with_fully_padded_sequence(is_causal):
    q, k, v = make_qkv(3, 2, 40, 40, 16, device=_device())
    pad = random_key_padding(3, 40, fully_padded_row=1, device=_device())
    check_attention("triton", q, k, v, key_padding_mask=pad, is_causal=is_causal)


def test_key_padding_arbitrary_positions():
    """Padding that is not a suffix (left padding, holes, whole 16-key tiles padded)."""
    q, k, v = make_qkv(3, 2, 17, 40, 16, dtype=torch.float16, device=_device())
    pad = torch.rand(3, 40, device=_device()) < 0.4
    pad[0, :20] = True  # leading padding, a whole tile included
    pad[1, 16:32] = True  # a hole covering a whole key tile
    pad[2, 1::2] = True
    check_attention("triton", q, k, v, key_padding_mask=pad)
    check_attention("triton", q, k, v, key_padding_mask=pad, is_causal=True)


def _padding_cases(Nk):
    """(B, Nk) padding rows that put each sequence's unpadded keys at the edges of the kernels'
    tiles and padding-scan blocks (16 keys under the interpreter): only the last key, only the
    first, one key in the middle of a later block, keys past the first query block's causal
    window only, and a last key block (of the backward's 32) with no unpadded key."""
    pad = torch.ones(5, Nk, dtype=torch.bool)
    pad[0, Nk - 1] = False
    pad[1, 0] = False
    pad[2, 37] = False
    pad[3, 33:] = False
    pad[4, 3:30] = False
    return pad


@pytest.mark.parametrize("is_causal", [False, True])
def test_unpadded_key_range_found_by_the_kernels(is_causal):
    """Each program finds its sequence's unpadded keys by scanning the padding row (up to its
    causal window) and skips the key tiles outside them; rows that see no unpadded key give 0."""
    pad = _padding_cases(41).to(_device())
    q, k, v = make_qkv(5, 2, 40, 41, 16, dtype=torch.float16, device=_device())
    check_attention("triton", q, k, v, key_padding_mask=pad, is_causal=is_causal)


@pytest.mark.parametrize("compute_dmask", [False, True])
def test_launchers_run_no_torch_op_beyond_allocations(monkeypatch, compute_dmask):
    """With a key padding mask and a bool mask, the launchers allocate their outputs (the backward
    also delta), view the bool masks as bytes, and run no other torch op: no per-call bookkeeping
    on the device, nothing that waits for it."""
    q, k, v = make_qkv(2, 2, 17, 40, 16)
    pad = random_key_padding(2, 40)
    mask = random_attn_mask((2, 2, 17, 40), "bool")
    lse = torch.zeros(2, 2, 17)
    allowed = {"empty", "full", "zeros", "view", "detach"}  # a dtype view shows as view + detach

    launches, ops = record_launches_and_ops(
        monkeypatch, lambda ka: ka.attention_forward(AttentionForwardCall(q, k, v, mask, pad, True, 0.25, 0.1, 5)))
    assert launches == ["attention_fwd_kernel"]
    assert set(ops) <= allowed and ops.count("view") == 2, ops

    launches, ops = record_launches_and_ops(
        monkeypatch, lambda ka: ka.attention_backward(AttentionBackwardCall(q, q, k, v, q, lse, mask, pad, True, 0.25,
                                                                            0.1, 5, compute_dmask)))
    assert launches == ["attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]
    assert set(ops) <= allowed and ops.count("view") == 2, ops


@pytest.mark.parametrize("poison", [True, False])
def test_new_outputs_row_strides_are_the_tensors(monkeypatch, poison):
    """The launchers work out their outputs' (batch, head, row) strides without the tensors (the
    plans, strides_in_rows_of): they must be what torch gives them, in both layouts and at sizes 0
    and 1, as allocated with and without TRANSFORMER_FAST_POISON (which the other tests set)."""
    from transformer_fast.kernels import _new_tensors

    monkeypatch.setattr(_new_tensors, "_POISON", poison)
    fresh = _new_tensors.new_output((2, 3), torch.float16, "cpu")
    assert fresh.shape == (2, 3) and fresh.dtype == torch.float16 and (fresh.isnan().all() or not poison)
    for B, H, N, W in itertools.product([0, 1, 2], [0, 1, 3], [0, 1, 5], [0, 1, 6]):
        for like in (torch.empty(B, H, N, 4), torch.empty(B, N, H, 4).transpose(1, 2)):
            out, (_, strides) = _new_tensors.new_output_in_rows_of(like, W), _new_tensors.strides_in_rows_of(like)
            assert out.shape == (B, H, N, W)
            assert strides == _new_tensors.row_strides(out), (like.shape, like.stride(), W, out.stride())
            assert out.is_contiguous() or like.stride(1) < like.stride(2)


def test_sm_count_is_read_once_per_device(monkeypatch):
    """Launchers size their grids by the SM count on every call; the device is asked once."""
    import types

    from transformer_fast.kernels import _grid_math

    asked = []

    def properties(index):
        asked.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(_grid_math, "_SM_COUNTS", {})
    counts = [_grid_math.sm_count(torch.device("cuda", i)) for i in (0, 1, 0, 1, 0)]
    assert counts == [100, 101, 100, 101, 100] and asked == [0, 1]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(17, 40), (2, 1, 17, 40), (2, 1, 1, 40), (1, 17, 1)])
def test_attn_mask_broadcast(kind, shape):
    q, k, v = make_qkv(2, 2, 17, 40, 16, device=_device())
    mask = random_attn_mask(shape, kind, device=_device())
    check_attention("triton", q, k, v, attn_mask=mask)


def test_float_mask_gradient():
    """A learned per-head bias (float attn_mask requiring grad) gets its gradient, with GQA,
    causal masking and a fully padded sequence."""
    from helpers import compare_with_reference

    q, k, v = make_qkv(2, 4, 17, 40, 16, Hk=2, dtype=torch.float16, device=_device())
    mask = random_attn_mask((4, 17, 40), "float", dtype=torch.float16, device=_device())
    pad = random_key_padding(2, 40, fully_padded_row=1, device=_device())

    def kernel(q, k, v, mask):
        return tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True,
                                               key_padding_mask=pad, backend="triton")

    def ref(q, k, v, mask):
        return reference.scaled_dot_product_attention(q, k, v, mask, True, key_padding_mask=pad)

    compare_with_reference(kernel, ref, (q, k, v, mask), grad_inputs=(0, 1, 2, 3), what="attention[triton] mask")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_fully_masked_rows_with_causal_and_padding(kind):
    q, k, v = make_qkv(2, 2, 40, 17, 40, dtype=torch.float16, device=_device())
    mask = random_attn_mask((2, 2, 40, 17), kind, dtype=torch.float16, device=_device())
    mask[0, 1, 5] = False if kind == "bool" else float("-inf")  # a row with no allowed key
    mask[1, :, 30:] = False if kind == "bool" else float("-inf")
    pad = random_key_padding(2, 17, device=_device())
    check_attention("triton", q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=True)


@pytest.mark.parametrize("layout", ["bnhd", "qkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_contiguous_layouts(layout, dtype):
    q, k, v = make_qkv(2, 2, 40, 40, 40, dtype=dtype, layout=layout, device=_device())
    assert not q.is_contiguous()
    check_attention("triton", q, k, v, is_causal=True)


@pytest.mark.parametrize("Hk", [1, 2])
def test_gqa_and_value_head_dim(Hk):
    q, k, v = make_qkv(2, 4, 17, 40, 40, Dv=24, Hk=Hk, layout="bnhd", device=_device())
    pad = random_key_padding(2, 40, device=_device())
    check_attention("triton", q, k, v, key_padding_mask=pad, is_causal=True)


def test_head_dims_one_and_odd():
    q, k, v = make_qkv(2, 2, 17, 40, 1, Dv=7, device=_device())
    check_attention("triton", q, k, v, scale=0.7)


def test_lse_matches_reference():
    q, k, v = make_qkv(2, 2, 40, 17, 16, device=_device())
    pad = random_key_padding(2, 17, fully_padded_row=0, device=_device())
    mask = random_attn_mask((40, 17), "bool", device=_device())
    mask[3] = False
    args = (mask.expand(2, 2, 40, 17), pad, True, 0.25, 0.0, 0)
    out, lse = kernel_attention_forward(q, k, v, *args, "triton")
    ref_out, ref_lse = kernel_attention_forward(q.double(), k.double(), v.double(), *args, "reference")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert lse.dtype == torch.float32 and (lse[0] == float("inf")).all() and (lse[:, :, 3] == float("inf")).all()
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-5
    assert (out.double() - ref_out).abs().max() < 1e-5


def _nan_surrounded(t, pad_rows=None):
    """`t` (B, H, N, D) copied into a NaN buffer with 3 extra rows and 5 extra columns, returned as
    the view onto its real part; rows marked in pad_rows (B, N) are NaN too."""
    B, H, N, D = t.shape
    buf = torch.full((B, H, N + 3, D + 5), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, :, :N, :D]
    view.copy_(t)
    if pad_rows is not None:
        view.masked_fill_(pad_rows[:, None, :, None], float("nan"))
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nan_in_padded_and_out_of_range_keys_does_not_leak(dtype):
    """NaN in padded key/value rows and next to the tensors' edges (beyond Nk and beyond D in
    memory) changes nothing: outputs and gradients are bit-identical to those with finite values,
    padded keys get exactly zero gradient."""
    q, k, v = make_qkv(2, 2, 17, 40, 40, Dv=24, dtype=dtype, device=_device())
    pad = random_key_padding(2, 40, device=_device())
    pad[0, 3] = True
    dout = torch.randn(2, 2, 17, 24, dtype=dtype, device=_device())
    results = []
    for poisoned in (False, True):
        kk, vv = (_nan_surrounded(k, pad), _nan_surrounded(v, pad)) if poisoned else (k.clone(), v.clone())
        qq = q.clone()
        for t in (qq, kk, vv):
            t.requires_grad_(True)
        out = tf.scaled_dot_product_attention(qq, kk, vv, key_padding_mask=pad, is_causal=True, backend="triton")
        out.backward(dout)
        results.append((out, qq.grad, kk.grad, vv.grad))
    for clean, poisoned in zip(*results):
        assert not torch.isnan(poisoned).any()
        assert torch.equal(clean, poisoned)
    _, _, dk, dv = results[1]
    assert (dk.masked_select(pad[:, None, :, None]) == 0).all() and (dv.masked_select(pad[:, None, :, None]) == 0).all()
    check_attention("triton", q, k, v, key_padding_mask=pad, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nan_in_a_query_shows_in_its_row_only(dtype):
    """A NaN in an (unmasked) query makes that query's output NaN, as in PyTorch, and no other's."""
    q, k, v = make_qkv(2, 2, 20, 40, 16, dtype=dtype, device=_device())
    q[1, 0, 7, 3] = float("nan")
    out = tf.scaled_dot_product_attention(q, k, v, backend="triton")
    expected = torch.zeros(2, 2, 20, dtype=torch.bool, device=out.device)
    expected[1, 0, 7] = True
    assert torch.equal(torch.isnan(out).any(-1), expected)
    assert torch.isnan(out[1, 0, 7]).all()


def test_reruns_are_bit_identical():
    q, k, v = make_qkv(2, 4, 40, 40, 16, Hk=2, dtype=torch.float16, device=_device())
    mask = random_attn_mask((2, 1, 40, 40), "float", dtype=torch.float16, device=_device())
    dout = torch.randn(2, 4, 40, 16, dtype=torch.float16, device=_device())
    runs = []
    for _ in range(2):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = tf.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=True, enable_gqa=True,
                                              backend="triton")
        out.backward(dout)
        runs.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _keep_mask(B, H, Hk, Nq, Nk, D, pad, is_causal, scale, p, seed):
    """The kernels' dropout keep mask (B, H, Nq, Nk), read off the output with v = identity
    (out = P * keep / (1 - p), and P > 0 on every allowed pair)."""
    q, k, _ = make_qkv(B, H, Nq, Nk, D, Hk=Hk, device=_device())
    eye = torch.eye(Nk, device=_device())
    outs, alloweds = [], []
    for j in range(0, Nk, 128):  # value head dims stay within the kernels' 256
        v = eye[:, j:j + 128].expand(B, Hk, Nk, -1)
        outs.append(kernel_attention_forward(q, k, v, None, pad, is_causal, scale, p, seed, "triton")[0])
        alloweds.append(kernel_attention_forward(q, k, v, None, pad, is_causal, scale, 0.0, 0, "triton")[0])
    return torch.cat(outs, -1) != 0, torch.cat(alloweds, -1) != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_matches_reference_with_the_same_keep_mask(dtype):
    B, H, Hk, Nq, Nk, D, Dv = 2, 4, 2, 17, 24, 16, 40
    p, seed, scale, causal = 0.3, 1234 + 2**40, 0.3, True
    pad = random_key_padding(B, Nk, device=_device())
    keep, allowed = _keep_mask(B, H, Hk, Nq, Nk, D, pad, causal, scale, p, seed)
    rate = keep[allowed].float().mean().item()
    assert allowed.sum() > 500 and abs(rate - (1 - p)) < 0.06, rate

    def kernel(q, k, v):
        return differentiable_attention(q, k, v, None, pad, causal, scale, p, seed, "triton")

    def ref(q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, None, causal, scale, key_padding_mask=pad,
                                                      dropout_mask=keep, dropout_p=p)

    from helpers import compare_with_reference

    q, k, v = make_qkv(B, H, Nq, Nk, D, Dv=Dv, Hk=Hk, dtype=dtype, device=_device())
    compare_with_reference(kernel, ref, (q, k, v), grad_inputs=(0, 1, 2), what="attention[triton] dropout")


def test_dropout_is_deterministic_per_seed():
    q, k, v = make_qkv(2, 2, 17, 40, 16, dtype=torch.float16, device=_device())
    dout = torch.randn(2, 2, 17, 16, dtype=torch.float16, device=_device())

    def run(seed):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = differentiable_attention(qq, kk, vv, None, None, False, 0.25, 0.5, seed, "triton")
        out.backward(dout)
        return out, qq.grad, kk.grad, vv.grad

    first, again, other = run(7), run(7), run(8)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    torch.manual_seed(3)
    a = tf.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="triton")
    torch.manual_seed(3)
    b = tf.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="triton")
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# The full grid on a GPU
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", GPU_HEAD_DIMS)
def test_gpu_full_grid(D, dtype, is_causal):
    """Every length pair for this head dim, dtype and causality (attention_cases.check_gpu_grid). (Split
    by causality so that pytest-xdist can spread the compile-bound grid over more workers.)"""
    check_gpu_grid("triton", D, dtype, is_causal)


def _tile_of(config):
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def test_tuned_choices_launch_without_the_autotuner(monkeypatch):
    """The autotuner runs once per key (kernels/_launch.TunedLaunch); later calls with that key
    launch its choice directly, with the same result; forgetting the choices asks it again."""
    from transformer_fast.kernels import attention as ka

    ka.forget_tuned_choices()
    asked = []
    autotuner = ka.launch_fwd.autotuned
    real_run = autotuner.run
    monkeypatch.setattr(autotuner, "run", lambda *args, **kwargs: (asked.append(1), real_run(*args, **kwargs))[1])
    q, k, v = make_qkv(1, 2, 17, 17, 16, device=_device())
    first = tf.scaled_dot_product_attention(q, k, v, backend="triton")
    second = tf.scaled_dot_product_attention(q, k, v, backend="triton")
    assert len(asked) == 1 and len(ka.launch_fwd.chosen) == 1
    assert torch.equal(first, second)
    tf.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")  # another key
    assert len(asked) == 2 and len(ka.launch_fwd.chosen) == 2
    ka.forget_tuned_choices()
    tf.scaled_dot_product_attention(q, k, v, backend="triton")
    assert len(asked) == 3 and len(ka.launch_fwd.chosen) == 1
    check_attention("triton", q, k, v)  # a direct launch against float64 (forward and backward)


def test_forced_tile_selects_one_candidate(monkeypatch):
    """TRANSFORMER_FAST_TILE=i leaves the autotuner the i-th candidate of the table (mod its
    length); unset, every candidate for the head dim."""
    import triton

    from transformer_fast.kernels import attention_tiles as tiles_module

    tiles = tiles_module.DKDV_TILES_LOWP[128]
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in tiles_module.all_tiles(tiles_module.DKDV_TILES_LOWP, tiles_module.DKDV_TILES_FP32)]
    prune = tiles_module.pruner(tiles_module.DKDV_TILES_LOWP, tiles_module.DKDV_TILES_FP32)
    args = dict(BLOCK_D=128, BLOCK_DV=64, DOT_PRECISION="tf32")
    monkeypatch.delenv("TRANSFORMER_FAST_TILE", raising=False)
    assert sorted(_tile_of(c) for c in prune(configs, args)) == sorted(tiles)
    for i in range(len(tiles) + 1):
        monkeypatch.setenv("TRANSFORMER_FAST_TILE", str(i))
        assert [_tile_of(c) for c in prune(configs, args)] == [tiles[i % len(tiles)]]
    monkeypatch.delenv("TRANSFORMER_FAST_TILE")
    for head in (64, 128, 256):  # fp32 (ieee dots) takes its own table
        args = dict(BLOCK_D=head, BLOCK_DV=head, DOT_PRECISION="ieee")
        assert [_tile_of(c) for c in prune(configs, args)] == tiles_module.DKDV_TILES_FP32[head]


def test_autotune_keeps_choices_on_disk_where_triton_can(monkeypatch):
    """The autotuned kernels ask Triton to keep their tuned choices on disk (cache_results=True)
    where triton.autotune takes that argument (Triton >= 3.4), and pass nothing where it does not."""
    import triton

    from transformer_fast.kernels import _autotune

    passed = []

    def autotune_with_cache(configs, key, prune_configs_by=None, reset_to_zero=None, cache_results=False):
        passed.append(cache_results)
        return lambda fn: fn

    def autotune_without_cache(configs, key, prune_configs_by=None, reset_to_zero=None):
        passed.append("absent")
        return lambda fn: fn

    def keep_all(configs, named_args, **kwargs):
        return configs

    for fake, expected in ((autotune_with_cache, True), (autotune_without_cache, "absent")):
        monkeypatch.setattr(triton, "autotune", fake)
        _autotune.autotune([triton.Config({"BLOCK_M": 16})], ["Nq"], keep_all)
        assert passed[-1] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("tile", range(4))
def test_gpu_every_tile(tile, monkeypatch):
    """Every candidate tile of every autotuned kernel (the other GPU tests use the first only),
    per head-dim class, on plain inputs and with every feature at once."""
    from transformer_fast.kernels import attention as ka

    monkeypatch.setenv("TRANSFORMER_FAST_TILE", str(tile))
    ka.forget_tuned_choices()  # tuned choices are kept per key: forget those of another tile
    for D in (64, 128, 256):
        q, k, v = make_qkv(2, 4, 300, 300, D, dtype=torch.float16, device="cuda")
        check_attention("triton", q, k, v)
        q, k, v = make_qkv(3, 4, 129, 300, D, Hk=2, dtype=torch.float16, layout="bnhd", device="cuda")
        pad = random_key_padding(3, 300, fully_padded_row=1, device="cuda")
        mask = random_attn_mask((129, 300), "bool", device="cuda")
        check_attention("triton", q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=True)


# Head dims padded inside the kernel with a narrower value head. Without block_dims' widening,
# Triton 3.6 on an H100 gave wrong outputs for the first two (and an illegal memory access with
# MQA + padding + float mask: out-of-range shared memory under compute-sanitizer); the others
# passed with and without it (git show e4a4db1:benchmarks/results/cuda-h100-gpu-tests-2026-11-23.txt).
_PADDED_NARROW_VALUE = [(24, 11), (40, 23), (40, 16), (80, 23), (192, 128), (200, 100)]


def test_value_block_widened_where_the_head_dim_is_padded():
    from transformer_fast.kernels.attention_tiles import block_dims

    assert block_dims(40, 23) == (64, 64) and block_dims(24, 11) == (32, 32)
    assert block_dims(64, 23) == (64, 32) and block_dims(80, 40) == (128, 64)  # seen right on the GPU
    assert block_dims(40, 80) == (64, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D, Dv", _PADDED_NARROW_VALUE)
def test_gpu_padded_head_dim_with_narrower_value(D, Dv, dtype):
    q, k, v = make_qkv(1, 1, 300, 300, D, Dv=Dv, dtype=dtype, device="cuda")
    check_attention("triton", q, k, v)
    q, k, v = make_qkv(3, 4, 300, 64, D, Dv=Dv, Hk=1, dtype=dtype, layout="bnhd", device="cuda")
    pad = random_key_padding(3, 64, fully_padded_row=0, device="cuda")
    mask = random_attn_mask((3, 1, 300, 64), "float", dtype=dtype, device="cuda")
    check_attention("triton", q, k, v, attn_mask=mask, key_padding_mask=pad)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [16, 80, 256])
def test_gpu_fp32_is_not_tf32(D):
    """fp32 inputs use the exact (ieee) dot: tf32 would fail the 2x-reference-error policy."""
    q, k, v = make_qkv(2, 2, 129, 300, D, dtype=torch.float32, device="cuda")
    check_attention("triton", q, k, v, is_causal=True,
                    key_padding_mask=random_key_padding(2, 300, device="cuda"))


@pytest.mark.gpu
def test_gpu_dropout_and_long_sequences():
    B, H, Hk, Nq, Nk, D = 2, 4, 2, 129, 300, 64
    p, seed = 0.2, 99
    keep, allowed = _keep_mask(B, H, Hk, Nq, Nk, D, None, True, 0.125, p, seed)
    assert abs(keep[allowed].float().mean().item() - (1 - p)) < 0.01
    q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk, dtype=torch.bfloat16, device="cuda")
    from helpers import compare_with_reference

    compare_with_reference(
        lambda q, k, v: differentiable_attention(q, k, v, None, None, True, 0.125, p, seed, "triton"),
        lambda q, k, v: reference.scaled_dot_product_attention(q, k, v, None, True, 0.125, dropout_mask=keep,
                                                               dropout_p=p),
        (q, k, v), grad_inputs=(0, 1, 2), what="attention[triton] dropout")
    q, k, v = make_qkv(1, 2, 4100, 4100, 128, dtype=torch.float16, device="cuda")
    check_attention("triton", q, k, v, is_causal=True)
