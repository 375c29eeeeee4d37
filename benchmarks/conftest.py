"""pytest-benchmark set-up: ``pytest benchmarks/ --benchmark-only`` from the repository root.

The cases are those of ``python -m benchmarks.run`` (benchmarks/cases.py), at a few lengths:

    pytest benchmarks/ --benchmark-only --bench-seq-lens 512 2048 --benchmark-autosave
    pytest benchmarks/ --benchmark-only --benchmark-compare     # against the last saved run

Not part of the test suite (pyproject's testpaths is tests/). Run it with
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 in the environment on Linux to keep large
outputs off fresh memory maps (the `benchmarks.run` command sets them itself).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_addoption(parser):
    group = parser.getgroup("transformer_fast benchmarks")
    group.addoption("--bench-seq-lens", type=int, nargs="+", default=None,
                    help="sequence lengths (default 256 1024 on CPU, 1024 4096 on CUDA)")
    group.addoption("--bench-device", default=None, help="cpu or cuda (default: cuda if available)")
    group.addoption("--bench-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default float32 on CPU, bfloat16 on CUDA")
    group.addoption("--bench-batch", type=int, default=None)
    group.addoption("--bench-heads", type=int, default=None)
    group.addoption("--bench-head-dim", type=int, default=64)


@pytest.fixture(scope="session")
def bench_settings(request):
    import torch

    opt = request.config.getoption
    device = torch.device(opt("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--bench-device cuda but CUDA is not available")
    dtype_name = opt("--bench-dtype") or ("bfloat16" if device.type == "cuda" else "float32")
    gpu = device.type == "cuda"
    return {"device": device, "dtype": getattr(torch, dtype_name), "batch": opt("--bench-batch") or (4 if gpu else 1),
            "heads": opt("--bench-heads") or (16 if gpu else 8), "head_dim": opt("--bench-head-dim")}


def pytest_generate_tests(metafunc):
    if "seq_len" in metafunc.fixturenames:
        lengths = metafunc.config.getoption("--bench-seq-lens")
        if not lengths:
            gpu = (metafunc.config.getoption("--bench-device") or "").startswith("cuda")
            if metafunc.config.getoption("--bench-device") is None:
                try:
                    import torch

                    gpu = torch.cuda.is_available()
                except ImportError:
                    gpu = False
            lengths = [1024, 4096] if gpu else [256, 1024]
        if "train" in metafunc.function.__name__:
            lengths = sorted({max(8, n // 4) for n in lengths})
        metafunc.parametrize("seq_len", lengths, ids=[f"N{n}" for n in lengths])
