"""How the C++ extension is built: one definition shared by ``setup.py`` and the JIT loader.

This file imports nothing from the package, so ``setup.py`` can execute it before
``transformer_fast`` is installed.
"""
import os
import platform

# The kernels (softmax attention: forward and backward apart), their dispatcher layers, the
# schemas and the bindings, one translation unit each, so that a parallel build compiles them side by side.
SOURCES = ("schemas.cpp", "attention_forward.cpp", "attention_backward.cpp", "attention_args.cpp", "attention_op.cpp",
           "layer_norm.cpp",
           "layer_norm_op.cpp", "linear_attention.cpp", "linear_attention_op.cpp", "launch_signature.cpp",
           "triton_launch.cpp", "native_calls.cpp", "bindings.cpp")
# CUDA kernels of the C++ backend (for GPUs without Triton), built where torch has CUDA.
CUDA_SOURCES = ("attention_cuda.cu",)
CUDA_DEFINE = "-DTRANSFORMER_FAST_WITH_CUDA"


def with_cuda():
    """Whether the build includes the CUDA kernels: torch was built with CUDA and nvcc is found
    (torch's CUDA_HOME). TRANSFORMER_FAST_NO_CUDA=1 leaves them out."""
    if os.environ.get("TRANSFORMER_FAST_NO_CUDA") == "1":
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def source_paths(csrc_dir, cuda=False):
    return [os.path.join(csrc_dir, name) for name in SOURCES + (CUDA_SOURCES if cuda else ())]


def extra_cuda_cflags():
    """nvcc flags (torch adds its own, and the architectures of TORCH_CUDA_ARCH_LIST or the GPUs present).
    No -std: cpp_extension passes the C++ standard the installed torch's headers need, as for the
    C++ sources (extra_cflags)."""
    return ["-O3", CUDA_DEFINE]


def extra_cflags(cuda=False):
    """Optimisation flags. The extension is always compiled on the machine that runs it (a source
    install or the JIT build), so it targets that CPU (-march=native: AVX-512 where present, which
    at::vec then uses). TRANSFORMER_FAST_PORTABLE=1 builds for the x86-64 AVX2+FMA baseline instead,
    for a build that must run on other machines.

    -g0 drops the debug information that Python's own CFLAGS ask for (-g): nearly all of it
    describes torch's headers, and it doubled the build (370 s against 189 s on 2 cores) and made
    the library 50 MB instead of 2. It does not change the generated code.
    TRANSFORMER_FAST_DEBUG_INFO=1 keeps it, for a debugger.

    No -std: torch's cpp_extension adds the standard its headers need when none is given (C++20
    from torch 2.13 on; torch 2.14's headers refuse C++17, with which the build failed)."""
    debug = ["-g"] if os.environ.get("TRANSFORMER_FAST_DEBUG_INFO") == "1" else ["-g0"]
    flags = ["-O3", *debug, "-fno-math-errno", "-fopenmp"] + ([CUDA_DEFINE] if cuda else [])
    if platform.machine() not in ("x86_64", "AMD64"):
        return flags
    if os.environ.get("TRANSFORMER_FAST_PORTABLE") == "1":
        return flags + ["-mavx2", "-mfma", "-mf16c"]
    return flags + ["-march=native"]


def extra_ldflags():
    return ["-fopenmp"]
