"""Test set-up shared by every test file.

Without a CUDA device the Triton kernels run under the interpreter on CPU tensors; the
interpreter is chosen when the kernels are decorated, so it must be set before they import.
TRANSFORMER_FAST_POISON=1 makes every kernel fill its outputs with NaN before writing them.
With a GPU, TRANSFORMER_FAST_TILE=0 keeps the autotuned Triton kernels to their first candidate
tile (see kernels/_autotune.py).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

HAS_CUDA_HINT = os.path.exists("/dev/nvidia0") or os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1")
if not HAS_CUDA_HINT:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # one candidate tile per autotuned kernel (test_gpu_every_tile walks them all): far fewer compiles
    os.environ.setdefault("TRANSFORMER_FAST_TILE", "0")
os.environ.setdefault("TRANSFORMER_FAST_POISON", "1")

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers`

import torch  # noqa: E402


# ------------------------------------------------------------------------------------------
# Compiles that run beside the tests. On a machine without Triton's cache (as CI's), the compile
# check (every Triton kernel config built for sm_80 and sm_90) and the nvcc build of the CUDA
# sources take a third of the suite's time, in processes of their own, while most tests keep one
# core of two busy. Where their tests are selected, they start when collection ends, at the
# lowest CPU priority (the tests keep the CPU they need), and their tests run last and read what
# the commands printed and reported.
# ------------------------------------------------------------------------------------------
_COMPILE_CHECK = [sys.executable, "-m", "transformer_fast.kernels.compile_check"]
BACKGROUND_COMMANDS = {
    "test_gpu_compile_check_runs_every_config": _COMPILE_CHECK,
    "test_cuda_sources_compile_for_sm90": _COMPILE_CHECK + ["--cuda", "--arch", "90"],
}
_background = {}  # test name -> (Popen, its output file, its JSON report)


def _start(name):
    folder = tempfile.mkdtemp(prefix="transformer_fast-compile-")
    output, report = os.path.join(folder, "output.txt"), os.path.join(folder, "report.json")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler needs real jit functions
    with open(output, "w") as out:
        proc = subprocess.Popen(BACKGROUND_COMMANDS[name] + ["--json", report], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.nice(19)) if hasattr(os, "nice") else None)
    _background[name] = (proc, output, report)


@pytest.fixture
def background_compile(request):
    """For a test of BACKGROUND_COMMANDS: waits for its command (started now if collection did
    not start it) and returns (exit status, what it printed, its JSON report or None)."""
    def wait(timeout):
        name = request.node.originalname
        if name not in _background:
            _start(name)
        proc, output, report = _background[name]
        proc.wait(timeout=timeout)
        with open(output) as f:
            printed = f.read()
        data = None
        if os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
        return proc.returncode, printed, data
    return wait


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: only what will run
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    last = [item for item in items if item.originalname in BACKGROUND_COMMANDS]
    for item in last:
        items.remove(item)
        items.append(item)
        if item.originalname not in _background and not item.get_closest_marker("skip") \
                and not config.option.collectonly:
            _start(item.originalname)


def pytest_unconfigure(config):
    for proc, output, _ in _background.values():
        if proc.poll() is None:  # an interrupted run: its compiles go with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(os.path.dirname(output), ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
