"""Compile every Triton kernel config for real GPUs, on a machine without one.

    python -m transformer_fast.kernels.compile_check [--arch 80 90] [--json out.json] [--only FAMILY]
    python -m transformer_fast.kernels.compile_check --cuda [--arch 80 90]

--cuda compiles the C++ backend's CUDA sources (csrc/cuda/*.cu) with nvcc instead, for each arch, and
reports registers and spills per kernel.

The Triton interpreter accepts programs the GPU compiler rejects, so interpreter tests alone
prove little about a GPU. This compiles each case of each family (``compile_cases.py``) to
PTX and cubin for sm_80 and sm_90, reads registers and spills from Triton's own ``ptxas``, and
on sm_90 checks the SASS of cases marked ``expect_wgmma`` for ``HGMMA`` (Hopper's wgmma).
Must run without TRITON_INTERPRET (jit functions are interpreter objects under it).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from ._triton_options import LAUNCH_OPTIONS


def _nvidia_bin(tool):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _ptxas_counts(text: str):
    """(registers, spill bytes) from ptxas -v's report, or None where it holds none."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", text)]
    if not registers:
        return None
    return max(registers), sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))


def _ptxas_report(ptx: str):
    """(registers, spill bytes) as Triton's ptxas reports them for the PTX, running it again."""
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    try:  # the ptxas Triton itself uses for this arch (Triton >= 3.5 uses a newer one for sm_90+)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(int(re.search(r"\d+", arch).group())).path
    except (ImportError, AttributeError, TypeError):  # Triton versions without get_ptxas(arch)
        ptxas = _nvidia_bin("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "k.o")],
                                capture_output=True, text=True, check=True)
    return _ptxas_counts(result.stderr + result.stdout) or (0, 0)


def _compile_reading_ptxas(source, target, options):
    """triton.compile, and (registers, spill bytes) from the -v report of Triton's own ptxas run,
    which it prints under TRITON_DUMP_PTXAS_LOG=1 (Triton >= 3.4); None where none was printed (a
    kernel from Triton's cache, or an older Triton), for _ptxas_report to run ptxas again, without
    the options Triton passes (Triton 3.9: --regAllocOptLevel=2), so a cached kernel's spills can
    read lower than a fresh build's (1292 against 1892 bytes for one sm_90 build). ptxas
    is much of a spilling kernel's build: six such attention builds took 48 s this way, 66 s with
    the second run."""
    import triton

    before = os.environ.get("TRITON_DUMP_PTXAS_LOG")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()) as log:
            compiled = triton.compile(source, target=target, options=options)
    finally:
        if before is None:
            del os.environ["TRITON_DUMP_PTXAS_LOG"]
        else:
            os.environ["TRITON_DUMP_PTXAS_LOG"] = before
    return compiled, _ptxas_counts(log.getvalue())


def _sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvidia_bin("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def compile_case(case: dict, cap: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.time()
    # "attrs" (optional): {(arg index,): [["tt.divisibility", 16]]}, the specialization Triton gives
    # at launch to pointers and ints divisible by 16 (vectorized loads; registers differ without it)
    source = ASTSource(case["fn"], case["signature"], case.get("constexprs", {}), case.get("attrs"))
    options = {"num_warps": case.get("num_warps", 4), "num_stages": case.get("num_stages", 3), **LAUNCH_OPTIONS}
    compiled, counts = _compile_reading_ptxas(source, GPUTarget("cuda", cap, 32), options)
    registers, spills = counts or _ptxas_report(compiled.asm["ptx"])
    report = {"name": case["name"], "arch": f"sm_{cap}", "num_warps": options["num_warps"],
              "num_stages": options["num_stages"], "registers": registers, "spill_bytes": spills,
              "shared_bytes": int(getattr(compiled.metadata, "shared", 0)), "seconds": round(time.time() - start, 2)}
    if cap >= 90 and case.get("expect_wgmma"):
        report["hgmma"] = "HGMMA" in _sass(compiled.asm["cubin"])
    return report


def _cases(family):
    # imported here: it loads Triton and the kernels, which --cuda does not need
    return importlib.import_module(f"{__package__}.compile_cases").compile_cases(family)


def _check(task):
    """Compiles case `index` of `family` for `cap`: (report, failure message or None). Runs in a
    worker process, so it looks the case up again rather than receiving it."""
    family, index, cap = task
    case = _cases(family)[index]
    try:
        report = compile_case(case, cap)
    except Exception as exc:  # noqa: BLE001 - report every failing case, then fail
        return None, f"{case['name']} sm_{cap}: {type(exc).__name__}: {str(exc)[:2000]}"
    report["family"] = family
    if report.get("hgmma") is False:
        return report, f"{case['name']} sm_{cap}: no HGMMA (wgmma) in the SASS"
    return report, None


def check_cuda_sources(archs):
    """nvcc-compiles csrc's CUDA sources for each arch: (per-kernel reports, failure messages)."""
    import shutil

    from torch.utils import cpp_extension

    from .. import _build, _build_config

    nvcc = shutil.which("nvcc") or (cpp_extension.CUDA_HOME and os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        return [], ["nvcc not found"]
    csrc = _build._csrc_dir()
    reports, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # A CPU build of torch ships c10/cuda's headers but not the configuration header that CMake
        # writes for CUDA builds; an empty stand-in is enough to compile against them.
        shim = os.path.join(tmp, "shim", "c10", "cuda", "impl")
        os.makedirs(shim)
        open(os.path.join(shim, "cuda_cmake_macros.h"), "w").close()
        includes = [f"-I{p}" for p in [*_build_config.include_paths(csrc), *cpp_extension.include_paths()]]
        includes.append(f"-I{os.path.join(tmp, 'shim')}")
        for path in _build_config.cuda_source_paths(csrc):
            source = os.path.relpath(path, csrc)
            for cap in archs:
                start = time.time()
                cmd = [nvcc, "-c", path, "-o", os.path.join(tmp, "k.o"),
                       f"-gencode=arch=compute_{cap},code=sm_{cap}", "-Xptxas", "-v",
                       *cpp_extension.COMMON_NVCC_FLAGS, *_build_config.extra_cuda_cflags(), *includes,
                       "-std=c++20"]  # what cpp_extension passes a build from torch 2.13 on (2.14 requires it)
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    failures.append(f"{source} sm_{cap}: {result.stderr[-3000:]}")
                    continue
                names = subprocess.run(["c++filt"], input=result.stderr, capture_output=True, text=True).stdout
                for block in re.split(r"Compiling entry function ", names)[1:]:
                    name = re.sub(r"transformer_fast::|cuda_kernels::|\(.*", "", block.split("'")[1]).replace("c10::", "")
                    reports.append({"name": f"{source}:{name}", "arch": f"sm_{cap}", "num_warps": 4, "num_stages": 0,
                                    "registers": int(re.search(r"Used (\d+) registers", block).group(1)),
                                    "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill", block)),
                                    "seconds": round(time.time() - start, 2), "family": "csrc"})
    return reports, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--only", nargs="+", default=None, help="families to check (default: all)")
    parser.add_argument("--json", default=None, help="write the per-case reports here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles run in parallel")
    parser.add_argument("--cuda", action="store_true", help="compile the C++ backend's CUDA sources instead")
    args = parser.parse_args(argv)
    if args.cuda:
        reports, failures = check_cuda_sources(args.arch)
        for report in reports:
            print(f"{report['name']:<60} {report['arch']} regs={report['registers']:>3} "
                  f"spills={report['spill_bytes']}", flush=True)
        return _finish(args, reports, failures)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the GPU compiler needs real jit functions")

    from .compile_cases import FAMILIES

    tasks = [(family, index, cap)
             for family in args.only or FAMILIES
             for index in range(len(_cases(family)))
             for cap in args.arch]
    reports, failures = [], []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for report, failure in pool.map(_check, tasks):
            if report is not None:
                reports.append(report)
                print(f"{report['name']:<60} {report['arch']} regs={report['registers']:>3} "
                      f"spills={report['spill_bytes']} {report['seconds']}s"
                      + (f" hgmma={report['hgmma']}" if "hgmma" in report else ""), flush=True)
            if failure is not None:
                failures.append(failure)
    return _finish(args, reports, failures)


def _finish(args, reports, failures):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": reports, "failures": failures}, f, indent=1)
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    print(f"{len(reports)} compiled, {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
