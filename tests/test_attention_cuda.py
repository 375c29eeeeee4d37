"""The C++ backend's CUDA attention kernels (GPUs without Triton; csrc/cuda/attention_cuda.cuh), on a
GPU, against the float64 reference and the C++ CPU kernel. Their logic is also tested on the CPU,
emulated: test_attention_cuda_emulated.py."""
import pytest
import torch

import transformer_fast as tf
from transformer_fast import _backends

from attention_cases import (GPU_HEAD_DIMS, check_attention, check_gpu_grid, kernel_attention_backward,
                             kernel_attention_forward, make_qkv, random_key_padding)
from helpers import need_backend


def _need_cpp_cuda():
    """On a GPU with a CUDA torch the extension must have its CUDA kernels: a failed build fails."""
    reason = _backends.unavailable_reason("cpp", torch.device("cuda"), torch.float16, "attention")
    if reason is not None:
        pytest.fail(f"the C++ backend has no CUDA attention here: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", GPU_HEAD_DIMS)
def test_gpu_cpp_cuda_grid(D, dtype, is_causal):
    _need_cpp_cuda()
    check_gpu_grid("cpp", D, dtype, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_cpp_cuda_dropout_drops_what_the_cpu_kernel_drops(is_causal):
    """One hash (csrc/ops/attention_problem.h) on both devices: the same seed keeps the same probabilities,
    so the CUDA output and gradients match the CPU kernel's (themselves checked against the
    reference with the recovered mask in test_attention.py)."""
    need_backend("cpp")
    _need_cpp_cuda()
    B, H, Hk, Nq, Nk, D, p, seed = 2, 4, 2, 77, 130, 64, 0.25, 99
    q, k, v = make_qkv(B, H, Nq, Nk, D, Hk=Hk)
    pad = random_key_padding(B, Nk)
    scale = D ** -0.5
    fwd, bwd = kernel_attention_forward, kernel_attention_backward
    eye = torch.eye(Nk).expand(B, Hk, Nk, Nk)
    kept_cpu = fwd(q, k, eye, None, pad, is_causal, scale, p, seed, "cpp")[0] != 0
    kept_gpu = fwd(q.cuda(), k.cuda(), eye.cuda(), None, pad.cuda(), is_causal, scale, p, seed, "cpp")[0] != 0
    assert torch.equal(kept_gpu.cpu(), kept_cpu)
    out, lse = fwd(q, k, v, None, pad, is_causal, scale, p, seed, "cpp")
    out_gpu, lse_gpu = fwd(q.cuda(), k.cuda(), v.cuda(), None, pad.cuda(), is_causal, scale, p, seed, "cpp")
    torch.testing.assert_close(out_gpu.cpu(), out, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    grads = bwd(dout, q, k, v, out, lse, None, pad, is_causal, scale, p, seed, "cpp")
    grads_gpu = bwd(*(t.cuda() for t in (dout, q, k, v, out, lse)), None, pad.cuda(), is_causal, scale, p, seed,
                    "cpp")
    for a, b in zip(grads_gpu, grads):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_cpp_cuda_deterministic_and_long():
    _need_cpp_cuda()
    q, k, v = make_qkv(2, 4, 1030, 2100, 128, Hk=2, dtype=torch.bfloat16, layout="bnhd", device="cuda")
    pad = random_key_padding(2, 2100, device="cuda")
    dout = torch.randn(2, 4, 1030, 128, dtype=torch.bfloat16, device="cuda")

    def run():
        args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = tf.scaled_dot_product_attention(*args, is_causal=True, key_padding_mask=pad, enable_gqa=True,
                                              backend="cpp")
        out.backward(dout)
        return [out] + [a.grad for a in args]

    first = run()
    for a, b in zip(first, run()):
        assert torch.equal(a, b)
    check_attention("cpp", q, k, v, is_causal=True, key_padding_mask=pad)
