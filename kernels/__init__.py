"""Triton kernels, installed as ``transformer_fast.kernels`` (one module per kernel family).

Each family module defines its ``@triton.jit`` kernels, then launchers with the kernel-level
signatures documented in ``transformer_fast/<family>.py``. ``attention_tiles`` holds the
attention kernels' tile tables and autotune configs; ``compile_cases`` lists, per family, every
(kernel, signature, constexprs, num_warps, num_stages) the launchers may launch on a GPU, which
``python -m transformer_fast.kernels.compile_check`` compiles for sm_80 and sm_90 without a GPU.
"""
from ._utils import interpreting  # noqa: F401

FAMILIES = ("attention", "layer_norm", "linear_attention")
