"""Triton kernels, installed as ``transformer_fast.kernels`` (one module per kernel family).

Each family module defines its ``@triton.jit`` kernels, then launchers with the kernel-level
signatures documented in ``transformer_fast/<family>.py``. ``attention_tiles`` holds the
attention kernels' tile tables and autotune configs; ``compile_cases`` lists, per family, every
(kernel, signature, constexprs, num_warps, num_stages) the launchers may launch on a GPU, which
``python -m transformer_fast.kernels.compile_check`` compiles for sm_80 and sm_90 without a GPU.

This folder is never a top-level package. Python puts the directory it runs from on ``sys.path``
(``python -m pytest``, ``python -m benchmarks.run`` from the repository root), and there
``import kernels`` finds this folder before an installed package of that name (Hugging Face's
``kernels``, which ``transformers`` imports). Imported under that name, this file hands the import
to the next ``kernels`` on ``sys.path`` past the repository root, or fails as if the folder were not
there. Whatever is installed as ``kernels``, and wherever Python runs from, it is what
``import kernels`` gets.
"""
if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.realpath(__file__))
    _path = [p for p in _sys.path if _os.path.realpath(_os.path.join(p or _os.curdir, "kernels")) != _here]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
    _spec.loader.exec_module(_module)
else:
    from ._triton_options import interpreting  # noqa: F401
