"""How the C++ extension is built: one definition shared by ``setup.py`` and the JIT loader.

This file imports nothing from the package, so ``setup.py`` can execute it before
``transformer_fast`` is installed.
"""
import os
import platform

# One translation unit per kernel family plus the bindings: the build is ~30 s a file on two cores.
SOURCES = ("attention.cpp", "layer_norm.cpp", "linear_attention.cpp", "bindings.cpp")


def source_paths(csrc_dir):
    return [os.path.join(csrc_dir, name) for name in SOURCES]


def extra_cflags():
    """Optimisation flags. The extension is always compiled on the machine that runs it (a source
    install or the JIT build), so it targets that CPU (-march=native: AVX-512 where present, which
    at::vec then uses). TRANSFORMER_FAST_PORTABLE=1 builds for the x86-64 AVX2+FMA baseline instead,
    for a build that must run on other machines."""
    flags = ["-O3", "-fno-math-errno", "-std=c++17", "-fopenmp"]
    if platform.machine() not in ("x86_64", "AMD64"):
        return flags
    if os.environ.get("TRANSFORMER_FAST_PORTABLE") == "1":
        return flags + ["-mavx2", "-mfma", "-mf16c"]
    return flags + ["-march=native"]


def extra_ldflags():
    return ["-fopenmp"]
