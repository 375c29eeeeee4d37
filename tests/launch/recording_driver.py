"""A Triton driver that compiles for a GPU and records launches instead of making them.

With it active, `kernel[grid](...)` on CPU tensors runs all of Triton's host side for real
(binding, specialisation, compilation for sm_90 with Triton's own ptxas, the kernel cache, the
launcher's arguments) and ends by appending the launcher's arguments to `launches`: what a call
costs on the host apart from the driver's own launch, and exactly what would be launched, on a
machine without a GPU. The package's kernels must be imported without TRITON_INTERPRET (they
are interpreter objects under it). Used by check_launches.py,
check_native_calls.py and tests/test_direct_launch.py.

Packed launches (kernels/_launch.py) call the CUDA driver library itself: this driver names a
library of its own (`recording_libcuda.c`, built with the system's C compiler against Triton's
cuda.h on first use) whose launches record what they were given, parameters included, for
`library_launches` to read. With `triton_launcher=True` the compiled kernels launch through
Triton's own launcher (its C code, built against that library as against libcuda), so that a
launch costs here what it costs on a GPU's host but for the driver's work, and reaches the same
recording."""
import contextlib
import ctypes
import gc
import itertools
import os
import subprocess
import sysconfig
import tempfile

import triton

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

launches = []  # (launcher, (gx, gy, gz), stream, function, args, launched through Triton's run)
STREAM = 7
_handles = itertools.count(0x1000)  # compiled kernels' function handles (ints, as CUDA's)
_library = None


class RecordingLauncher:
    """Stands for the driver's launcher of one compiled kernel."""

    def __init__(self, src, metadata):
        self.src, self.metadata = src, metadata

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, leave, *args):
        # Triton's run always passes its launch-hook chains (3.6+); a direct launch passes None
        launches.append((self, (gx, gy, gz), stream, function, args, enter is not None))


class RecordingUtils:
    def load_binary(self, name, kernel, shared, device):
        return object(), next(_handles), 32, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}  # an H100's

    def unload_module(self, module):
        pass


class RecordedLaunch(ctypes.Structure):
    _fields_ = [("function", ctypes.c_uint64), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_uint64), ("num_params", ctypes.c_int),
                ("num_attrs", ctypes.c_int), ("params", ctypes.c_ubyte * (128 * 8))]


def library():
    """The recording CUDA library (ctypes), built on first use: libcuda.so.1 in a directory of its
    own (`path`; libcuda.so beside it for linkers), loaded so that a dlopen of libcuda.so.1 finds it."""
    global _library
    if _library is None:
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recording_libcuda.c")
        include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
        directory = tempfile.mkdtemp(prefix="recording_libcuda_")
        path = os.path.join(directory, "libcuda.so.1")
        compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{include}", "-Wl,-soname,libcuda.so.1", source, "-o",
                        path], check=True, capture_output=True)
        os.symlink(path, os.path.join(directory, "libcuda.so"))
        _library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _library.recording_launch.restype = ctypes.POINTER(RecordedLaunch)
        _library.recording_set_param_count.argtypes = [ctypes.c_uint64, ctypes.c_int]
        _library.recording_set_context.argtypes = [ctypes.c_void_p]
        _library.path = path
    return _library


def library_launches():
    """The launches the recording library has seen since the last `library().recording_clear()`:
    (function, grid, block, shared bytes, stream, parameter slots as bytes, 8 each, or None where
    the function's parameter count was not set, launch attributes)."""
    lib = library()
    out = []
    for i in range(min(lib.recording_count(), 256)):
        r = lib.recording_launch(i).contents
        params = bytes(r.params[:8 * r.num_params]) if r.num_params >= 0 else None
        out.append((r.function, tuple(r.grid), tuple(r.block), r.shared_bytes, r.stream, params, r.num_attrs))
    return out


class RecordingDriver:
    launcher_cls = RecordingLauncher
    utils = RecordingUtils()
    fixed_stream = STREAM  # packed launches: the stream to launch on (no CUDA stream to ask torch for)

    @property
    def cuda_library(self):
        return library().path

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return STREAM

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_benchmarker(self):
        # Triton 3.6's autotuner times even a single candidate where it keeps results on disk;
        # nothing runs here, so every candidate takes 1 ms (and nothing is launched to time it)
        return lambda fn, quantiles=None, **kwargs: [1.0] * len(quantiles) if quantiles else 1.0


class _TritonUtils(RecordingUtils):
    """The recording driver's kernel loading, with the rest of Triton's CUDA utilities (its
    launcher's C code among them), built against the recording library."""

    def __init__(self):
        from triton import knobs
        from triton.backends.nvidia.driver import CudaUtils

        knobs.nvidia.libcuda_path = os.path.dirname(library().path)
        self.cuda = CudaUtils()

    def __getattr__(self, name):
        return getattr(self.cuda, name)


class TritonLauncherDriver(RecordingDriver):
    """The recording driver with Triton's own launcher (its launches reach the recording library)."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaLauncher

        self.launcher_cls = CudaLauncher
        self.utils = _TritonUtils()


@contextlib.contextmanager
def recording_driver(triton_launcher=False):
    """Makes the recording driver Triton's active driver (and `launches` empty) inside; with
    `triton_launcher`, the one whose kernels launch through Triton's own launcher."""
    launches.clear()
    previous = driver._active  # None without a GPU: reset_active would look for a real driver
    driver.set_active(TritonLauncherDriver() if triton_launcher else RecordingDriver())
    try:
        yield launches
    finally:
        launches.clear()
        gc.collect()  # compiled kernels unload through the driver that loaded them
        driver.set_active(previous)
