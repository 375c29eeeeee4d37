"""Build and install transformer_fast.

The C++ extension ``transformer_fast._C`` is compiled against the torch that is already
installed, so install with ``pip install --no-build-isolation .`` after installing torch.
Set ``TRANSFORMER_FAST_NO_BUILD=1`` to skip the build: the package then JIT-builds the same
sources on import (``transformer_fast/_build.py``, ``cpp_extension``).
"""
import os
import runpy
import shutil
import sys
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
build_config = runpy.run_path(os.path.join(ROOT, "transformer_fast", "_build_config.py"))

PACKAGES = ["transformer_fast", "transformer_fast.distributed", "transformer_fast.integrations", "transformer_fast.nn",
            "transformer_fast.kernels", "transformer_fast.csrc"]
# kernels/ and csrc/ live at the top level (design card) but install inside the package:
# nothing may install a top-level module called `kernels` (a PyPI package of that name exists).
PACKAGE_DIR = {"transformer_fast": "transformer_fast", "transformer_fast.kernels": "kernels", "transformer_fast.csrc": "csrc"}


def extension_modules():
    """The C++ extension, or nothing when the build is skipped or torch is missing."""
    if os.environ.get("TRANSFORMER_FAST_NO_BUILD") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("transformer_fast: torch is not importable at build time; the C++ extension "
              "will be JIT-built on first use", file=sys.stderr)
        return [], {}
    cuda = build_config["with_cuda"]()  # torch with CUDA and nvcc: add the CUDA kernels
    sources = [os.path.relpath(p, ROOT) for p in build_config["source_paths"](os.path.join(ROOT, "csrc"), cuda)]
    flags = {"cxx": build_config["extra_cflags"](cuda)}
    if cuda:
        flags["nvcc"] = build_config["extra_cuda_cflags"]()
    # the headers too: setuptools rebuilds only where a source or one of these is newer than the binary
    headers = [os.path.join("csrc", name) for name in build_config["source_files"](os.path.join(ROOT, "csrc"))
               if name.endswith((".h", ".cuh"))]
    ext = (cpp_extension.CUDAExtension if cuda else cpp_extension.CppExtension)(
        "transformer_fast._C",
        sources,
        depends=headers,
        include_dirs=build_config["include_paths"](os.path.join(ROOT, "csrc")),
        extra_compile_args=flags,
        extra_link_args=build_config["extra_ldflags"](),
    )
    return [ext], {"build_ext": _optional_build_ext(cpp_extension.BuildExtension)}


def _optional_build_ext(base):
    class OptionalBuildExtension(base):
        """A failed compile must not fail the install: the JIT build or the reference take over.

        The objects and the built module live in the source tree's build/ folder, whatever the
        command: `pip install -e` builds in temporary folders otherwise, so a second install (the
        README's second command, after its first) compiled every source again. Here ninja recompiles
        only what changed, and an up-to-date module is not linked again."""

        def finalize_options(self):
            super().finalize_options()
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", f"temp.{tag}")
            self.build_lib = os.path.join(ROOT, "build", f"lib.{tag}")

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure
                print(f"transformer_fast: building the C++ extension failed ({exc}); "
                      "it will be JIT-built on first use", file=sys.stderr)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                print(f"transformer_fast: building {ext.name} failed ({exc}); "
                      "it will be JIT-built on first use", file=sys.stderr)

    return OptionalBuildExtension


ext_modules, cmdclass = extension_modules()
if ext_modules and shutil.which("ninja") is None:
    print("transformer_fast: ninja not found; the build falls back to a slower serial compile", file=sys.stderr)

setup(
    name="transformer_fast",
    version="0.1.0",
    description="Fused softmax attention, LayerNorm and linear attention kernels for PyTorch (Triton + C++)",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"transformer_fast.csrc": ["*.cpp", "*/*.cpp", "*/*.h", "*/*.cu", "*/*.cuh"]},
    # No upper bound: the extension is compiled against whichever torch is installed, and a cap
    # below it would make pip replace the user's torch (a multi-GB CUDA build). Install torch
    # first so that pip never picks one itself.
    install_requires=["torch>=2.11", "numpy"],  # transformer_fast/_build.py, MIN_TORCH
    extras_require={
        "triton": ["triton>=3.2"],
        "test": ["pytest>=8", "hypothesis", "numpy>=1.26", "triton>=3.2", "ninja", "transformers>=5", "matplotlib", "tqdm"],
        "bench": ["matplotlib", "tqdm", "ninja"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
