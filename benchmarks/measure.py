"""How the benchmark measures: time, peak memory, and the hardware's ceilings.

Time. CPU: the implementations of a group are timed round-robin (each repeat runs every
implementation once, in a rotated order), so a slow phase of a shared machine hits all of them
alike; each sample runs an implementation enough times back to back to last `min_sample_s`,
and the reported time is the median of the samples. CUDA: `triton.testing.do_bench` (median,
L2 flushed, device-synchronised) per implementation, repeated round-robin for a few rounds.

Peak memory. CUDA: `torch.cuda.max_memory_allocated` during one call, minus what was
allocated before it. CPU: torch has no allocator statistics for the CPU, so one call runs under
`torch.profiler` with `profile_memory=True`, which records every allocation and free of
torch's CPU allocator; the peak of their running sum is the memory the call needed above its
inputs (tensors allocated outside torch's allocator, e.g. by a library's own scratch buffers,
are not seen).
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(samples_s):
    """Median and quartiles of samples (seconds) in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    if len(ms) == 1:
        return {"median_ms": ms[0], "q1_ms": ms[0], "q3_ms": ms[0], "min_ms": ms[0], "samples": 1}
    q = statistics.quantiles(ms, n=4, method="inclusive")
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "min_ms": ms[0], "samples": len(ms)}


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    # The young generations only: a full collection walks every object of torch and transformers
    # (0.3 s a call, a third of the harness's smoke run); older garbage is left to the collector,
    # which runs between the timed regions.
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def time_once(fn, device):
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def time_interleaved(fns, device, *, first_call_s=None, max_repeats=25, min_repeats=5, budget_s=4.0,
                     min_sample_s=0.01, keep_samples=False):
    """{name: summary} for the callables in `fns` ({name: fn}), timed round-robin.

    `first_call_s` ({name: seconds}) is an earlier measurement of one call, used to choose how
    many calls make a sample and how many repeats fit in `budget_s`. With `keep_samples`, each
    summary also has "samples_ms": one per round, in round order (see `paired_ratio`)."""
    if not fns:
        return {}
    if device.type == "cuda":
        return _time_cuda(fns, max(3, min_repeats // 2), keep_samples)
    names = list(fns)
    first_call_s = dict(first_call_s or {})
    inner, est_round = {}, 0.0
    with _gc_paused():
        for name in names:  # calibration (and warm-up) unless an earlier call was long enough to tell
            t = first_call_s.get(name, 0.0)
            if t < 0.05:
                t = min(time_once(fns[name], device), t or float("inf"))
            inner[name] = max(1, min(1000, int(min_sample_s / max(t, 1e-7))))
            est_round += t * inner[name]
        repeats = int(max(min_repeats, min(max_repeats, budget_s // max(est_round, 1e-9))))
        samples = {name: [] for name in names}
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, n = fns[name], inner[name]
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - start) / n)
    return {name: {**summary(samples[name]), "calls_per_sample": inner[name],
                   **({"samples_ms": [t * 1e3 for t in samples[name]]} if keep_samples else {})} for name in names}


def paired_ratio(times, base, impl):
    """Median over rounds of base time / impl time (> 1: impl is faster), from `time_interleaved(...,
    keep_samples=True)`. Both ran in every round, so a slow phase of the machine cancels out."""
    return statistics.median(_round_ratios(times, base, impl))


def _round_ratios(times, base, impl):
    return [b / i for b, i in zip(times[base]["samples_ms"], times[impl]["samples_ms"])]


def paired_ratio_interval(times, base, impl, confidence=0.95):
    """(low, high): a distribution-free confidence interval for the median of the per-round ratios
    of `paired_ratio`. The number of rounds whose ratio lies below the true median is
    Binomial(n, 1/2), so the order statistics r_(j) <= median <= r_(n+1-j) hold with probability
    1 - 2 P(X < j); j is the largest rank that keeps that at least `confidence`. With fewer than 6
    rounds no interval reaches 95%: it is then the whole range of the ratios."""
    ratios = sorted(_round_ratios(times, base, impl))
    n = len(ratios)
    below, j = 0.0, 0  # P(X < j + 1) accumulates; j + 1 stays a valid rank while the tails fit
    while j < n // 2:
        below += math.comb(n, j) / 2 ** n
        if 1 - 2 * below < confidence:
            break
        j += 1
    j = max(j, 1)
    return ratios[j - 1], ratios[n - j]


def _time_cuda(fns, rounds, keep_samples=False):
    from triton.testing import do_bench

    names = list(fns)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(do_bench(fns[name], warmup=25, rep=100, return_mode="median") / 1e3)
    return {name: {**summary(samples[name]), "calls_per_sample": "do_bench",
                   **({"samples_ms": [t * 1e3 for t in samples[name]]} if keep_samples else {})} for name in names}


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints a line to the stderr file descriptor at every profiler start and stop."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        sys.stderr.flush()
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_measuring_memory(fn, device):
    """Runs fn once; returns (seconds, peak bytes allocated above the level before the call or
    None if it cannot be measured, the call's result)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) - before, result
    if device.type != "cpu":
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, None, result
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
    try:
        events = prof.profiler.kineto_results.events()
        allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                             if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    except AttributeError:  # the profiler's internals moved: no measurement rather than a wrong one
        return seconds, None, result
    current = peak = 0
    for _, nbytes in allocations:
        current += nbytes
        peak = max(peak, current)
    return seconds, peak, result


def available_memory_bytes(device):
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 2**30


# --------------------------------------------------------------------------------------------
# Ceilings: what the hardware does at best, measured the same way
# --------------------------------------------------------------------------------------------
def measure_ceilings(device, dtype, quick=True):
    """Measured matrix-product FLOP/s (in `dtype` on CUDA, float32 on CPU) and copy bandwidth."""
    out = {}
    mm_dtype = dtype if device.type == "cuda" else torch.float32
    n = (8192 if device.type == "cuda" else (1024 if quick else 2048))
    a = torch.randn(n, n, device=device).to(mm_dtype)
    b = torch.randn(n, n, device=device).to(mm_dtype)
    c = torch.empty(n, n, device=device, dtype=mm_dtype)
    copy_bytes = (2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    fns = {"matmul": lambda: torch.mm(a, b, out=c), "copy": lambda: dst.copy_(src)}
    for fn in fns.values():
        fn()
    times = time_interleaved(fns, device, max_repeats=15, min_repeats=5, budget_s=1.0 if quick else 3.0,
                             min_sample_s=0.02)
    mm_s = times["matmul"]["min_ms"] / 1e3  # the best run is the ceiling
    copy_s = times["copy"]["min_ms"] / 1e3
    out["matmul"] = {"dtype": str(mm_dtype).replace("torch.", ""), "size": n, "flops_per_s": 2.0 * n**3 / mm_s}
    out["copy"] = {"bytes": copy_bytes, "bytes_per_s": 2.0 * copy_bytes / copy_s,
                   "note": "read + write bytes of a tensor copy"}
    return out


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------
def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device):
    info = {"type": device.type, "threads": torch.get_num_threads(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
        slug = "cuda-" + "".join(c if c.isalnum() else "-" for c in props.name.lower()).strip("-")
    else:
        info["name"] = info["cpu"]
        slug = device.type
    while "--" in slug:
        slug = slug.replace("--", "-")
    info["slug"] = slug
    return info


def versions():
    import numpy

    import transformer_fast

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "transformer_fast": transformer_fast.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - not installed or broken
        out["triton"] = None
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("TRANSFORMER_FAST_GIT_COMMIT"):  # a copy of the tree whose .git is not its own
        out["git_commit"] = os.environ["TRANSFORMER_FAST_GIT_COMMIT"]
        return out
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            out["git_commit"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out
