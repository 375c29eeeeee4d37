"""Per-call CPU time of small calls, this tree against another checkout of the package (built, with
its `transformer_fast/kernels` link), in alternating processes: the public functions on the host
suite's tiny tensors, and decoding attention (one query row per head, GQA) from a short and a
long cache. Prints each case's median over processes of the per-process medians, after/before, and
torch's own call (timed in the same processes) for scale.

    python -m benchmarks.tools.host_before_after_cpu --before /tmp/old [--processes 5]

Each process times its cases round-robin (`measure.time_interleaved`), one thread, with the
benchmark harness's malloc settings (`benchmarks/run.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _cases(tf, torch):
    """{name: (ours, torch's)}."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((8, 64), (64,), (64,)))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    q = torch.randn(1, 2, 8, 16, generator=g)
    qg = q.clone().requires_grad_()
    cases = {}
    for lib, norm, attention in (("ours", tf.layer_norm, tf.scaled_dot_product_attention),
                                 ("torch", F.layer_norm, F.scaled_dot_product_attention)):
        cases[f"layer_norm 8x64, forward without grad [{lib}]"] = lambda norm=norm: norm(x, (64,), w, b)
        cases[f"layer_norm 8x64, forward+backward [{lib}]"] = lambda norm=norm: torch.autograd.grad(
            (norm(leaves[0], (64,), leaves[1], leaves[2]),), leaves, (x,))
        cases[f"attention B=1 H=2 N=8 D=16, forward without grad [{lib}]"] = lambda a=attention: a(q, q, q)
        cases[f"attention B=1 H=2 N=8 D=16, forward+backward [{lib}]"] = lambda a=attention: torch.autograd.grad(
            (a(qg, qg, qg),), [qg], (q,))
    for dtype in (torch.bfloat16, torch.float32):
        for keys in (33, 288):
            dq = torch.randn(1, 1, 8, 64, generator=g).to(dtype).transpose(1, 2)  # as a projection makes it
            k, v = (torch.randn(1, 2, keys, 64, generator=g).to(dtype) for _ in range(2))
            name = f"decoding {str(dtype)[6:]}, 8 heads on 2 key heads, D=64, {keys} keys"
            for lib, attention in (("ours", tf.scaled_dot_product_attention), ("torch", F.scaled_dot_product_attention)):
                cases[f"{name} [{lib}]"] = lambda a=attention, dq=dq, k=k, v=v: a(dq, k, v, enable_gqa=True)
    return cases


def _child(tree):
    import torch

    from benchmarks import measure

    sys.path.insert(0, tree)
    import transformer_fast as tf

    if not tf.__file__.startswith(os.path.abspath(tree)):
        raise SystemExit(f"transformer_fast came from {tf.__file__}, not from {tree}")
    torch.set_num_threads(1)
    cases = _cases(tf, torch)
    with torch.no_grad():
        inference = {name: fn for name, fn in cases.items() if "backward" not in name}
        times = measure.time_interleaved(inference, torch.device("cpu"), min_repeats=7, max_repeats=7)
    training = {name: fn for name, fn in cases.items() if "backward" in name}
    times.update(measure.time_interleaved(training, torch.device("cpu"), min_repeats=7, max_repeats=7))
    print(json.dumps({name: t["median_ms"] * 1e3 for name, t in times.items()}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the other checkout (built)")
    parser.add_argument("--processes", type=int, default=5, help="processes per tree, alternating")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
    if not args.before:
        parser.error("--before is required")
    env = {**os.environ, **MALLOC}
    runs = {"before": [], "after": []}
    for _ in range(args.processes):
        for tag, tree in (("before", args.before), ("after", REPO)):
            out = subprocess.run([sys.executable, "-m", "benchmarks.tools.host_before_after_cpu", "--child", tree],
                                 cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
            runs[tag].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'case':<62} {'before us':>10} {'after us':>9} {'after/before':>13} {'torch us':>9}")
    for name in (n[:-len(" [ours]")] for n in runs["after"][0] if n.endswith("[ours]")):
        before, after = (statistics.median(r[f"{name} [ours]"] for r in runs[tag]) for tag in ("before", "after"))
        torch_us = statistics.median(r[f"{name} [torch]"] for tag in runs for r in runs[tag])
        print(f"{name:<62} {before:10.2f} {after:9.2f} {after / before:13.2f} {torch_us:9.2f}")


if __name__ == "__main__":
    main()
