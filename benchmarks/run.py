"""The transformer_fast benchmark: one command, whatever the device, for every suite.

    python -m benchmarks.run                                   # the sweep: the GPU if there is one, else the CPU
    python -m benchmarks.run --full                            # the long sweep (up to 16k tokens on CPU, 64k on GPU)
    python -m benchmarks.run --only attention --seq-lens 512 1024 --causal yes
    python -m benchmarks.run --only target_cpu_attention,target_cpu_layer_norm
    python -m benchmarks.run --only gpu                        # everything a GPU run does, in one command

Suites (--only, comma- or space-separated; the default is the sweep's three families):
{suites}

The sweep times, for each sequence length, naive reference attention, torch's SDPA, our softmax
and linear attention and a plain PyTorch linear attention (causal and not, forward and
forward+backward), LayerNorm (ours vs torch, with and without the fused residual) and one
training step of an encoder-decoder (ours vs torch.nn.Transformer). Every implementation is
checked against a float64 oracle before it is timed (a wrong one is reported, never timed).
Results: a table on stdout and, in --out (default benchmarks/results/), <device>-<suite>-<date>.json
and .md (and PNG plots for the sweep); `python -m benchmarks.report` then rewrites the results
index and the README's tables from them. See benchmarks/README.md for the method.

On Linux the process re-executes itself with MALLOC_MMAP_MAX_=0 and MALLOC_TRIM_THRESHOLD_=1 GiB
(unless set already): glibc would otherwise serve every tensor >= 32 MiB from a fresh memory
map, and the page faults of touching it would be timed instead of the kernel.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import time

_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**30)}
# How the Triton kernels are launched (kernels/_launch.py), recorded with each result
_LAUNCH_ENV = ("TRANSFORMER_FAST_DIRECT_LAUNCH", "TRANSFORMER_FAST_NATIVE_LAUNCH")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results")

# Sequence lengths: (quick, full) per device type.
SEQ_LENS = {"cpu": ([128, 256, 512, 1024, 2048], [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
            "cuda": ([1024, 2048, 4096, 8192, 16384], [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])}
TRAIN_SEQ_LENS = {"cpu": ([64, 128, 256, 512], [64, 128, 256, 512, 1024, 2048]),
                  "cuda": ([512, 1024, 2048, 4096], [512, 1024, 2048, 4096, 8192])}

# The suites that write a result file of their own (run_target): name -> ("module.function", what it
# measures). The function takes the parsed arguments and returns the result's body; the module's
# markdown(result) writes its record. A new suite is one line here.
TARGETS = {
    "target_cpu_attention": ("targets.attention",
                             "C++ attention against F.sdpa, fp32 and bf16, N=2048: the CPU attention target"),
    "target_cpu_layer_norm": ("targets.layer_norm",
                              "fused residual + LayerNorm against torch, 4096 x 1024, and GB/s against a copy"),
    "target_cpu_linear_attention": ("targets.linear_attention",
                                    "C++ causal linear attention against PyTorch ones, N=4096; memory; crossover"),
    "linear_state": ("linear_state.run",
                     "C++ causal linear attention prefill with a carried state against without one, N=4096"),
    "target_gpu_attention": ("target_gpu.run",
                             "Triton attention against torch's SDPA (its own backend choice), bf16/fp16 grid (GPU)"),
    "varlen": ("varlen.run",
               "C++ attention on a pack of unequal sequences, a 512-key window at 16k and a decoding step (CPU)"),
    "target_gpu_varlen": ("target_gpu_varlen.run",
                          "Triton varlen (vs torch varlen_attn), split decoding at 32k, a 4k window at 32k (GPU)"),
    "host": ("host.run", "host cost per call of each public function on tiny tensors, one thread, against torch's"),
    "models": ("models.run",
               "BERT encoder, Llama-like decoder (training, generate), encoder-decoder: ours against the sdpa model"),
    "distributed": ("distributed.run",
                    "context parallelism, 2 gloo processes x 1 thread, N=16k: efficiency, memory, bytes per rank"),
}
SUITES = {
    "attention": "sweep over N: naive, torch SDPA, ours softmax and linear, PyTorch linear attention",
    "layer_norm": "sweep over N: LayerNorm, ours (fused residual) against torch",
    "train_step": "sweep over N: one training step of our encoder-decoder against nn.Transformer",
    **{name: text for name, (_, text) in TARGETS.items()},
    "gpu": "install check, the gpu-marked tests, the sweep, target_gpu_attention and _varlen on the GPU, results index",
}
__doc__ = __doc__.format(suites="\n".join(f"  {name:<28} {text}" for name, text in SUITES.items()))
# --smoke: sizes small enough to check that a suite runs end to end in seconds (not measurements)
SMOKE = {"seq_lens": [16, 32], "batch": 1, "heads": 2, "head_dim": 16, "repeats": 2, "min_repeats": 2, "budget": 0.0,
         "min_sample_ms": 0.0, "train_seq_lens": [8], "train_d_model": 16, "train_heads": 2, "train_layers": 1,
         "train_vocab": 11}


def _reexec_with_malloc_settings():
    """Re-runs this command with the malloc settings above (Linux/glibc only; once)."""
    if not sys.platform.startswith("linux") or os.environ.get("TRANSFORMER_FAST_BENCH_NO_REEXEC") == "1":
        return
    missing = {k: v for k, v in _MALLOC_ENV.items() if k not in os.environ}
    if not missing:
        return
    env = dict(os.environ, **missing, TRANSFORMER_FAST_BENCH_NO_REEXEC="1")
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError as exc:  # carry on without: the timings are then noisier, say so
        print(f"benchmark: could not re-execute with {missing} ({exc}); large outputs may page-fault",
              file=sys.stderr)


def parse_args(argv=None):
    from . import cases

    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                epilog="suites:\n" + "\n".join(f"  {n:<28} {t}" for n, t in SUITES.items()),
                                formatter_class=_HelpFormatter)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="sequence lengths (default: the quick set)")
    p.add_argument("--full", action="store_true", help="the long sweep (up to 16k on CPU, 64k on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 1 on CPU, 4 on CUDA)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 8 on CPU, 16 on CUDA)")
    p.add_argument("--head-dim", type=int, default=64, help="attention head dim")
    p.add_argument("--causal", nargs="?", const="yes", default="both", choices=["both", "yes", "no"],
                   help="causal attention, non-causal, or both (--causal alone: causal only)")
    p.add_argument("--passes", nargs="+", default=list(cases.PASSES), choices=list(cases.PASSES),
                   help="forward only and/or forward+backward")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help=f"suites (listed below; comma- or space-separated), or within the sweep implementations "
                        f"({', '.join(sorted({i for f in cases.IMPLS.values() for i in f}))}) or family:impl")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and no timing budget: checks that the suites run (the numbers mean nothing)")
    p.add_argument("--ln-width", type=int, default=None, help="LayerNorm width (default heads x head-dim)")
    p.add_argument("--train-seq-lens", type=int, nargs="+", default=None, help="training-step lengths")
    p.add_argument("--train-d-model", type=int, default=256, help="training step: model width")
    p.add_argument("--train-heads", type=int, default=4, help="training step: heads")
    p.add_argument("--train-layers", type=int, default=2, help="training step: encoder and decoder layers (each)")
    p.add_argument("--train-vocab", type=int, default=1000, help="training step: vocabulary size")
    p.add_argument("--repeats", type=int, default=25, help="most timed repeats per implementation")
    p.add_argument("--min-repeats", type=int, default=5, help="fewest timed repeats (even over budget)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed repeats per case (default 1.5 quick, 8 --full)")
    p.add_argument("--min-sample-ms", type=float, default=10.0,
                   help="CPU: a sample repeats a call until it lasts this long")
    p.add_argument("--max-call-seconds", type=float, default=None,
                   help="skip an implementation at lengths where one call is predicted to take longer "
                        "(default 3 quick, 60 --full)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="skip an implementation whose estimated peak exceeds this (default: half the "
                        "available RAM on CPU, 90%% of free GPU memory)")
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument("--name", default=None, help="output file stem (default <device>-<date>)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--attention-backend", default="triton", choices=["triton", "cpp"],
                   help="target_gpu_attention: ours is the Triton kernels or the C++ backend's CUDA kernels")
    p.add_argument("--model-families", type=lambda text: [t for t in text.split(",") if t],
                   default=["bert", "llama", "encdec"], help="models: which model families to run (comma-separated)")
    p.add_argument("--sdpa-backend", default="default", choices=["default", "flash", "cudnn", "efficient"],
                   help="target_gpu_attention: torch's SDPA as it chooses, or one backend pinned")
    p.add_argument("--gpu-rounds", type=int, default=5, help="target_gpu_attention: interleaved do_bench rounds")
    p.add_argument("--gpu-steps", default="install,tests,benchmarks",
                   help="gpu: which of install (the install check), tests, benchmarks to run")
    p.add_argument("--test-workers", type=int, default=None,
                   help="gpu: pytest-xdist workers for the gpu tests (default: 8 where pytest-xdist is installed)")
    p.add_argument("--test-selection", default=None, metavar="EXPR", help="gpu: pytest -k EXPR for the gpu tests")
    p.add_argument("--test-timeout", type=float, default=3600, help="gpu: seconds the gpu tests may take")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines (in a log)")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 if an implementation fails its check or raises")
    args = p.parse_args(argv)

    # --only: a suite name selects the suite; an implementation name filters the sweep's implementations
    # (and, when no family is named, selects the families that have it); family:impl does both.
    tokens = [t for item in args.only or [] for t in item.split(",") if t]
    named, scoped, by_impl, impls = set(), set(), set(), {f: [] for f in cases.FAMILIES}
    args.targets, args.gpu = [], False
    for token in tokens:
        family, _, impl = token.partition(":")
        if token == "gpu":
            args.gpu = True
        elif token in TARGETS:
            args.targets.append(token)
        elif family in cases.IMPLS and not impl:
            named.add(family)
        elif family in cases.IMPLS and impl in cases.IMPLS[family]:
            scoped.add(family)
            impls[family].append(impl)
        elif not impl and any(token in f for f in cases.IMPLS.values()):
            for f, names in cases.IMPLS.items():
                if token in names:
                    impls[f].append(token)
                    by_impl.add(f)
        else:
            p.error(f"--only: unknown name {token!r} (suites: {', '.join(SUITES)})")
    families = named | scoped | (set() if named else by_impl) if tokens else set(cases.FAMILIES)
    args.families = [f for f in cases.FAMILIES if f in families]
    args.impls = {f: impls[f] or list(cases.IMPLS[f]) for f in cases.FAMILIES}
    if args.smoke:
        for name, value in SMOKE.items():
            if getattr(args, name) in (None, p.get_default(name)):
                setattr(args, name, value)
    for name in ("batch", "heads", "head_dim", "repeats", "min_repeats", "train_d_model", "train_heads",
                 "train_layers", "train_vocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    unknown = set(args.model_families) - {"bert", "llama", "encdec"}
    if unknown:
        p.error(f"--model-families: unknown {sorted(unknown)}; expected bert, llama, encdec")
    for name in ("seq_lens", "train_seq_lens"):
        if getattr(args, name) is not None and min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help, and the suite list kept as written."""


def resolve(args):
    """Fills the device-dependent defaults; returns (device, dtype)."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark: --device cuda but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"benchmark: unsupported device {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kind = "cuda" if device.type == "cuda" else "cpu"
    pick = 1 if args.full else 0
    args.seq_lens = sorted(set(args.seq_lens or SEQ_LENS[kind][pick]))
    args.train_seq_lens = sorted(set(args.train_seq_lens or TRAIN_SEQ_LENS[kind][pick]))
    args.batch = args.batch or (4 if kind == "cuda" else 1)
    args.heads = args.heads or (16 if kind == "cuda" else 8)
    args.ln_width = args.ln_width or args.heads * args.head_dim
    args.budget = args.budget if args.budget is not None else (8.0 if args.full else 1.5)
    args.max_call_seconds = args.max_call_seconds or (60.0 if args.full else 3.0)
    if args.train_d_model % args.train_heads:
        raise SystemExit("benchmark: --train-d-model must be divisible by --train-heads")
    return device, dtype


def _load_average():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run_group(group, args, device, memory_limit, history):
    """Checks, measures and times every implementation of one group; returns its records."""
    import torch

    from . import cases, measure

    records, fns, first_call = {}, {}, {}
    group.setup()
    try:
        for impl in group.impls:
            rec = {"family": group.family, "impl": impl, "label": cases.label(group.family, impl),
                   "baseline": cases.baseline(group.family, impl), "config": dict(group.config),
                   "config_label": group.describe(), "seq_len": group.seq_len, "status": "ok", "note": "",
                   "correct": None, "max_error": None, "error_bound": None, "time": None,
                   "peak_memory_bytes": None, **group.work(impl)}
            records[impl] = rec
            estimate = group.memory_estimate(impl)
            seen = history.get((group.family, group.describe(), impl))
            if estimate > memory_limit:
                rec.update(status="skipped", note=f"needs ~{estimate / 2**30:.1f} GiB > limit "
                                                  f"{memory_limit / 2**30:.1f} GiB")
                continue
            if seen and seen[1] * (group.seq_len / seen[0]) ** group.growth(impl) > args.max_call_seconds:
                predicted = seen[1] * (group.seq_len / seen[0]) ** group.growth(impl)
                rec.update(status="skipped", note=f"too slow: ~{predicted:.0f} s per call predicted "
                                                  f"> --max-call-seconds {args.max_call_seconds:g}")
                continue
            try:
                ok, err, bound, note = group.check(impl)
                rec.update(correct=bool(ok), max_error=err, error_bound=bound, check=note if ok else "")
                if not ok:
                    rec.update(status="wrong", note=f"failed the correctness check: {note}")
                    continue
                fn = group.function(impl)
                if args.no_memory:
                    first_call[impl] = measure.time_once(fn, device)
                else:
                    first_call[impl], rec["peak_memory_bytes"], _ = measure.run_measuring_memory(fn, device)
                fns[impl] = fn
            except cases.NotAvailable as exc:
                rec.update(status="n/a", note=str(exc))
            except Exception as exc:  # noqa: BLE001 - a failing kernel is reported, not fatal
                rec.update(status="error", note=_first_line(exc))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if group.family == "train_step" and impl in fns:
                rec["parameters"] = group.parameters(impl)
        try:
            times = measure.time_interleaved(fns, device, first_call_s=first_call, max_repeats=args.repeats,
                                             min_repeats=args.min_repeats, budget_s=args.budget,
                                             min_sample_s=args.min_sample_ms / 1e3)
        except Exception as exc:  # noqa: BLE001 - e.g. a kernel that fails only on a later call
            times = {}
            for impl in fns:
                records[impl].update(status="error", note=f"while timing: {_first_line(exc)}")
        for impl, t in times.items():
            rec = records[impl]
            rec["time"] = t
            seconds = t["median_ms"] / 1e3
            rec["tokens_per_s"] = rec["tokens"] / seconds
            rec["flops_per_s"] = rec["flops"] / seconds if rec.get("flops") else None
            rec["bytes_per_s"] = rec["bytes"] / seconds if rec.get("bytes") else None
            history[(group.family, group.describe(), impl)] = (group.seq_len, seconds)
        for rec in records.values():
            base = records.get(rec["baseline"]) if rec["baseline"] else None
            if rec["time"] and base and base["time"]:
                rec["speedup_vs_baseline"] = base["time"]["median_ms"] / rec["time"]["median_ms"]
    finally:
        fns.clear()
        group.teardown()
    return list(records.values())


def main(argv=None):
    args = parse_args(argv)
    if args.gpu:
        from . import gpu_suite

        return gpu_suite.run(args)
    status = run_sweep(args) if args.families else 0
    for suite in args.targets:
        status = max(status, run_target(suite, args))
    return status


def run_target(suite, args):
    """Runs one target suite and writes <device>-<suite>-<date>.json and .md."""
    start = time.time()
    import torch

    import transformer_fast

    from . import measure, report

    module_name, function = TARGETS[suite][0].rsplit(".", 1)
    module = importlib.import_module(f"{__package__}.{module_name}")
    if suite == "models":
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        device = torch.device("cuda" if suite.startswith("target_gpu") else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"benchmark: {suite} needs a CUDA GPU; skipped", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.budget is None:
        args.budget = 8.0 if args.full else 3.0
    load_start = _load_average()
    print(f"{suite} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    backends = transformer_fast.available_backends()
    body = getattr(module, function)(args)
    result = {
        "schema_version": 1, "suite": suite, "smoke": args.smoke,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + list(getattr(sys, "orig_argv", sys.argv))[1:]),
        "device": measure.device_info(device), "versions": measure.versions(), "backends": backends,
        "threads": torch.get_num_threads(), "load_average": {"start": load_start, "end": _load_average()},
        "environment": {k: os.environ.get(k) for k in (*_MALLOC_ENV, *_LAUNCH_ENV)}, "result": body,
        "wall_time_s": time.time() - start,
    }
    stem = f"{args.name}-{suite}" if args.name else \
        f"{result['device']['slug']}-{suite}-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M')}"
    paths = report.write_suite(result, args.out, stem, module.markdown)
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths), flush=True)
    rows = body.get("rows") or body.get("results") or [body]
    wrong = [r for r in rows if r.get("status") == "wrong"]
    return 1 if wrong and args.strict else 0


def run_sweep(args):
    """The sweep over sequence lengths of the families in args.families."""
    start = time.time()
    import torch

    import transformer_fast

    from . import cases, measure, report

    device, dtype = resolve(args)
    torch.manual_seed(args.seed)
    load_start = _load_average()
    print(f"transformer_fast benchmark on {device} ({dtype}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    backends = transformer_fast.available_backends()  # loads (or JIT-builds) the C++ extension now
    selected = {}
    for name in ("attention", "layer_norm", "linear_attention"):
        try:
            from transformer_fast import _backends

            selected[name] = _backends.select_backend(device, dtype, "auto", name)
        except Exception as exc:  # noqa: BLE001
            selected[name] = _first_line(exc)
    for name, status in backends.items():  # None or why not; or, per device type, "ok" or why not
        if isinstance(status, dict):
            status = None if status.get(device.type) == "ok" else status.get(device.type)
        print(f"  backend {name}: {'available' if status is None else f'unavailable ({status})'}")
    print(f"  ours runs on the {selected['attention']!r} backend for {device.type} {dtype} tensors", flush=True)

    if load_start and load_start[0] > (os.cpu_count() or 1):
        print(f"  warning: the machine is busy (load average {load_start[0]:.1f} on {os.cpu_count()} CPUs); "
              f"timings will be noisy", flush=True)
    ceilings = measure.measure_ceilings(device, dtype, quick=not args.full)
    print(f"  ceilings: {ceilings['matmul']['dtype']} matmul {ceilings['matmul']['flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"copy {ceilings['copy']['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    if args.max_memory_gb is not None:
        memory_limit = args.max_memory_gb * 2**30
    else:
        memory_limit = measure.available_memory_bytes(device) * (0.9 if device.type == "cuda" else 0.5)

    groups = cases.make_groups(args, device, dtype)
    records, history, interrupted = [], {}, False
    progress = None
    if not args.no_progress and sys.stderr.isatty():  # a log gets plain lines, not a bar's carriage returns
        try:
            from tqdm import tqdm

            progress = tqdm(total=len(groups), unit="case", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            progress = None
    try:
        for i, group in enumerate(groups):
            if progress is not None:
                progress.set_description_str(group.key)
            elif not args.no_progress:
                print(f"[{i + 1}/{len(groups)}] {group.key}", file=sys.stderr, flush=True)
            records.extend(run_group(group, args, device, memory_limit, history))
            if progress is not None:
                progress.update(1)
    except KeyboardInterrupt:
        interrupted = True
        print("\nbenchmark: interrupted, writing the results so far", file=sys.stderr)
    finally:
        if progress is not None:
            progress.close()

    result = {
        "schema_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + list(getattr(sys, "orig_argv", sys.argv))[1:]),
        "interrupted": interrupted,
        "device": measure.device_info(device),
        "dtype": str(dtype).replace("torch.", ""),
        "versions": measure.versions(),
        "backends": {"available": backends, "selected": selected},
        "settings": {k: v for k, v in vars(args).items() if k not in ("impls",)} | {"impls": args.impls,
                                                                                   "memory_limit_bytes": memory_limit},
        "environment": {k: os.environ.get(k) for k in (*_MALLOC_ENV, *_LAUNCH_ENV, "OMP_NUM_THREADS",
                                                       "TRANSFORMER_FAST_BACKEND", "TRITON_INTERPRET")},
        "ceilings": ceilings,
        "load_average": {"start": load_start, "end": _load_average()},
        # the method's paragraphs of measure's docstring, without their headings ("Time.", "Peak memory.")
        "method": {"time": " ".join(measure.__doc__.split("\n\n")[1].split()).split(". ", 1)[1],
                   "memory": " ".join(measure.__doc__.split("\n\n")[2].split()).split(". ", 1)[1],
                   "check": "every implementation runs once first and is compared with a float64 oracle on 12 "
                            "query rows (output, and gradients for a random upstream gradient on those rows); "
                            "bound = 2 x the oracle's own error in the dtype + a floor of "
                            "{fp32: 1e-4, fp16: 1e-2, bf16: 5e-2} x max(1, |oracle|). A failing one is not timed."},
        "cases": records,
    }
    result["crossovers"] = report.crossovers(records)
    result["wall_time_s"] = time.time() - start
    result["suite"], result["smoke"] = "sweep", args.smoke
    stem = args.name or f"{result['device']['slug']}-sweep-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M')}"
    paths = report.write_all(result, args.out, stem, plots=not args.no_plots)
    print()
    print(report.console_text(result))
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths))
    print(f"total wall time {time.time() - start:.0f} s")
    failed = [r for r in records if r["status"] in ("wrong", "error")]
    return 130 if interrupted else (1 if failed and args.strict else 0)


if __name__ == "__main__":
    _reexec_with_malloc_settings()
    sys.exit(main())
