"""Which tile an autotuned kernel launches with: Triton's autotuner over the candidates (their
choices cached on disk), or the one TRANSFORMER_FAST_TILE forces."""
import inspect
import os

from ._triton_options import interpreting


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
