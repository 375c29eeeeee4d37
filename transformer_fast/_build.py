"""Loading the C++ extension ``transformer_fast._C``: the one built by ``setup.py``, else a JIT
build of ``csrc/`` with ``torch.utils.cpp_extension.load`` into a cache folder. Loading it
registers the ops with torch's dispatcher (their schemas are in ``csrc/ops/schemas.cpp``)."""
from __future__ import annotations

import functools
import hashlib
import os
import re
import warnings

import torch


def _csrc_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")):
        if os.path.isfile(os.path.join(candidate, "ops", "schemas.cpp")):
            return candidate
    return None


def build_directory(*key_parts, prefix=""):
    """A JIT build folder under TRANSFORMER_FAST_CACHE (default ~/.cache/transformer_fast), named
    by a hash of key_parts and the torch version, created if missing."""
    key = "|".join([*key_parts, torch.__version__])
    cache_root = os.environ.get(
        "TRANSFORMER_FAST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "transformer_fast"))
    build_dir = os.path.join(cache_root, prefix + hashlib.sha256(key.encode()).hexdigest()[:16])
    os.makedirs(build_dir, exist_ok=True)
    return build_dir


def _jit_build():
    """Builds csrc/ into a cache directory keyed on the source folder, the flags and the torch
    version; ninja rebuilds what changed. Where torch has CUDA, the CUDA kernels are built too;
    if that build fails, the CPU kernels alone (warned)."""
    from . import _build_config

    csrc = _csrc_dir()
    if csrc is None:
        raise RuntimeError("the C++ sources (csrc/) are not shipped with this installation")
    if _build_config.with_cuda():
        try:
            return _jit_build_variant(csrc, cuda=True)
        except Exception as exc:  # noqa: BLE001 - nvcc missing or too old, a compile error, ...
            warnings.warn(f"transformer_fast: building the C++ extension's CUDA kernels failed, building its CPU "
                          f"kernels alone ({type(exc).__name__}: {str(exc).strip()[-500:]})", RuntimeWarning,
                          stacklevel=4)
    return _jit_build_variant(csrc, cuda=False)


def _jit_build_variant(csrc, cuda):
    from torch.utils import cpp_extension

    from . import _build_config

    cflags = _build_config.extra_cflags(cuda)
    build_dir = build_directory(os.path.realpath(csrc), " ".join(cflags))
    return cpp_extension.load(
        name="transformer_fast_C",
        sources=_build_config.source_paths(csrc, cuda),
        extra_include_paths=_build_config.include_paths(csrc),
        extra_cflags=cflags,
        extra_cuda_cflags=_build_config.extra_cuda_cflags() if cuda else None,
        extra_ldflags=_build_config.extra_ldflags(),
        build_directory=build_dir,
        verbose=os.environ.get("TRANSFORMER_FAST_VERBOSE_BUILD") == "1",
    )


def sources_newer_than(binary):
    """The C++ sources of this source tree changed after ``binary`` was built (an in-place build not
    redone after an edit: the ops would be the old code), as paths under csrc/ ("ops/schemas.cpp").
    Empty for an installed package (its csrc/ is a copy inside it, whose file times say when it was
    installed) or one without sources."""
    csrc = _csrc_dir()
    package = os.path.dirname(os.path.realpath(__file__))
    if csrc is None or os.path.realpath(csrc) == os.path.join(package, "csrc"):
        return []
    from . import _build_config

    built = os.path.getmtime(binary)
    return [name for name in _build_config.source_files(csrc) if os.path.getmtime(os.path.join(csrc, name)) > built]


def _warn_if_older_than_sources(binary):
    newer = sources_newer_than(binary)
    if newer:
        warnings.warn(f"transformer_fast: the prebuilt C++ extension {binary} is older than "
                      f"csrc/{', csrc/'.join(newer)}; rebuild it (python setup.py build_ext --inplace) or the ops "
                      f"run the old code", RuntimeWarning, stacklevel=4)


def _build_failure(exc):
    """The line of a failed build that says why: the compiler's first error, or the shell's
    complaint about a missing compiler (cpp_extension's message holds their output and ends in
    ninja's "build stopped"), else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines
              if re.search(r"\berror\b|: not found|No such file", line) and not line.startswith("Error building")]
    return (errors[0] if errors else lines[-1] if lines else "")[:500]


# The oldest torch the C++ sources build against: they use ATen APIs that 2.10 lacks (2.4.1, 2.8.0 and
# 2.10.0 fail to compile them; 2.11, the GPU machines' torch, builds them). setup.py declares the same.
MIN_TORCH = (2, 11)


def torch_too_old(version=torch.__version__):
    """Why ``version`` cannot build the extension, or None."""
    found = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if found < MIN_TORCH:
        return f"it needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {version}"
    return None


@functools.lru_cache(maxsize=None)
def load():
    """(module, None), or (None, the reason it cannot be loaded). Loaded once: a second
    cpp_extension.load of the same extension in one process is not safe."""
    too_old = torch_too_old()
    if too_old is not None:
        return None, too_old
    try:
        from . import _C  # built by setup.py

        _warn_if_older_than_sources(_C.__file__)
        return _C, None
    except ImportError as exc:
        # A missing module reads "cannot import name '_C' from partially initialized module".
        prebuilt_error = "none was built" if "cannot import name '_C'" in str(exc) else exc
    try:
        return _jit_build(), None
    except Exception as exc:  # noqa: BLE001 - compiler missing, build error, ...
        reason = (f"no prebuilt transformer_fast._C ({prebuilt_error}) and the JIT build failed: "
                  f"{type(exc).__name__}: {_build_failure(exc)} (the whole log: TRANSFORMER_FAST_VERBOSE_BUILD=1)")
        warnings.warn(f"transformer_fast: the C++ extension is unavailable, so are the ops. Cause: {reason}",
                      RuntimeWarning, stacklevel=3)
        return None, reason


def extension():
    """The loaded C++ extension (raises RuntimeError with the cause if it is unavailable)."""
    module, reason = load()
    if module is None:
        raise RuntimeError(f"transformer_fast's C++ extension is unavailable, and with it every op: {reason}")
    return module
