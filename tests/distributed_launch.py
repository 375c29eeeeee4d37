"""Runs a test body on several gloo (or NCCL) processes on this machine (loopback only), every wait bounded.

    def body(rank, world_size, group, *args):   # a module-level function (spawn pickles it by name)
        ...                                       # assert freely: a failure on any rank fails the test
        return something_picklable                # collected per rank

    results = run_ranks(body, world_size=2, args=(...,))   # [rank 0's result, rank 1's, ...]

Each rank is a fresh spawned process with one intra-op thread and ``TRITON_INTERPRET``/
``TRANSFORMER_FAST_POISON`` as in the test process. The process group is initialised from a file
(no port to race for) with ``timeout``; a rank that raises sends its traceback back, and
``run_ranks`` raises ``AssertionError`` with it. A rank that hangs is killed when ``timeout`` runs
out, and the test fails saying so.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 120.0


def _worker(rank, world_size, init_file, timeout, fn, args, queue, backend):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, dist.group.WORLD, *args)
            queue.put((rank, True, result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, args=(), timeout=DEFAULT_TIMEOUT, backend="gloo"):
    """fn(rank, world_size, group, *args) on world_size processes; their results by rank. backend
    "nccl" gives rank r the GPU cuda:r (the caller checks there are world_size GPUs)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="transformer_fast-dist-")
    init_file = os.path.join(folder, "init")
    env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, timeout, fn, args, queue, backend),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, failures = {}, []
        deadline = timeout + 60.0  # spawning and importing torch in each process, on top of the group's timeout
        import queue as queue_module
        import time
        start = time.monotonic()
        while len(results) + len(failures) < world_size:
            left = deadline - (time.monotonic() - start)
            try:
                rank, ok, value = queue.get(timeout=max(left, 0.1))
            except queue_module.Empty:
                break
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if failures:
            raise AssertionError("\n".join(failures))
        missing = sorted(set(range(world_size)) - set(results))
        if missing:
            raise AssertionError(f"ranks {missing} neither finished nor failed within {deadline:.0f} s "
                                 f"(exit codes {[p.exitcode for p in procs]})")
        return [results[r] for r in range(world_size)]
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
