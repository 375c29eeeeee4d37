"""Small helpers shared by the Triton launchers."""
import contextlib
import inspect
import os
import threading

import torch


# Both read once, here: Triton picks the interpreter when it decorates the kernels, which is when
# they import this module, and reading the environment costs ~2 us a lookup on every small call.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_POISON = os.environ.get("TRANSFORMER_FAST_POISON") == "1"


# Passed to every launch. FMA contraction stays on, as Triton up to 3.9 defaults to and as the
# compile check and the GPU tests ran; Triton 3.9 warns where it is left to the default, which
# Triton 3.10 turns off.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors, the Triton interpreter)."""
    return _INTERPRETING


class CallRecording:
    """What one op call's launchers made, for its native call (transformer_fast/_native_calls.py):
    `news` (kind, the new tensor, the tensor copied or None) in order, `launches` (packed launch,
    tensors, seed) in order, and `complete`, False once anything launched otherwise. The launchers
    of a native op make every tensor they launch with or return through the helpers below and
    change them only by launches: a recording cannot see anything else."""

    SCRATCH, ZEROS, OUTPUT, COPY = range(4)  # csrc/launch/native_calls.cpp's NewKind

    def __init__(self):
        self.news, self.launches, self.complete = [], [], True


_thread = threading.local()


def recording():
    """The calling thread's CallRecording, or None (almost always)."""
    return getattr(_thread, "recording", None)


@contextlib.contextmanager
def record_call():
    """Records, inside, what this thread's launchers make (a CallRecording)."""
    _thread.recording = rec = CallRecording()
    try:
        yield rec
    finally:
        _thread.recording = None


def _empty(shape, dtype, device):
    # sizes as separate arguments: torch parses them ~0.7 us faster than one tuple
    return torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)


def new_output(shape, dtype, device):
    """torch.empty, or NaN-filled with TRANSFORMER_FAST_POISON=1 (set before the kernels are first
    used) so tests catch unwritten elements."""
    if _POISON:
        out = torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    else:
        out = _empty(shape, dtype, device)
    rec = recording()
    if rec is not None:
        rec.news.append((CallRecording.OUTPUT, out, None))
    return out


def new_scratch(shape, dtype, device, zero=False):
    """A launch's working tensor: torch.empty (never poisoned: the kernels write what they read), or
    zeros."""
    out = torch.zeros(shape, dtype=dtype, device=device) if zero else _empty(shape, dtype, device)
    rec = recording()
    if rec is not None:
        rec.news.append((CallRecording.ZEROS if zero else CallRecording.SCRATCH, out, None))
    return out


def contiguous(t):
    """t.contiguous(), the copy (where it makes one) recorded."""
    out = t.contiguous()
    if out is not t:
        rec = recording()
        if rec is not None:
            rec.news.append((CallRecording.COPY, out, t))
    return out


def strides_in_rows_of(like):
    """(transposed, strides) of a new attention result in the row order of ``like`` (B, H, N, *)
    (transformer_fast/_layout.py): whether it is laid out (B, N, H, W) and viewed as (B, H, N, W),
    and its (batch, head, row) strides counted in rows of W elements, as the kernels take them."""
    # transformer_fast/_layout.py's rule, restated: this package imports nothing from transformer_fast
    # at import time, as it must also import as a top-level `kernels` (transformers probes for a package
    # of that name, and finds this one wherever the checkout is on sys.path)
    _, H, N, _ = like.shape
    rows_h, rows_n = max(H, 1), max(N, 1)  # as torch lays a new tensor out: a size-0 dim counts as 1
    if like.stride(1) < like.stride(2):
        return True, (rows_n * rows_h, 1, rows_h)
    return False, (rows_h * rows_n, rows_n, 1)


def _in_rows_of(like, width, new):
    """new(shape) as a (B, H, N, width) tensor in the row order of ``like`` (strides_in_rows_of)."""
    B, H, N, _ = like.shape
    if strides_in_rows_of(like)[0]:
        return new((B, N, H, width)).transpose(1, 2)
    return new((B, H, N, width))


def new_output_in_rows_of(like, width):
    """new_output for an attention result of width ``width`` in the row order of ``like`` (B, H, N, *)."""
    return _in_rows_of(like, width, lambda shape: new_output(shape, like.dtype, like.device))


def new_scratch_in_rows_of(like, width, dtype, zero=False):
    """new_scratch laid out as new_output_in_rows_of(like, width) would be."""
    return _in_rows_of(like, width, lambda shape: new_scratch(shape, dtype, like.device, zero))


def row_strides(t):
    """The (batch, head, row) strides of a (B, H, N, W) tensor in rows of W elements, or None where
    they are not whole rows (a last-dim stride other than 1, or a stride not a multiple of W)."""
    width, strides = max(t.shape[-1], 1), t.stride()[:3]
    if (width > 1 and t.stride(-1) != 1) or any(s % width for s in strides):
        return None
    return tuple(s // width for s in strides)


def autotune(configs, key, early_config_prune, reset_to_zero=None):
    """triton.autotune over `configs` (only the first under the interpreter, which cannot
    benchmark: a multi-config autotune raises "0 active drivers"), keyed on the kernel arguments
    named in `key`, with `early_config_prune` choosing a call's candidates; `reset_to_zero` names
    the arguments a kernel adds into, zeroed before each timed run and once after the timing.

    Where Triton has it (3.4 and later), cache_results=True keeps each tuned choice on disk, in
    Triton's cache directory (TRITON_CACHE_DIR), so a new process does not time the candidates
    again. Triton keys an entry on its own version and source, the GPU target (backend and
    architecture), the kernel's source with the jit functions it calls, the environment
    variables that change compilation, the values of `key` (and the dtypes of the tensor
    arguments) and the candidate configs left after pruning: an entry is reused only for the
    same kernel, tiles, toolchain and kind of GPU."""
    import triton

    return triton.autotune(configs=configs[:1] if interpreting() else configs, key=key,
                           prune_configs_by={"early_config_prune": early_config_prune}, reset_to_zero=reset_to_zero,
                           **_autotune_cache_option())


def _autotune_cache_option():
    import triton

    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def forced_tile_index():
    """TRANSFORMER_FAST_TILE=i: autotuned kernels use only the i-th candidate tile of their table
    (modulo its length) instead of timing them all. The GPU tests set it (a grid compiles one tile
    per kernel, and a separate test walks every i); unset, the kernels autotune."""
    value = os.environ.get("TRANSFORMER_FAST_TILE", "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"TRANSFORMER_FAST_TILE must be a tile index (an integer), got {value!r}") from None


_SM_COUNTS = {}


def sm_count(device):
    """The number of SMs (streaming multiprocessors) of the CUDA `device`, read once per device
    (torch.cuda.get_device_properties costs microseconds a call, and launchers ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv's constexpr wrapper costs ~5 us a call, as below)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1). Plain Python: triton.next_power_of_2 goes
    through a constexpr wrapper that costs ~5 us a call, and launchers make several per call."""
    return 1 << (max(int(n), 1) - 1).bit_length()
