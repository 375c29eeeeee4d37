"""Small helpers shared by the Triton launchers."""
import os

import torch
import triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors, the Triton interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def new_output(shape, dtype, device):
    """torch.empty, or NaN-filled with TRANSFORMER_FAST_POISON=1 so tests catch unwritten elements."""
    if os.environ.get("TRANSFORMER_FAST_POISON") == "1":
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def autotune_configs(configs):
    """The interpreter cannot benchmark (multi-config autotune raises "0 active drivers"): keep one."""
    return configs[:1] if interpreting() else configs


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


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
