"""How Triton runs the kernels here: under its interpreter (CPU tensors) or on a GPU, and the
compile options every launch passes."""
import os

# Read once, here: Triton picks the interpreter when it decorates the kernels, which is when they
# import this module, and reading the environment costs ~2 us a lookup on every small call.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Passed to every launch. FMA contraction stays on, as Triton up to 3.9 defaults to and as the
# compile check and the GPU tests ran; Triton 3.9 warns where it is left to the default, which
# Triton 3.10 turns off.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors, the Triton interpreter)."""
    return _INTERPRETING
