"""The `gpu` suite: everything a run on a CUDA machine should do, in one command.

    pip install --no-deps --no-build-isolation -e .     # once; builds the C++ extension (CUDA kernels included)
    python -m benchmarks.run --only gpu                  # then: check, test, benchmark, record

Steps (`--gpu-steps`, default all three):

  install     the package imports from this checkout; CUDA is available; which backends work and
              why not; one small call of every kernel family on the GPU against the float64
              reference
  tests       `pytest -m gpu tests` (pytest-xdist workers where it is installed; `--test-workers`),
              within `--test-timeout` seconds; `--test-selection EXPR` passes `-k EXPR` (a short run
              can leave out the full grids: "not full_grid")
  benchmarks  the sweep (attention, layer_norm, train_step) on the GPU, target_gpu_attention,
              target_gpu_varlen (packed sequences, split decoding, sliding windows), models (the whole
              models on the GPU, bf16 autocast) and host (the CPU host cost per call)

Each benchmark writes its own result files; this suite writes <device>-gpu-<date>.json and .md
(the install check and the test summary) into --out, then rewrites the results index
(`benchmarks/results/INDEX.md`) when --out is the default results folder.
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "pip install --no-deps --no-build-isolation -e ."


def install_check():
    """What is installed and whether each kernel family gives the reference's result on the GPU."""
    import torch

    import transformer_fast as tf

    from . import measure

    out = {"package": os.path.dirname(os.path.abspath(tf.__file__)), "versions": measure.versions(),
           "cuda_available": torch.cuda.is_available(), "backends": tf.available_backends(), "problems": []}
    if not out["package"].startswith(REPO_ROOT):
        out["problems"].append(f"transformer_fast is imported from {out['package']}, not from this checkout: "
                               f"run `{INSTALL}` here")
    if not torch.cuda.is_available():
        out["problems"].append(f"CUDA is not available to torch {torch.__version__}")
        return out
    out["device"] = measure.device_info(torch.device("cuda"))
    try:
        from transformer_fast import _build

        out["cpp_cuda_families"] = list(_build.extension().cuda_families())
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: Triton is the GPU path
        out["cpp_cuda_families"] = f"unavailable: {exc}"
    out["checks"] = family_checks(torch.device("cuda"))
    out["problems"] += [f"{name}: error {c['error']:.2e} > {c['bound']:.2e} (2x the same-dtype reference's)"
                        for name, c in out["checks"].items() if not c["ok"]]
    return out


def family_checks(device):
    """{"<family> <dtype>": {error, bound, ok}}: one small call of every kernel family on `device`
    (the backend `auto` picks there) against float64, bound by 2x the same-dtype reference's error."""
    import torch

    import transformer_fast as tf
    from transformer_fast import reference

    g = torch.Generator(device=device).manual_seed(0)
    checks = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(2, 4, 37, 40, device=device, dtype=dtype, generator=g) for _ in range(3))
        x, r = (torch.randn(37, 96, device=device, dtype=dtype, generator=g) for _ in range(2))
        w, b = (torch.randn(96, device=device, dtype=dtype, generator=g) for _ in range(2))
        name = str(dtype).replace("torch.", "")
        attention = (lambda *t: tf.scaled_dot_product_attention(*t, is_causal=True),
                     lambda *t: reference.scaled_dot_product_attention(*t, is_causal=True))
        linear = (lambda *t: tf.linear_attention(*t, is_causal=True),
                  lambda *t: reference.linear_attention(*t, is_causal=True))
        for family, (ours, ref) in (("attention", attention), ("linear_attention", linear)):
            checks[f"{family} {name}"] = _check(ours(q, k, v), ref(q.double(), k.double(), v.double()), ref(q, k, v))
        norm = (lambda *t: tf.layer_norm(t[0], (96,), t[1], t[2], residual=t[3])[0],
                lambda *t: reference.layer_norm(t[0], (96,), t[1], t[2], residual=t[3])[0])
        checks[f"layer_norm {name}"] = _check(norm[0](x, w, b, r), norm[1](*(t.double() for t in (x, w, b, r))),
                                              norm[1](x, w, b, r))
    return checks


def _check(ours, exact, plain):
    err = (ours.double() - exact).abs().max().item()
    bound = 2 * (plain.double() - exact).abs().max().item() + 1e-6 * max(1.0, exact.abs().max().item())
    return {"error": err, "bound": bound, "ok": err <= bound}


def run_gpu_tests(workers, timeout, selection=None):
    """`pytest -m gpu tests` (`-k selection` where given): its exit status, the summary line and the
    failed tests."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider"]
    if selection:
        cmd += ["-k", selection]
    try:
        import xdist  # noqa: F401

        workers = 8 if workers is None else workers
    except ImportError:
        workers = 0
    if workers:
        cmd += ["-n", str(workers)]
    print("  " + " ".join(cmd[2:]), flush=True)
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        text, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = "timeout"
    lines = text.splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "no summary")
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    print(f"  {summary} (exit {status}, {time.time() - start:.0f} s)", flush=True)
    for ln in failed[:40]:
        print("  " + ln, flush=True)
    return {"command": " ".join(cmd[2:]), "exit_status": status, "summary": summary.strip("= "), "failed": failed,
            "seconds": time.time() - start}


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    install = result.get("install")
    if install:
        lines += ["## Install check", "", f"- package: `{install['package']}`",
                  f"- backends: " + ", ".join(f"{k}: {'ok' if v is None else v}" for k, v in install["backends"].items()),
                  f"- C++ CUDA kernels: {install.get('cpp_cuda_families')}"]
        lines += [f"- {name}: error {c['error']:.1e} (bound {c['bound']:.1e}){'' if c['ok'] else ' WRONG'}"
                  for name, c in install.get("checks", {}).items()]
        lines += [f"- PROBLEM: {p}" for p in install["problems"]]
    tests = result.get("tests")
    if tests:
        lines += ["", "## gpu tests", "", f"`{tests['command']}`: {tests['summary']} (exit {tests['exit_status']}, "
                  f"{tests['seconds']:.0f} s)", ""] + [f"- {ln}" for ln in tests["failed"]]
    if result.get("benchmarks"):
        lines += ["", "## Benchmarks", ""] + [f"- {name}: exit {rc}" for name, rc in result["benchmarks"].items()]
    return "\n".join(lines) + "\n"


def run(args):
    from . import measure, report
    from . import run as bench_run

    import torch

    start = time.time()
    steps = [s for s in args.gpu_steps.split(",") if s]
    unknown = set(steps) - {"install", "tests", "benchmarks"}
    if unknown:
        raise SystemExit(f"--gpu-steps: unknown step(s) {sorted(unknown)}; expected install, tests, benchmarks")
    result = {"schema_version": 1, "suite": "gpu", "smoke": args.smoke,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable)] + list(getattr(sys, "orig_argv", sys.argv))[1:]),
              "versions": measure.versions(), "benchmarks": {}}
    status = 0
    if "install" in steps:
        print("== install check", flush=True)
        result["install"] = install_check()
        for problem in result["install"]["problems"]:
            print(f"  PROBLEM: {problem}", flush=True)
        if not result["install"]["problems"]:
            print("  ok: " + ", ".join(result["install"]["checks"]), flush=True)
        status = 1 if result["install"]["problems"] else 0
    if not torch.cuda.is_available():
        print(f"gpu suite: no CUDA GPU here (torch {torch.__version__}); nothing more to run", file=sys.stderr)
        return 1
    result["device"] = measure.device_info(torch.device("cuda"))
    if "tests" in steps:
        print("== gpu tests", flush=True)
        result["tests"] = run_gpu_tests(args.test_workers, args.test_timeout, args.test_selection)
        status = max(status, 0 if result["tests"]["exit_status"] == 0 else 1)
    if "benchmarks" in steps:
        print("== benchmarks", flush=True)
        sweep_args = bench_run.parse_args(_forwarded(args, ["--device", "cuda", "--no-progress"]))
        result["benchmarks"]["sweep"] = bench_run.run_sweep(sweep_args)
        result["benchmarks"]["target_gpu_attention"] = bench_run.run_target("target_gpu_attention", args)
        result["benchmarks"]["target_gpu_varlen"] = bench_run.run_target("target_gpu_varlen", args)
        args.device = "cuda"
        result["benchmarks"]["models"] = bench_run.run_target("models", args)
        result["benchmarks"]["host"] = bench_run.run_target("host", args)
        status = max(status, *result["benchmarks"].values())
    result["wall_time_s"] = time.time() - start
    stem = f"{args.name}-gpu" if args.name else \
        f"{result['device']['slug']}-gpu-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M')}"
    paths = report.write_suite(result, args.out, stem, markdown)
    if os.path.abspath(args.out) == os.path.abspath(bench_run.DEFAULT_OUT):
        paths.append(report.write_index(args.out))
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths), flush=True)
    return status


def _forwarded(args, extra):
    """The sweep's command line: the options given to this run that the sweep shares."""
    argv = list(extra) + ["--out", args.out]
    for flag in ("smoke", "full", "no_plots", "strict"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    if args.name:
        argv += ["--name", f"{args.name}-sweep"]
    return argv
