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
    """Optimisation flags. AVX2+FMA is the x86-64 baseline we vectorize for; set
    TRANSFORMER_FAST_NATIVE=1 to build for exactly this machine's CPU instead."""
    flags = ["-O3", "-fno-math-errno", "-std=c++17"]
    if os.environ.get("TRANSFORMER_FAST_NATIVE") == "1":
        flags.append("-march=native")
    elif platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    flags.append("-fopenmp")
    return flags


def extra_ldflags():
    return ["-fopenmp"]
