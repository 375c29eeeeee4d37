"""Launching the Triton kernels at the driver's cost.

`kernel[grid](*args)` runs Triton's `JITFunction.run` on every call: it binds the 50-75
arguments of a kernel to its signature, works out each one's specialisation (a tensor's dtype
and 16-byte alignment; an int's width, whether it is 1, whether it divides by 16), turns that
into a cache key, finds the compiled kernel and builds the launch hooks' metadata, then launches.
On a 2-core CPU, with Triton 3.6, that cost 44 us more per tiny attention forward than a direct
launch of the same kernel (`benchmarks/tools/launch_overhead_triton.py`).

`CompiledLaunch` keeps, per call pattern, the compiled kernel Triton chose and launches it
directly on later calls: the first call for a pattern goes through `JITFunction.run` (which
compiles or finds the kernel, and launches it), later ones call its launcher with the arguments
Triton passes. The pattern's key holds everything Triton's specialisation reads (each argument's
type; each tensor's dtype and address modulo 16; each int modulo 16, whether it is 1, and whether
it fits 32 bits: worked out in C++, `csrc/launch_signature.cpp`; the keyword arguments, which carry
the constexprs and the compile options; the current device), and more: a key never maps to a
kernel compiled for other arguments, and a finer key only sends a call through Triton once more.
`tests/test_direct_launch.py` checks this against Triton's own `run`, on real compiled kernels,
with a recording driver in place of the GPU.

Through Triton instead, always: under the interpreter (no compiled kernels), before Triton 3.6
(the launcher's calling convention is checked from 3.6 on), with launch hooks or pre-run hooks
installed (profilers such as Proton), with an argument of another type (None, a tuple, a
descriptor), and with TRANSFORMER_FAST_DIRECT_LAUNCH=0. What `run` checks on every call is
checked on the first call of a pattern only: Triton's settings (its knobs: debug mode,
instrumentation) and that the globals a kernel reads have not changed since it compiled; `forget`
drops the entries after changing them."""
import os
import threading
import weakref

from ._utils import interpreting

_DIRECT = os.environ.get("TRANSFORMER_FAST_DIRECT_LAUNCH", "1") != "0"
# The launcher call below is Triton's own (JITFunction.run) from 3.6 on, the versions checked
# (3.6 and 3.9); older ones launch through Triton's run.
_FIRST_DIRECT_TRITON = (3, 6)
_MAX_ENTRIES = 4096  # per kernel; a full table starts again (shapes that change every call)


def _triton_version():
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def _launch_hooks_installed(runtime):
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Triton 3.6+ keeps them as HookChains (never None): installed when the chain has calls
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


class CompiledLaunch:
    """`launch[grid](*args, **kwargs)` as `kernel[grid](*args, **kwargs)`, launching the compiled
    kernel directly once Triton has made it for the call's pattern (module docstring)."""

    instances = weakref.WeakSet()  # every launch, for tools that switch direct launches off and on

    def __init__(self, kernel):
        self.kernel = kernel  # a triton.JITFunction (an InterpretedFunction under the interpreter)
        self.direct = _DIRECT and not interpreting() and _triton_version() >= _FIRST_DIRECT_TRITON
        self.entries = {}
        self._driver = None
        self._signature = None
        self._pre_run_hooks = getattr(kernel, "pre_run_hooks", ())  # Triton's list: hooks added later show
        CompiledLaunch.instances.add(self)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def __call__(self, grid, *args, **kwargs):
        self.launch(grid, args, kwargs)

    def forget(self):
        self.entries.clear()

    def launch(self, grid, args, kwargs):
        """Launches the kernel over `grid` with positional `args` and keyword `kwargs`."""
        if self.direct and self._driver is None:
            self._bind()
        if not self.direct:
            return self.kernel[grid](*args, **kwargs)
        driver, runtime = self._driver
        device = driver.get_current_device()
        key = self._key(device, args, kwargs)
        entry = self.entries.get(key) if key is not None else None
        if entry is None or _launch_hooks_installed(runtime) or self._pre_run_hooks:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and entry is None:
                self._remember(key, compiled, len(args), kwargs)
            return
        compiled, tail = entry
        if callable(grid):
            grid = grid(kwargs)  # the constexprs and the compile options by name
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.get_current_stream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)

    def _bind(self):
        from triton import knobs
        from triton.runtime import driver

        from transformer_fast import _build  # here, not at import: this package also imports alone

        self._signature = _build.extension().triton_launch_signature
        self._driver = (driver.active, knobs.runtime)

    def _key(self, device, args, kwargs):
        """The call's pattern: the positional arguments' signature (csrc/launch_signature.cpp: each
        one's type, a tensor's dtype and address mod 16, an int's width and value mod 16 or 1),
        the device, then the keyword arguments' names and values. One flat tuple, hashed on every
        call; its length fixes the number of keyword arguments, so no two patterns' parts can run
        into each other. None where an argument is of a type the signature does not cover."""
        signature = self._signature(args)
        return None if signature is None else (signature, device, *kwargs, *kwargs.values())

    def _remember(self, key, compiled, n_args, kwargs):
        """Keeps `compiled` for `key`, with the values of the parameters after the positional
        arguments (constexprs, which the launcher skips), in signature order as Triton passes them."""
        if compiled is None or not hasattr(compiled, "packed_metadata"):  # a warm-up, or an async compile's future
            return
        tail = []
        for param in self.kernel.params[n_args:]:
            if not param.is_constexpr:  # a run-time argument given by name: leave every such call to Triton
                return
            tail.append(kwargs[param.name] if param.name in kwargs else param.default)
        if len(self.entries) >= _MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = (compiled, tuple(tail))


class TunedLaunch:
    """Launches an autotuned kernel through the choice it made for a call's `key`.

    Triton's autotuner builds its own key on every call, looking at each argument for a dtype
    (about 70 arguments for the attention kernels): on an H200's host that took more time than the
    launch that follows (benchmarks/results/cuda-h200-host-2026-11-26.txt). Here the first call for
    a key goes through the autotuner (which times the candidates or reads its disk cache), and
    later calls launch the chosen config through a CompiledLaunch of the jit function.
    `key` must determine the autotuner's key (its values and the tensors' dtypes); a finer key only
    asks the autotuner more often. Forced tiles (TRANSFORMER_FAST_TILE) are read when a choice is
    made: `forget` drops the choices (the autotuner's too) after changing it."""

    def __init__(self, autotuned):
        self.autotuned = autotuned
        self.compiled = CompiledLaunch(autotuned.fn)
        self.chosen = {}
        self._choosing = threading.Lock()  # best_config is the autotuner's last choice, of any thread's call

    def __call__(self, key, grid, *args, **kwargs):
        config = self.chosen.get(key)
        if config is None:
            with self._choosing:
                self.autotuned[grid](*args, **kwargs)
                self.chosen[key] = self.autotuned.best_config.all_kwargs()
        else:
            kwargs.update(config)
            self.compiled.launch(grid, args, kwargs)

    def forget(self):
        self.chosen.clear()
        self.autotuned.cache.clear()
        self.compiled.forget()
