"""The `distributed` suite: context parallelism on the CPU, w gloo processes on this machine
(loopback), one thread each, against the one-process run.

For B=1 H=8 N=16384 D=64 float32 (``--seq-lens`` takes another N), forward (no grad) and
forward+backward (gradients of q, k, v for a random upstream gradient):

  ring head-tail causal    context_parallel_attention(mode="ring", layout="head_tail", is_causal=True)
  ring contiguous causal   the same on the contiguous layout (unbalanced: the last rank has the most work)
  ring non-causal          mode="ring", is_causal=False
  all-gather causal        mode="all_gather", head-tail
  ulysses causal           mode="ulysses", head-tail
  linear causal            context_parallel_linear_attention (state passing), contiguous

against the one-process ``scaled_dot_product_attention`` / ``linear_attention`` of the whole
sequence. Scaling efficiency = T(1 process) / (w x T(w processes)); T(w) is the wall time of
one distributed call, from the earliest rank's start to the latest rank's end after a barrier.

Method. Every process builds the whole problem from one seed and takes its shard. Before
timing, each implementation runs forward+backward once and every rank's output and gradients
are compared with the one-process run's (rank 0's, broadcast), which is itself checked against
the float64 row oracle on 12 rows (`cases.compare`); a wrong one is reported and not timed.
Timing: after one warm-up call each (measured for memory, below), rounds run every baseline and
every implementation once, each after a barrier: the baselines on rank 0 while the other ranks
wait in the next barrier (blocked in a socket read, not spinning), so a slow phase of the shared
machine hits both; times are medians over rounds, and the efficiency is the median over rounds
of each round's ratio. Memory per rank: the warm-up call under ``torch.profiler``
(``measure.run_measuring_memory``: the peak of torch's CPU allocations above the level before
the call) plus the rank's inputs, against the same for the one-process run. Bytes sent per rank:
every ``torch.distributed`` collective and point-to-point transfer the call makes is counted by
a wrapper installed in each process (ring all-gather sends (w-1) x its input, ring all-reduce
2(w-1)/w x the tensor, all-to-all (w-1)/w of its input, a send its tensor), the per-call
metadata check included, against the ideal: what must leave a rank for the others to compute
their rows. Profile per rank and call: time blocked in communication calls and in ``wait()`` of
point-to-point transfers; for a collective, the part before the last rank arrived is waiting
(load imbalance) and the rest transfer; the remainder of the call is compute.

Targets (w = 2): causal softmax with head-tail >= 0.85, non-causal >= 0.90, linear attention >= 0.90,
memory per rank <= 0.6x the one-process run.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_module
import statistics
import tempfile
import time
import traceback

import torch

CPU = torch.device("cpu")
WORLD = 2
# name: (kind, mode, layout, causal)
IMPLS = {
    "ring head-tail causal": ("softmax", "ring", "head_tail", True),
    "ring contiguous causal": ("softmax", "ring", "contiguous", True),
    "ring non-causal": ("softmax", "ring", "head_tail", False),
    "all-gather causal": ("softmax", "all_gather", "head_tail", True),
    "ulysses causal": ("softmax", "ulysses", "head_tail", True),
    "linear causal": ("linear", None, "contiguous", True),
}
EFFICIENCY_TARGETS = {"ring head-tail causal": 0.85, "ring non-causal": 0.90, "linear causal": 0.90}
MEMORY_TARGET = 0.6
PASSES = ("forward", "forward+backward")


# ------------------------------------------------------------------------------------------------
# Counting and timing the communication (installed in each process)
# ------------------------------------------------------------------------------------------------
class CommLog:
    """Wraps torch.distributed's collectives and batch_isend_irecv; while ``recording``, each
    call appends (name, enter, exit, bytes sent) and each point-to-point wait ("p2p wait", enter,
    exit, 0)."""

    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "reduce_scatter_single", "all_to_all_single", "all_to_all", "broadcast", "send", "recv")

    def __init__(self):
        self.events, self.recording = [], False

    def install(self):
        import torch.distributed as dist

        for name in self.COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        dist.batch_isend_irecv = self._wrap_p2p(dist.batch_isend_irecv)

    def _sent(self, name, args, kwargs):
        """Bytes this rank sends in the call, by the ring algorithms' volumes."""
        import torch.distributed as dist

        group = kwargs.get("group")
        w = dist.get_world_size(group)
        if name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):
            return (w - 1) * _nbytes(args[1])
        if name == "all_reduce":
            return 2 * (w - 1) * _nbytes(args[0]) // w
        if name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single"):
            return (w - 1) * _nbytes(args[1]) // w
        if name == "all_to_all":
            return sum(_nbytes(t) for t in args[1]) * (w - 1) // w
        if name == "send":
            return _nbytes(args[0])
        if name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            return (w - 1) * _nbytes(args[0]) if src == dist.get_rank(group) else 0
        return 0

    def _wrap(self, name, fn):
        log = self

        def wrapped(*args, **kwargs):
            if not log.recording:
                return fn(*args, **kwargs)
            sent = log._sent(name, args, kwargs)
            enter = time.perf_counter()
            out = fn(*args, **kwargs)
            log.events.append((name, enter, time.perf_counter(), sent))
            return out
        return wrapped

    def _wrap_p2p(self, fn):
        log = self
        import torch.distributed as dist

        def wrapped(ops):
            if not log.recording:
                return fn(ops)
            sent = sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)
            enter = time.perf_counter()
            works = fn(ops)
            log.events.append(("batch_isend_irecv", enter, time.perf_counter(), sent))
            return [_TimedWork(w, log) for w in works]
        return wrapped


class _TimedWork:
    def __init__(self, work, log):
        self._work, self._log = work, log

    def wait(self, *args, **kwargs):
        enter = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        if self._log.recording:
            self._log.events.append(("p2p wait", enter, time.perf_counter(), 0))
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _nbytes(t):
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# ------------------------------------------------------------------------------------------------
# The work of each process
# ------------------------------------------------------------------------------------------------
def _shard(x, rank, world, layout, dim=2):
    chunks = x.chunk(2 * world if layout == "head_tail" else world, dim)
    held = (rank, 2 * world - 1 - rank) if layout == "head_tail" else (rank,)
    return torch.cat([chunks[c] for c in held], dim)


def _one_process(kind, causal):
    import transformer_fast as tf

    if kind == "linear":
        return lambda q, k, v: tf.linear_attention(q, k, v, is_causal=causal)
    return lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _distributed(impl, group):
    kind, mode, layout, causal = IMPLS[impl]
    if kind == "linear":
        from transformer_fast.distributed.linear_attention import context_parallel_linear_attention

        return lambda q, k, v: context_parallel_linear_attention(q, k, v, group, layout=layout, is_causal=causal)
    from transformer_fast.distributed.attention import context_parallel_attention

    return lambda q, k, v: context_parallel_attention(q, k, v, group, mode=mode, layout=layout, is_causal=causal)


def _call(fn, inputs, backward, dout):
    """A callable running fn forward (no grad) or forward+backward (gradients of q, k, v)."""
    if not backward:
        def forward():
            with torch.no_grad():
                fn(*inputs)
        return forward
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def forward_backward():
        torch.autograd.grad(fn(*leaves), leaves, dout)
    return forward_backward


def _row_check(kind, causal, q, k, v, out):
    """The one-process output on 12 rows against the float64 oracle (cases.compare's bound)."""
    from transformer_fast import reference

    from . import cases

    rows = cases.check_rows(q.shape[2])

    def oracle(dtype):
        got = []
        for i in rows:
            end = i + 1 if causal else k.shape[2]
            qi, ki, vi = (t.to(dtype) for t in (q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end]))
            if kind == "linear":
                phi_q, phi_k = torch.nn.functional.elu(qi) + 1, torch.nn.functional.elu(ki) + 1
                scores = phi_q @ phi_k.transpose(2, 3)
                got.append((scores @ vi) / (scores.sum(-1, keepdim=True) + 1e-6))
            else:
                got.append(reference.scaled_dot_product_attention(qi, ki, vi))
        return [torch.cat(got, 2)]
    ok, err, bound, note = cases.compare([out[:, :, rows]], oracle(torch.float64), oracle(torch.float32),
                                         torch.float32, ["output"])
    return ok, err, bound, note


def _check(impl, group, rank, world, full, dout_full):
    """(ok, max error, bound, note): this rank's output and gradient shards against the one-process
    run's (rank 0's, broadcast), which rank 0 first checks against the float64 row oracle."""
    import torch.distributed as dist

    kind, _, layout, causal = IMPLS[impl]
    one = []
    if rank == 0:
        leaves = [t.clone().requires_grad_() for t in full]
        out = _one_process(kind, causal)(*leaves)
        one = [out.detach(), *torch.autograd.grad(out, leaves, dout_full)]
        ok, err, bound, note = _row_check(kind, causal, *full, one[0])
        verdict = torch.tensor([float(ok)])
    else:
        one = [torch.empty_like(full[0]) for _ in range(4)]
        verdict = torch.zeros(1)
    for t in (*one, verdict):
        dist.broadcast(t, 0, group=group)
    if not verdict.item():
        return False, float("inf"), 0.0, "the one-process run failed its float64 check"
    mine = [_shard(t, rank, world, layout) for t in full]
    leaves = [t.clone().requires_grad_() for t in mine]
    out = _distributed(impl, group)(*leaves)
    got = [out.detach(), *torch.autograd.grad(out, leaves, _shard(dout_full, rank, world, layout))]
    worst = (0.0, 0.0, 1.0)
    for name, g, ref in zip(("output", "dq", "dk", "dv"), got, one):
        ref = _shard(ref, rank, world, layout)
        err = (g - ref).abs().max().item()
        bound = 1e-4 * max(1.0, ref.abs().max().item())
        if not err <= bound:
            return False, err, bound, f"rank {rank} {name}: max error {err:.3g} against the one-process run > {bound:.3g}"
        worst = max(worst, (err / bound, err, bound))
    return True, worst[1], worst[2], ""


def _measure(rank, world, group, config):
    import torch.distributed as dist

    from . import measure

    log = CommLog()
    log.install()
    B, H, N, D, seed = config["B"], config["H"], config["N"], config["D"], config["seed"]
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, H, N, D, generator=g) for _ in range(3)]
    dout_full = torch.randn(B, H, N, D, generator=g)
    result = {"rank": rank, "checks": {}, "passes": {}}
    impls = []
    for impl in config["impls"]:
        ok, err, bound, note = _check(impl, group, rank, world, full, dout_full)
        result["checks"][impl] = {"ok": ok, "max_error": err, "error_bound": bound, "note": note}
        # every rank must agree on what to time: a rank whose check failed drops the implementation everywhere
        agreed = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if agreed.item():
            impls.append(impl)
    baselines = sorted({(IMPLS[i][0], IMPLS[i][3]) for i in impls})
    for pass_name in PASSES:
        backward = pass_name == "forward+backward"
        entries = []  # (key, callable or None on the ranks that wait, distributed?)
        for kind, causal in baselines:
            fn = _call(_one_process(kind, causal), full, backward, dout_full) if rank == 0 else None
            entries.append((f"one process {kind} {'causal' if causal else 'non-causal'}", fn, False))
        for impl in impls:
            layout = IMPLS[impl][2]
            mine = [_shard(t, rank, world, layout) for t in full]
            entries.append((impl, _call(_distributed(impl, group), mine, backward, _shard(dout_full, rank, world,
                                                                                           layout)), True))
        input_bytes = {key: (4 if backward else 3) * _nbytes(full[0]) // (world if dist_ else 1)
                       for key, _, dist_ in entries}
        row = {key: {"times": [], "profile": [], "input_bytes": input_bytes[key]} for key, _, _ in entries}
        for key, fn, _ in entries:  # warm-up, measured for memory
            dist.barrier(group=group)
            if fn is not None:
                _, peak, _ = measure.run_measuring_memory(fn, CPU)
                row[key]["peak_bytes"] = peak
        for r in range(config["repeats"]):
            shift = r % len(entries)
            for key, fn, distributed in entries[shift:] + entries[:shift]:
                dist.barrier(group=group)
                if fn is None:
                    continue
                log.events, log.recording = [], distributed
                start = time.perf_counter()
                fn()
                end = time.perf_counter()
                log.recording = False
                row[key]["times"].append((start, end))
                if distributed:
                    row[key]["profile"].append(list(log.events))
        result["passes"][pass_name] = row
    return result


def _worker(rank, world, init_file, timeout, config, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            results.put((rank, True, _measure(rank, world, dist.group.WORLD, config)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, False, traceback.format_exc()))


def _launch(world, config, timeout):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="transformer_fast-bench-"), "init")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, timeout, config, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got, failures = {}, []
        deadline = time.monotonic() + config["wall_limit_s"]
        while len(got) + len(failures) < world:
            try:
                rank, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue_module.Empty:
                break
            (got.__setitem__(rank, value) if ok else failures.append(f"rank {rank}:\n{value}"))
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if failures or len(got) < world:
            raise RuntimeError("distributed benchmark failed:\n" + ("\n".join(failures) or
                                                                     f"ranks {sorted(set(range(world)) - set(got))} "
                                                                     f"did not finish within the wall limit"))
        return [got[r] for r in range(world)]
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


# ------------------------------------------------------------------------------------------------
# Assembling the ranks' records
# ------------------------------------------------------------------------------------------------
def ideal_bytes(impl, B, H, N, D, world, backward):
    """What must leave one rank for the others to compute their rows (float32): softmax, its
    key/value shard to every other rank (and as much of dK/dV back with the backward); Ulysses,
    (w-1)/w of its q, k, v, out (twice with the backward); linear attention, its chunk states to
    every other rank (and their gradients back)."""
    kind, mode, layout, _ = IMPLS[impl]
    n, item = N // world, 4
    if kind == "linear":
        chunks = 2 if layout == "head_tail" else 1
        sent = (world - 1) * chunks * B * H * D * (D + 1) * item
    elif mode == "ulysses":
        sent = 4 * B * H * n * D * item * (world - 1) // world
    else:
        sent = (world - 1) * 2 * B * H * n * D * item
    return 2 * sent if backward else sent


def _profile(calls_by_rank):
    """Per rank: mean over timed calls of (compute, transfer, waiting) in ms."""
    world = len(calls_by_rank)
    out = [{"compute_ms": 0.0, "transfer_ms": 0.0, "waiting_ms": 0.0, "p2p_wait_ms": 0.0} for _ in range(world)]
    count = min(len(c) for c in calls_by_rank)
    for i in range(count):
        per_rank = [calls_by_rank[r][i] for r in range(world)]  # (start, end, events)
        collectives = [[e for e in events if e[0] != "p2p wait" and e[0] != "batch_isend_irecv"]
                       for _, _, events in per_rank]
        aligned = min(len(c) for c in collectives)
        for r, (start, end, events) in enumerate(per_rank):
            blocked = 0.0
            for j in range(aligned):
                enter, leave = collectives[r][j][1], collectives[r][j][2]
                last = max(collectives[s][j][1] for s in range(world))
                wait = min(max(last - enter, 0.0), leave - enter)
                out[r]["waiting_ms"] += wait * 1e3 / count
                out[r]["transfer_ms"] += (leave - enter - wait) * 1e3 / count
                blocked += leave - enter
            for e in events:
                if e[0] in ("p2p wait", "batch_isend_irecv"):
                    out[r]["p2p_wait_ms"] += (e[2] - e[1]) * 1e3 / count
                    blocked += e[2] - e[1]
            out[r]["compute_ms"] += (end - start - blocked) * 1e3 / count
    return out


def _assemble(ranks, config):
    B, H, N, D, world = config["B"], config["H"], config["N"], config["D"], config["world"]
    body = {"shape": f"B={B} H={H} N={N} D={D} float32", "world": world, "threads_per_rank": 1,
            "targets": {"efficiency": EFFICIENCY_TARGETS, "memory_ratio": MEMORY_TARGET}, "checks": {}, "rows": []}
    for impl in config["impls"]:
        checks = [r["checks"][impl] for r in ranks]
        bad = [c for c in checks if c["ok"] is False]
        na = [c for c in checks if c["ok"] is None]
        body["checks"][impl] = {"ok": not bad and not na, "max_error": max((c["max_error"] or 0) for c in checks),
                                "error_bound": min((c["error_bound"] or 0) for c in checks),
                                "note": "; ".join(c["note"] for c in bad + na if c["note"])}
    for pass_name in PASSES:
        rows0 = ranks[0]["passes"][pass_name]
        for impl in config["impls"]:
            if impl not in rows0:
                body["rows"].append({"impl": impl, "pass": pass_name, "status": "wrong" if not body["checks"][impl][
                    "note"].startswith("n/a") else "n/a", "note": body["checks"][impl]["note"]})
                continue
            kind, _, _, causal = IMPLS[impl]
            base_key = f"one process {kind} {'causal' if causal else 'non-causal'}"
            base = [e - s for s, e in rows0[base_key]["times"]]
            steps = [max(r["passes"][pass_name][impl]["times"][i][1] for r in ranks)
                     - min(r["passes"][pass_name][impl]["times"][i][0] for r in ranks) for i in range(len(base))]
            ratios = [b / (world * s) for b, s in zip(base, steps)]
            one_memory = rows0[base_key]["peak_bytes"]
            memory = [r["passes"][pass_name][impl].get("peak_bytes") for r in ranks]
            inputs_one, inputs_rank = rows0[base_key]["input_bytes"], rows0[impl]["input_bytes"]
            per_rank_total = [None if m is None else m + inputs_rank for m in memory]
            one_total = None if one_memory is None else one_memory + inputs_one
            memory_ratio = (max(per_rank_total) / one_total) if one_total and None not in per_rank_total else None
            sent = [statistics.median(sum(e[3] for e in events) for events in r["passes"][pass_name][impl]["profile"])
                    for r in ranks]
            ideal = ideal_bytes(impl, B, H, N, D, world, pass_name != "forward")
            efficiency = statistics.median(ratios)
            target = EFFICIENCY_TARGETS.get(impl)
            body["rows"].append({
                "impl": impl, "pass": pass_name, "status": "ok", "one_process_ms": statistics.median(base) * 1e3,
                "distributed_ms": statistics.median(steps) * 1e3, "rounds": len(steps), "efficiency": efficiency,
                "efficiency_target": target, "efficiency_met": None if target is None else efficiency >= target,
                "one_process_memory_bytes": one_total, "memory_per_rank_bytes": per_rank_total,
                "memory_ratio": memory_ratio,
                "memory_met": None if memory_ratio is None else memory_ratio <= MEMORY_TARGET,
                "bytes_sent_per_rank": sent, "ideal_bytes_per_rank": ideal,
                "profile_per_rank": _profile([[(*t, ev) for t, ev in zip(r["passes"][pass_name][impl]["times"],
                                                                         r["passes"][pass_name][impl]["profile"])]
                                              for r in ranks]),
            })
    return body


def run(args):
    if args.smoke:
        B, H, N, D = 1, 2, 64, 16
    else:
        B, H, D = 1, args.heads or 8, args.head_dim or 64
        N = args.seq_lens[0] if args.seq_lens else 16384
    config = {"B": B, "H": H, "N": N, "D": D, "seed": args.seed, "world": WORLD, "impls": list(IMPLS),
              "repeats": max(2, min(args.repeats, 3 if not args.smoke else 2)), "wall_limit_s": 3600.0}
    start = time.perf_counter()
    ranks = _launch(WORLD, config, timeout=1800.0)
    body = _assemble(ranks, config)
    body["wall_time_s"] = time.perf_counter() - start
    for impl, c in body["checks"].items():
        print(f"  check {impl:<24} {'ok' if c['ok'] else c['note']}", flush=True)
    for row in body["rows"]:
        if row["status"] != "ok":
            continue
        print(f"  {row['pass']:<17} {row['impl']:<24} one process {row['one_process_ms']:9.1f} ms, "
              f"w={WORLD} {row['distributed_ms']:9.1f} ms, efficiency {row['efficiency']:.2f}"
              + (f" (target {row['efficiency_target']:.2f})" if row["efficiency_target"] else "")
              + (f", memory {row['memory_ratio']:.2f}x" if row["memory_ratio"] else ""), flush=True)
    return body


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    w = body["world"]
    lines += [f"Context parallelism on the CPU: {w} gloo processes (loopback), one thread each, against the "
              f"one-process run; {body['shape']}. Efficiency = T(1) / ({w} x T({w})), the median over rounds; "
              f"targets: " + ", ".join(f"{k} >= {v:.2f}" for k, v in body["targets"]["efficiency"].items())
              + f"; memory per rank <= {body['targets']['memory_ratio']:.1f}x the one-process run.", ""]
    lines += ["| implementation | check (error / bound vs one process) |", "|---|---|"]
    lines += [f"| {k} | " + (f"ok ({c['max_error']:.1e} / {c['error_bound']:.1e})" if c["ok"] else c["note"]) + " |"
              for k, c in body["checks"].items()]
    lines += ["", "| pass | implementation | 1 process ms | w ms | efficiency | memory per rank MiB (1 process) "
                  "| ratio | sent per rank MiB (ideal) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in body["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['pass']} | {row['impl']} | {row['status']}: {row['note']} | | | | | |")
            continue
        eff = f"{row['efficiency']:.2f}"
        if row["efficiency_target"] is not None:
            eff += " (met)" if row["efficiency_met"] else f" (missed {row['efficiency_target']:.2f})"
        ratio = "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}" + (
            "" if row["memory_met"] else " (missed)")
        lines.append(f"| {row['pass']} | {row['impl']} | {row['one_process_ms']:.1f} | {row['distributed_ms']:.1f} | "
                     f"{eff} | {' / '.join(_mib(m) for m in row['memory_per_rank_bytes'])} "
                     f"({_mib(row['one_process_memory_bytes'])}) | {ratio} | "
                     f"{' / '.join(_mib(s) for s in row['bytes_sent_per_rank'])} ({_mib(row['ideal_bytes_per_rank'])}) |")
    lines += ["", "Profile per rank (mean ms per call): compute / transfer / waiting for the last rank at a "
                  "collective / blocked in point-to-point waits.", "",
              "| pass | implementation | " + " | ".join(f"rank {r}" for r in range(w)) + " |",
              "|---|---|" + "---|" * w]
    for row in body["rows"]:
        if row["status"] == "ok":
            cells = [f"{p['compute_ms']:.1f} / {p['transfer_ms']:.1f} / {p['waiting_ms']:.1f} / {p['p2p_wait_ms']:.1f}"
                     for p in row["profile_per_rank"]]
            lines.append(f"| {row['pass']} | {row['impl']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
