"""A Triton driver that compiles for a GPU and records launches instead of making them.

With it active, `kernel[grid](...)` on CPU tensors runs all of Triton's host side for real
(binding, specialisation, compilation for sm_90 with Triton's own ptxas, the kernel cache, the
launcher's arguments) and ends by appending the launcher's arguments to `launches`: what a call
costs on the host apart from the driver's own launch, and exactly what would be launched, on a
machine without a GPU. The package's kernels must be imported without TRITON_INTERPRET (they
are interpreter objects under it). Used by `launch_overhead_triton.py` and
tests/test_direct_launch.py."""
import contextlib
import gc

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

launches = []  # (launcher, (gx, gy, gz), stream, function, args, launched through Triton's run)
STREAM = 7


class RecordingLauncher:
    """Stands for the driver's launcher of one compiled kernel."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, leave, *args):
        # Triton's run always passes its launch-hook chains (3.6+); a direct launch passes None
        launches.append((self, (gx, gy, gz), stream, function, args, enter is not None))


class RecordingUtils:
    def load_binary(self, name, kernel, shared, device):
        return object(), object(), 32, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}  # an H100's

    def unload_module(self, module):
        pass


class RecordingDriver:
    launcher_cls = RecordingLauncher
    utils = RecordingUtils()

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


@contextlib.contextmanager
def recording_driver():
    """Makes the recording driver Triton's active driver (and `launches` empty) inside."""
    launches.clear()
    previous = driver._active  # None without a GPU: reset_active would look for a real driver
    driver.set_active(RecordingDriver())
    try:
        yield launches
    finally:
        launches.clear()
        gc.collect()  # compiled kernels unload through the driver that loaded them
        driver.set_active(previous)
