"""Launching the Triton kernels at the driver's cost.

`kernel[grid](*args)` runs Triton's `JITFunction.run` on every call: it binds the 50-75
arguments of a kernel to its signature, works out each one's specialisation (a tensor's dtype
and 16-byte alignment; an int's width, whether it is 1, whether it divides by 16), turns that
into a cache key, finds the compiled kernel and builds the launch hooks' metadata, then launches.
On a 2-core CPU, with Triton 3.6, that cost 44 us more per tiny attention forward than a direct
launch of the same kernel (measured with kernels launched into `tests/launch/recording_driver.py`).

`CompiledLaunch` keeps, per call pattern, the compiled kernel Triton chose and launches it
directly on later calls: the first call for a pattern goes through `JITFunction.run` (which
compiles or finds the kernel, and launches it), later ones call its launcher with the arguments
Triton passes. The pattern's key holds everything Triton's specialisation reads (each argument's
type; each tensor's dtype and address modulo 16; each int modulo 16, whether it is 1, and whether
it fits 32 bits: worked out in C++, `csrc/launch/launch_signature.cpp`; the keyword arguments, which carry
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
drops the entries after changing them.

Launch plans go one step further, for the launchers' hot paths: a launcher works out, once per
call signature (`launch_plan_signature`: its arguments' dtypes, devices, sizes, strides, addresses mod 16
and values, csrc/launch/launch_signature.cpp), everything a launch takes but the call's tensors (and a
dropout seed), as `LaunchPlan`s; `run(plan, tensors)` then launches the plan's compiled kernel
with no key built and nothing looked up. That is sound because each launch argument of a plan is
then fixed by the signature (grids, strides, flags, tiles) or is one of the call's tensors, whose
dtypes and alignments the signature fixes too, or a new output (aligned by its allocator); the
seed's value enters the signature by what Triton specialises on (`seed_class`).

Packed launches take the last step out of Python (TRANSFORMER_FAST_NATIVE_LAUNCH=0 turns them
off): a plan launched directly gets, at its second launch (`_PACK_LATER`), a `PackedLaunch`
(csrc/launch/triton_launch.cpp) holding the kernel's parameters packed as Triton's launcher would pass
them, and `run` hands it the call's tensors and seed: C++ writes their addresses into a copy, takes
the device's current stream and calls cuLaunchKernel. Triton's launcher instead asks each tensor
for its address through Python, and the driver to check it, on every launch. Packed launches cover
a CUDA driver's kernels with one CTA per cluster, no launch attributes (PDL, cooperative grids), no
scratch memory and scalar parameters of int, uint and fp32 types; anything else launches as before.
Checked against Triton's own arguments without a GPU (`tests/launch/check_launches.py`,
through a recording CUDA driver library) and against Triton's results on an H100
(tests/test_direct_launch.py's gpu tests).

With the same setting, the attention and norm ops' CUDA kernels are native calls
(transformer_fast/_native_calls.py, csrc/launch/native_calls.cpp), which replay a call's packed launches
from C++. A thread's call recording (kernels/_call_recording.record_call) collects the packed launches made
here; any other launch marks it incomplete (`_not_packed`). Forgetting plans or kernels drops the
native calls' recipes too (`_forget_hooks`)."""
import ctypes
import os
import struct
import threading
import weakref

from ._call_recording import recording
from ._triton_options import interpreting

_DIRECT = os.environ.get("TRANSFORMER_FAST_DIRECT_LAUNCH", "1") != "0"
_NATIVE = os.environ.get("TRANSFORMER_FAST_NATIVE_LAUNCH", "1") != "0"
# The launcher call below is Triton's own (JITFunction.run) from 3.6 on, the versions checked
# (3.6 and 3.9); older ones launch through Triton's run.
_FIRST_DIRECT_TRITON = (3, 6)
_MAX_ENTRIES = 4096  # per kernel or launcher; a full table starts again (shapes that change every call)


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
        self.native = _NATIVE  # plans' direct launches packed for C++ (module docstring)
        self.entries = {}
        self.generation = 0  # counts `forget`s: a plan's direct launch is of the generation it was made in
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
        self.generation += 1
        forget_native_calls()

    def launch(self, grid, args, kwargs):
        """Launches the kernel over `grid` with positional `args` and keyword `kwargs`. Returns
        ((compiled kernel, tail), device) where it launched directly or made the entry for the
        next such call, else None."""
        _not_packed()
        if self.direct and self._driver is None:
            self._bind()
        if not self.direct:
            self.kernel[grid](*args, **kwargs)
            return None
        driver, runtime = self._driver
        device = driver.get_current_device()
        key = self._key(device, args, kwargs)
        entry = self.entries.get(key) if key is not None else None
        if entry is None or _launch_hooks_installed(runtime) or self._pre_run_hooks:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if key is None or entry is not None:
                return None
            entry = self._remember(key, compiled, len(args), kwargs)
            return None if entry is None else (entry, device)
        compiled, tail = entry
        gx, gy, gz = _grid3(grid, kwargs)
        compiled.run(gx, gy, gz, driver.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *tail)
        return entry, device

    def run(self, plan, tensors, seed=0):
        """Launches `plan` (a LaunchPlan of this kernel) with the call's `tensors` and `seed`."""
        if not self.launch_planned(plan, tensors, seed):
            plan.remember(self, self.launch(plan.grid, plan.args(tensors, seed), plan.kwargs), plan.kwargs)

    def launch_planned(self, plan, tensors, seed):
        """Launches `plan`'s compiled kernel with the call's `tensors` and `seed` where it is known
        and current; True if it did."""
        direct = plan.direct
        if direct is None or not self.direct:
            return False
        compiled, grid, tail, device, generation, packed = direct
        driver, runtime = self._driver
        if generation != self.generation or _launch_hooks_installed(runtime) or self._pre_run_hooks:
            return False
        if self.native:
            if packed is _PACK_LATER:  # the plan's second launch: worth packing
                packed = self.packed(compiled, grid, plan, len(tensors), device)
                plan.direct = (*direct[:5], packed)
            if packed is not None:
                if not packed.launch(tensors, seed):  # another device is current
                    return False
                rec = recording()
                if rec is not None:
                    rec.launches.append((packed, tensors, seed))
                return True
        if driver.get_current_device() != device:
            return False
        _not_packed()
        compiled.run(grid[0], grid[1], grid[2], driver.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *plan.args(tensors, seed), *tail)
        return True

    def packed(self, compiled, grid, plan, n_tensors, device):
        """`plan`'s launch of `compiled` over `grid` as a PackedLaunch (module docstring), or None
        where packed launches do not cover it."""
        driver = self._driver[0]
        functions = _cuda_driver_functions(driver)
        packing = None if functions is None else _pack_params(self.kernel, compiled, plan, n_tensors)
        if packing is None:
            return None
        from transformer_fast import _build  # here, not at import: this package also imports alone

        params, tensor_params, seed_param = packing
        try:
            return _build.extension().PackedLaunch(
                compiled.function, grid, 32 * compiled.metadata.num_warps, compiled.metadata.shared, params,
                tensor_params, seed_param, functions, device, getattr(driver, "fixed_stream", None))
        except RuntimeError:  # a torch whose CUDA device guard gives no native stream handle
            self.native = False
            return None

    def _bind(self):
        from triton import knobs
        from triton.runtime import driver

        from transformer_fast import _build  # here, not at import: this package also imports alone

        self._signature = _build.extension().triton_launch_signature
        self._driver = (driver.active, knobs.runtime)

    def _key(self, device, args, kwargs):
        """The call's pattern: the positional arguments' signature (csrc/launch/launch_signature.cpp: each
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
            return None
        tail = []
        for param in self.kernel.params[n_args:]:
            if not param.is_constexpr:  # a run-time argument given by name: leave every such call to Triton
                return None
            tail.append(kwargs[param.name] if param.name in kwargs else param.default)
        if len(self.entries) >= _MAX_ENTRIES:
            self.entries.clear()
        entry = self.entries[key] = (compiled, tuple(tail))
        return entry


class TunedLaunch:
    """Launches an autotuned kernel through the choice it made for a call's `key`.

    Triton's autotuner builds its own key on every call, looking at each argument for a dtype
    (about 70 arguments for the attention kernels): on an H200's host that took more time than the
    launch that follows (git show e4a4db1:benchmarks/results/cuda-h200-host-2026-11-26.txt). Here the first call for
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
            _not_packed()
            with self._choosing:
                self.autotuned[grid](*args, **kwargs)
                self.chosen[key] = self.autotuned.best_config.all_kwargs()
        else:
            kwargs.update(config)
            self.compiled.launch(grid, args, kwargs)

    def run(self, plan, tensors, seed=0):
        """Launches `plan` (a LaunchPlan of this kernel, its `key` the choice's) with the call's
        `tensors` and `seed`."""
        if self.compiled.launch_planned(plan, tensors, seed):
            return
        args = plan.args(tensors, seed)
        config = self.chosen.get(plan.key)
        if config is None:
            self(plan.key, plan.grid, *args, **plan.kwargs)
            return
        kwargs = {**plan.kwargs, **config}
        plan.remember(self.compiled, self.compiled.launch(plan.grid, args, kwargs), kwargs)

    def forget(self):
        self.chosen.clear()
        self.autotuned.cache.clear()
        self.compiled.forget()


def _not_packed():
    """Marks the thread's call recording (if any) incomplete: a launch not packed."""
    rec = recording()
    if rec is not None:
        rec.complete = False


_forget_hooks = []  # called whenever plans or compiled kernels are forgotten (transformer_fast/_native_calls.py)


def forget_native_calls():
    for hook in _forget_hooks:
        hook()


def _grid3(grid, kwargs):
    """`grid` (a tuple, or a function of the constexprs and compile options by name) as 3 ints."""
    if callable(grid):
        grid = grid(kwargs)
    n = len(grid)
    return grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1


class LaunchPlan:
    """One launch with everything but its tensors (and a dropout seed) fixed: made by a launcher
    once per call signature (module docstring), launched by its kernel's `run` with each call's
    tensors. The positional arguments are the tensors, then `scalars` (the seed at `seed_at`)."""

    __slots__ = ("grid", "scalars", "kwargs", "key", "seed_at", "direct")

    def __init__(self, grid, scalars, kwargs, key=None, seed_at=None):
        self.grid, self.scalars, self.kwargs, self.key, self.seed_at = grid, tuple(scalars), kwargs, key, seed_at
        # (compiled kernel, grid, tail, device, generation, PackedLaunch, None or _PACK_LATER) once known
        self.direct = None

    def args(self, tensors, seed):
        if self.seed_at is None:
            return (*tensors, *self.scalars)
        return (*tensors, *self.scalars[:self.seed_at], seed, *self.scalars[self.seed_at + 1:])

    def remember(self, launch, launched, kwargs):
        """Keeps the compiled kernel `launch.launch` returned (`launched`) for the next calls."""
        if launched is not None:
            (compiled, tail), device = launched
            self.direct = (compiled, _grid3(self.grid, kwargs), tail, device, launch.generation, _PACK_LATER)

    @property
    def packed_launch(self):
        """The plan's PackedLaunch once made (packed launches on, the plan launched twice), else None."""
        packed = None if self.direct is None else self.direct[5]
        return None if packed is _PACK_LATER else packed


# A plan's packed launch is made at its second launch: packing its parameters costs about as much
# as a launch through Triton's launcher, and a plan made for one call (decoding from a cache that
# grows every step) is never launched again.
_PACK_LATER = object()


_INT_TYPES = frozenset(("i1", "i8", "i16", "i32", "i64"))
_UINT_TYPES = frozenset(("u1", "u8", "u16", "u32", "u64"))
_MAX_SHARED_WITHOUT_ATTRIBUTE = 228 * 1024  # beyond it Triton 3.9 launches with an attribute: not packed
_MAX_PACKED_PARAMS = 128  # csrc/launch/triton_launch.cpp's kMaxParams
_driver_functions = {}


def _cuda_driver_functions(driver):
    """The addresses of cuLaunchKernel, cuCtxGetCurrent and cuGetErrorName in `driver`'s CUDA library
    (its `cuda_library`, else libcuda.so.1, which torch has loaded), or None for a driver that is
    not CUDA's or a library that does not load."""
    library = getattr(driver, "cuda_library", "libcuda.so.1")
    if library not in _driver_functions:
        functions = None
        try:
            if driver.get_current_target().backend == "cuda":
                lib = ctypes.CDLL(library)
                functions = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                                  for name in ("cuLaunchKernel", "cuCtxGetCurrent", "cuGetErrorName"))
        except (OSError, AttributeError):
            functions = None
        _driver_functions[library] = functions
    return _driver_functions[library]


def _pack_params(kernel, compiled, plan, n_tensors):
    """(params, tensor_params, seed_param) of csrc/launch/triton_launch.cpp for `plan`'s launch of
    `compiled` (made from `kernel`): Triton's signature without its constexprs, 8 bytes each, the
    tensors' and the seed's slots left for each launch, then the two scratch pointers; None where
    a PackedLaunch does not cover the launch (module docstring)."""
    meta = compiled.metadata
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False) or
            getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "global_scratch_size", 0) or
            getattr(meta, "profile_scratch_size", 0) or getattr(meta, "tensordesc_meta", None) or
            meta.shared > _MAX_SHARED_WITHOUT_ATTRIBUTE or getattr(compiled.run, "gsan_enabled", False)):
        return None
    types = list(compiled.src.signature.values())
    n_args = n_tensors + len(plan.scalars)
    if len(types) != len(kernel.params) or n_args > len(types):
        return None
    params, tensor_params, seed_param = bytearray(), [], -1
    for i, ty in enumerate(types):
        if ty == "constexpr":
            continue
        slot = len(params) // 8
        if i >= n_args or not isinstance(ty, str):  # a run-time argument by keyword; a tuple
            return None
        if ty.startswith("*"):
            if i >= n_tensors:
                return None
            tensor_params.append((slot, i))
            params += bytes(8)
        elif i < n_tensors:
            return None
        elif i - n_tensors == plan.seed_at:
            if ty not in ("i32", "i64"):
                return None
            seed_param = slot
            params += bytes(8)
        elif ty in _INT_TYPES:
            params += struct.pack("<q", int(plan.scalars[i - n_tensors]))
        elif ty in _UINT_TYPES:
            params += struct.pack("<Q", int(plan.scalars[i - n_tensors]))
        elif ty in ("fp32", "f32"):
            params += struct.pack("<f", float(plan.scalars[i - n_tensors])) + bytes(4)
        else:
            return None
    params += bytes(16)  # the global and profile scratch pointers: none
    if len(params) > 8 * _MAX_PACKED_PARAMS:
        return None
    return bytes(params), tensor_params, seed_param


def seed_class(seed):
    """What Triton specialises on of an int argument's value (1, a multiple of 16, its width):
    a dropout seed's part of a call signature, as its value changes from call to call."""
    return seed == 1, seed % 16 == 0, -2 ** 31 <= seed < 2 ** 31, -2 ** 63 <= seed < 2 ** 63


class Plans:
    """A launcher's plans by call signature. `get(args, extra)` returns the plan for the call
    whose arguments are `args` (and `extra`, what else the plan depends on), made by `make(*args)`
    where there is none yet; a call the signature cannot describe is planned afresh each time. A
    plan keeps what the launcher's rules chose when it was made: code that changes those rules (a
    tile sweep patching them) must `clear` the plans."""

    instances = weakref.WeakSet()  # every launcher's, for tools that drop every compiled kernel

    def __init__(self, make):
        self.make = make
        self.plans = {}
        self._signature = None
        Plans.instances.add(self)

    def get(self, args, extra=None):
        if self._signature is None:
            from transformer_fast import _build  # here, not at import: this package also imports alone

            self._signature = _build.extension().launch_plan_signature
        signature = self._signature((args, extra))
        plan = self.plans.get(signature) if signature is not None else None
        if plan is None:
            plan = self.make(*args)
            if signature is not None:
                if len(self.plans) >= _MAX_ENTRIES:
                    self.plans.clear()
                self.plans[signature] = plan
        return plan

    def clear(self):
        self.plans.clear()
        forget_native_calls()
