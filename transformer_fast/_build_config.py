"""How the C++ extension is built: one definition shared by ``setup.py`` and the JIT loader.

This file imports nothing from the package, so ``setup.py`` can execute it before
``transformer_fast`` is installed.
"""
import glob
import os
import platform

# csrc/ by role: the op layer (ops/: schemas, argument checks, autograd, autocast), the CPU kernels
# (cpu/), the native Triton launch runtime (launch/) and the Python bindings (bindings.cpp); the CUDA
# kernels of the C++ backend (cuda/, for GPUs without Triton) where torch has CUDA. Every .cpp (and
# .cu) of a folder is one translation unit, so that a parallel build compiles them side by side.
# Includes name their header from csrc/ ("ops/op_utils.h"), which is on the include path.
CPP_FOLDERS = ("cpu", "ops", "launch")
CUDA_FOLDER = "cuda"
BINDINGS = "bindings.cpp"
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
    """The translation units of csrc_dir: each .cpp of CPP_FOLDERS, the bindings, and with `cuda`
    each .cu of cuda/. Their file names must differ across folders: the JIT build
    (cpp_extension.load) names each object file after its source's name alone."""
    paths = [path for folder in CPP_FOLDERS for path in sorted(glob.glob(os.path.join(csrc_dir, folder, "*.cpp")))]
    paths.append(os.path.join(csrc_dir, BINDINGS))
    paths += cuda_source_paths(csrc_dir) if cuda else []
    names = [os.path.basename(path) for path in paths]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise RuntimeError(f"csrc/: two translation units share a file name ({', '.join(duplicated)}), "
                           "which would make them share an object file in the JIT build")
    return paths


def cuda_source_paths(csrc_dir):
    return sorted(glob.glob(os.path.join(csrc_dir, CUDA_FOLDER, "*.cu")))


def include_paths(csrc_dir):
    """The include path the sources expect: csrc/ itself, as they name their headers from there."""
    return [csrc_dir]


def source_files(csrc_dir):
    """Every source and header under csrc_dir, as paths relative to it ("ops/schemas.cpp")."""
    return sorted(os.path.relpath(os.path.join(folder, name), csrc_dir)
                  for folder, _, names in os.walk(csrc_dir) for name in names
                  if name.endswith((".cpp", ".h", ".cu", ".cuh")))


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
