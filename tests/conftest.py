"""Test set-up shared by every test file.

Without a CUDA device the Triton kernels run under the interpreter on CPU tensors; the
interpreter is chosen when the kernels are decorated, so it must be set before they import.
TRANSFORMER_FAST_POISON=1 makes every kernel fill its outputs with NaN before writing them.
With a GPU, TRANSFORMER_FAST_TILE=0 keeps the autotuned Triton kernels to their first candidate
tile (see kernels/_utils.py).
"""
import os
import sys

import pytest

HAS_CUDA_HINT = os.path.exists("/dev/nvidia0") or os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1")
if not HAS_CUDA_HINT:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # one candidate tile per autotuned kernel (test_gpu_every_tile walks them all): far fewer compiles
    os.environ.setdefault("TRANSFORMER_FAST_TILE", "0")
os.environ.setdefault("TRANSFORMER_FAST_POISON", "1")

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers`

import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
