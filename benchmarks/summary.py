"""Reads the committed results (benchmarks/results/) and picks the latest per device and suite:
the input of the results index and of the README's generated tables (see report.main).

Every suite writes JSON with its suite name and date. A few result files predate that: the
sweeps and GPU attention grids in JSON without a suite name or date, and CPU target runs kept as
the text the benchmark printed. `EARLIER_FORMATS` says what each of them is, and the parsers
below read the text ones.
"""
from __future__ import annotations

import json
import os
import re

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# file -> (suites, when measured). The text files' device: the 2-core development VM of the CPU sweeps.
EARLIER_FORMATS = {
    "cuda-h100-attention-2026-11-22-grid-first-bwd-tiles.json": (("target_gpu_attention",), "2026-11-22T01:00"),
    "cuda-h100-attention-2026-11-22-bf16-fwdbwd-swept-tiles.json": (("target_gpu_attention",), "2026-11-22T02:00"),
    "cuda-h100-attention-2026-11-23-fp16-fwdbwd.json": (("target_gpu_attention",), "2026-11-23T05:10"),
    "cuda-h100-attention-cpp-2026-11-23.json": (("target_gpu_attention",), "2026-11-23T05:20"),
    "cpu-attention-2026-11-23-register-tiles.txt": (("target_cpu_attention",), "2026-11-23T12:00"),
    "cpu-targets-2026-11-22.txt": (("target_cpu_layer_norm", "target_cpu_linear_attention"), "2026-11-22T12:00"),
}
# Records that are not benchmark results: what each is.
OTHER_RECORDS = {
    "cpu-lowp-products-2026-11-29.txt": "the C++ attention's bf16/fp16 tile products on an AVX2 CPU: MKL's bf16 "
                                        "gemm and torch's fp16 mm against fp32 products on operands converted "
                                        "per product: bf16 1.00-1.03x, fp16 1.03-1.17x forward and 1.09-1.13x "
                                        "forward+backward",
    "cpu-norm-weight-grad-chunks-2026-11-28.txt": "the C++ LayerNorm/RMSNorm backward's weight gradient summed in "
                                                  "chunks of 16 rows instead of 64: RMSNorm's dweight over 64-1000 "
                                                  "rows 0.6-0.9x torch's error (was 1.1-1.8x), time within noise",
    "compile-check-attention-atomic-dq-2026-11-27.txt": "the attention dK/dV kernel adding dQ atomically "
                                                        "(TRANSFORMER_FAST_ATOMIC_DQ=1) against the same tiles "
                                                        "without it, compiled for sm_80 and sm_90: registers and "
                                                        "spills",
    "cpu-linear-state-sum-2026-11-27.txt": "linear attention's final state summed in float64 (C++) and with Kahan "
                                           "compensation (Triton): final z within torch's summation error at 200-20k "
                                           "keys (was 2-6.5x); C++ time unchanged (0.94-1.02x, one thread); Triton "
                                           "register use and spills from the compile check",
    "cpu-attention-dropout-ab-2026-11-27.txt": "the C++ CPU attention with dropout 0.1 before and after the dropout "
                                               "changes (BERT-base layer, one thread): forward 0.64-0.70x its former "
                                               "time, backward 0.79-0.83x; no change without dropout",
    "cpu-attention-causal-tiles-2026-11-27.txt": "the C++ attention's forward key tiles in bf16/fp16 with a causal "
                                                 "mask or a window, 512 against 256 keys: bf16 forward causal "
                                                 "0.83-0.90x its former time, windows 0.65-0.83x",
    "cpu-attention-ragged-2026-11-27.txt": "the C++ bf16 attention before and after its packed score and dP products "
                                           "run over key blocks rounded up to 16 columns: ragged N forward "
                                           "0.85-0.90x its former time, forward+backward 0.84-0.96x",
    "cpu-packed-launch-2026-11-27.txt": "host time per call of the Triton ops' CUDA kernels without a GPU, Triton's "
                                        "own launcher built against a recording CUDA library: packed launches "
                                        "(C++) against direct launches (0.58-0.72x their time) and JITFunction.run, "
                                        "Triton 3.9 and 3.6, and the checks that both pass the driver the same",
    "cpu-packed-at-second-launch-2026-11-27.txt": "decoding calls with a new key count each step, packed launches "
                                                  "on: a plan's packed launch made at its second launch instead of "
                                                  "its first, 80-91 -> 46-53 us per call; repeated shapes unchanged",
    "cpu-native-calls-2026-11-27.txt": "host time per call of the attention and norm ops' CUDA kernels without a "
                                       "GPU: native calls (C++ recipes) against the Python kernels behind the "
                                       "dispatcher (0.38-0.55x their time), launched into a recording CUDA library",
    "cpu-hf-rmsnorm-2026-11-27.txt": "Hugging Face transformers' RMSNorm modules (Llama's and Gemma's forms) before and "
                                     "after `convert`, decoding and training sizes "
                                     "(`python -m benchmarks.tools.hf_norms_cpu`)",
    "cpu-host-before-after-2026-11-27.txt": "CPU time per call of small calls and of decoding attention, before and "
                                            "after the eager path's checks moved into one C call and the kernels' "
                                            "allocations off the dispatcher "
                                            "(`python -m benchmarks.tools.host_before_after_cpu`)",
    "compile-check-2026-11-23.txt": "Triton kernels compiled for sm_80 and sm_90 without a GPU: registers and spills "
                                    "of every config (`python -m transformer_fast.kernels.compile_check`)",
    "compile-check-cuda-2026-11-26.txt": "the C++ backend's CUDA kernels compiled with nvcc for sm_80 and sm_90: "
                                         "registers and spills (`compile_check --cuda`)",
    "compile-check-linear-state-2026-11-25.txt": "the linear-attention Triton kernels, with and without a carried "
                                                 "state, compiled for sm_80 and sm_90: registers and spills "
                                                 "(`compile_check --only linear_attention`)",
    "compile-check-attention-2026-11-25.txt": "the Triton attention kernels with windows, softcap, ALiBi, sinks, "
                                              "packed/paged layouts and the decoding split, compiled for sm_80 and "
                                              "sm_90: registers and spills of every config (`compile_check --only "
                                              "attention`)",
    "compile-check-float-mask-2026-11-26.txt": "the Triton attention kernels with a float attn_mask (float32 with a bf16 "
                                                 "query included; finfo.min kept finite), compiled for sm_80 "
                                                 "and sm_90: registers and spills",
    "compile-check-attention-2026-11-26.txt": "the Triton attention kernels with dQ's sum of P * dP for the sinks' "
                                              "gradient, compiled for sm_80 and sm_90: registers and spills of every "
                                              "config (`compile_check --only attention`)",
    "compile-check-layer-norm-2026-11-26.txt": "the LayerNorm/RMSNorm Triton kernels with weight and bias read in "
                                               "their own dtype, compiled for sm_80 and sm_90: registers and spills",
    "cuda-h200-gpu-tests-2026-11-26.txt": "the `gpu`-marked tests on an H200 before and after the direct launch of "
                                          "tuned choices: each run's summary, the one failure and its cause",
    "cuda-h200-host-2026-11-26.txt": "host time per call on an H200's machine, ours and torch's, before and after the "
                                     "direct launch of tuned choices, with where the time goes (cProfile, "
                                     "torch.profiler)",
    "cpu-launch-plans-2026-11-26.txt": "host time per call of the Triton ops' CUDA kernels without a GPU (launches "
                                       "recorded), before and after the launch plans: 0.50-0.65x the direct "
                                       "launch's time for attention, LayerNorm and linear attention",
    "cpu-attention-padding-2026-11-26.txt": "the C++ attention with right-padded keys before and after its tiles "
                                            "end at the last unpadded key (forward 0.63-0.82x its time, "
                                            "forward+backward 0.80-0.86x), and "
                                            "where packing K and V pays off by shape, dtype and threads "
                                            "(`benchmarks/tools/sweep_cpu_packing.py`)",
    "cpu-launch-overhead-2026-11-26.txt": "host time per call of the Triton ops' CUDA kernels without a GPU (kernels "
                                          "compiled for sm_90, launches recorded): direct launches against Triton's "
                                          "JITFunction.run, with Triton 3.9 and 3.6, and the check that both launch "
                                          "the same",
    "cuda-h200-attention-kernels-2026-11-26.txt": "device time per kernel of one attention forward+backward on an "
                                                  "H200, ours against torch's SDPA (cuDNN attention)",
    "cuda-h100-attention-bwd-tile-sweep-2026-11-22.txt": "every candidate tile of the two Triton backward kernels "
                                                         "timed alone on an H100 (benchmarks/tools/sweep_attention_"
                                                         "tiles_gpu.py): the source of the bf16/fp16 backward tables",
    "compile-check-layer-norm-bwd-tiles-2026-11-26.txt": "the LayerNorm/RMSNorm Triton kernels with the backward's "
                                                         "tile table, compiled for sm_80 and sm_90 with the launch-"
                                                         "time specialization: registers and spills",
    "cuda-h100-layer-norm-bwd-sweep-2026-11-26.txt": "the LayerNorm backward's steps, warps and programs per SM timed "
                                                     "on an H100 against torch's backward (kernel time): the source "
                                                     "of the backward's tile table",
    "cuda-h100-host-2026-11-27-1200.txt": "host time per call on an H100's machine, ours and torch's, with the "
                                          "native calls' device guard (the defaults)",
    "cuda-h100-gpu-tests-2026-11-27-1200.txt": "the `gpu`-marked tests on an H100 with the native calls' device guard "
                                               "and the Llama and LayerNorm rows' checks",
    "cuda-h100-attention-kernels-2026-11-27.txt": "device time per kernel of one attention forward+backward on an "
                                                  "H100, ours against cuDNN attention, and Nsight Compute's summary "
                                                  "of each kernel",
    "cuda-h100-layer-norm-bwd-sweep-2026-11-27.txt": "the LayerNorm backward's tile choices timed again on an H100: "
                                                     "why width 1024 takes 2 programs per SM",
    "cuda-h100-host-2026-11-27.txt": "host time per call on an H100's machine, ours and torch's, with packed launches "
                                     "and native calls and without them (TRANSFORMER_FAST_NATIVE_LAUNCH=0)",
    "cuda-h100-gpu-tests-2026-11-27.txt": "the `gpu`-marked tests on an H100 with packed launches and native calls: "
                                          "their bitwise tests and the rest without the full grids",
    "cuda-h100-host-2026-11-26.txt": "host time per call on an H100's machine, ours and torch's, with direct launches "
                                     "and without them (TRANSFORMER_FAST_DIRECT_LAUNCH=0), and where the time goes",
    "cuda-h100-gpu-tests-2026-11-26.txt": "the `gpu`-marked tests on an H100 with direct launches: the direct-launch "
                                          "test (bitwise Triton's results) and the rest without the full grids",
    "cuda-h100-gpu-tests-2026-11-23.txt": "the `gpu`-marked tests on an H100: summary of each run, and the "
                                          "head-dim pairs that located the Triton 3.6 miscompilation",
}
CPU_VM = "Intel(R) Xeon(R) Processor"
CPU_CASES = ("forward", "forward causal", "forward 1/4 padded", "fwd+bwd", "fwd+bwd causal", "fwd+bwd 1/4 padded")


def _torch_version(text):
    m = re.search(r"torch (\d+\.\d+\.\d+\S*)", text)
    return m.group(1).rstrip(",;") if m else None


def parse_attention_log(text):
    """Ratio tables of the CPU attention target as printed ('float32 B=1 H=8 N=2048 D=64, ...' then
    'case torch ms ours ms ratio' rows, one table per run), and one-line bf16 summaries."""
    rows, shape, dtype, run = [], None, None, -1
    for line in text.splitlines():
        m = re.match(r"(float32|bfloat16) (B=\d+ H=\d+ N=\d+ D=\d+), \d+ threads, \d+ interleaved pairs", line)
        if m:
            dtype, shape = m.group(1), m.group(2)
            continue
        if line.startswith("case") and "ratio" in line:
            run += 1
            continue
        m = re.match(r"(forward|forward causal|forward 1/4 padded|fwd\+bwd|fwd\+bwd causal|fwd\+bwd 1/4 padded)"
                     r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m and dtype:
            rows.append({"dtype": dtype, "shape": shape, "case": m.group(1), "torch_ms": float(m.group(2)),
                         "ours_ms": float(m.group(3)), "ratio": float(m.group(4)), "run": run, "status": "ok"})
            continue
        m = re.match(r"forward ([\d.]+), causal ([\d.]+), padded ([\d.]+); fwd\+bwd ([\d.]+), causal ([\d.]+), "
                     r"padded ([\d.]+)$", line)
        if m and shape:
            run += 1
            rows += [{"dtype": "bfloat16", "shape": shape, "case": case, "ratio": float(x), "run": run, "status": "ok"}
                     for case, x in zip(CPU_CASES, m.groups())]
    return {"rows": rows}


def parse_layer_norm_log(text):
    m = re.search(r"LayerNorm float32 (\d+)x(\d+)", text)
    num = {key: float(re.search(pattern, text).group(1)) for key, pattern in (
        ("forward_ratio", r"speed-up forward\s+([\d.]+)x"),
        ("forward_backward_ratio", r"speed-up forward\+backward\s+([\d.]+)x"),
        ("forward_gb_per_s", r"fused forward\s+([\d.]+) GB/s"),
        ("copy_gb_per_s", r"copy bandwidth\s+([\d.]+) GB/s"))}
    return {"shape": f"{m.group(1)} x {m.group(2)} float32", "status": "ok", **num}


def parse_linear_attention_log(text):
    out = {"status": "ok", "passes": {}, "peak_rss_growth_mib": {}, "crossover_vs_sdpa": {}}
    for m in re.finditer(r"^(forward|forward\+backward)\s+(B=\d+ H=\d+ N=\d+ D=\d+ causal fp32): ours ([\d.]+) ms, "
                         r"cumsum [\d.]+ ms \(([\d.]+)x\), sdpa [\d.]+ ms \(([\d.]+)x\)", text, re.M):
        out["shape"] = m.group(2).replace("fp32", "float32")
        out["passes"][m.group(1)] = {"ours_ms": float(m.group(3)), "vs_cumsum": float(m.group(4)),
                                     "vs_sdpa": float(m.group(5))}
    for m in re.finditer(r"peak RSS growth .* N=(\d+): (\d+) MiB", text):
        out["peak_rss_growth_mib"][m.group(1)] = float(m.group(2))
    for m in re.finditer(r"^(causal|non-causal): linear attention \(C\+\+\) is faster than F.sdpa from N = (\d+)",
                         text, re.M):
        out["crossover_vs_sdpa"][m.group(1)] = {"faster_from": int(m.group(2))}
    return out


def _entry(path, suite, created, device, versions, data):
    return {"file": os.path.basename(path), "suite": suite, "created": created, "device": device,
            "versions": versions, "data": data}


def load(path):
    """The result entries of one file: [{file, suite, created, device, versions, data}]."""
    name = os.path.basename(path)
    suites, when = EARLIER_FORMATS.get(name, ((), None))
    if name.endswith(".txt"):
        if not suites:
            return []
        with open(path) as f:
            text = f.read()
        device = {"slug": "cpu", "name": CPU_VM, "type": "cpu"}
        versions = {"torch": _torch_version(text)}
        parsers = {"target_cpu_attention": parse_attention_log, "target_cpu_layer_norm": parse_layer_norm_log,
                   "target_cpu_linear_attention": parse_linear_attention_log}
        return [_entry(path, s, when, device, versions, parsers[s](text)) for s in suites]
    if not name.endswith(".json"):
        return []
    with open(path) as f:
        result = json.load(f)
    if result.get("smoke"):
        return []
    if "cases" in result:  # a sweep
        return [_entry(path, result.get("suite", "sweep"), result["created"], result["device"], result["versions"],
                       result)]
    if "results" in result:  # a GPU attention grid written before the suites
        data = {k: result[k] for k in ("matmul_flops_per_s", "args", "results")}
        return [_entry(path, suites[0], when, result["device"], result["versions"], data)]
    if "suite" in result:
        return [_entry(path, result["suite"], result["created"], result.get("device", {}), result["versions"],
                       result.get("result", result))]
    return []


def load_all(folder=RESULTS):
    entries = []
    for name in sorted(os.listdir(folder)):
        entries += load(os.path.join(folder, name))
    return entries


def variant(entry):
    """What a newer entry supersedes: the same device (by name: every CPU's slug is "cpu"),
    suite and, for the GPU grid, our backend and torch's SDPA backend it was timed against
    ("triton", or "triton vs default" where torch chose its own; flash before that option)."""
    if entry["suite"] != "target_gpu_attention":
        return entry["device"].get("name"), entry["suite"], ""
    args = entry["data"].get("args", {})
    sdpa = args.get("sdpa_backend", "flash")
    return entry["device"].get("name"), entry["suite"], args.get("backend", "triton") + (
        "" if sdpa == "flash" else f" vs {sdpa}")


def latest(entries):
    """{variant: [entries, newest first]}."""
    out = {}
    for e in sorted(entries, key=lambda e: e["created"], reverse=True):
        out.setdefault(variant(e), []).append(e)
    return out


def latest_gpu_grid_rows(newest_first):
    """The GPU attention grid's rows, each (dtype, pass) from the newest run that measured it:
    runs that timed a subset after a kernel change supersede only that subset."""
    rows, taken = [], set()
    for entry in newest_first:
        units = {(r["dtype"], r["passes"]) for r in entry["data"]["results"]}
        for unit in sorted(units - taken):
            rows += [dict(r, file=entry["file"], created=entry["created"]) for r in entry["data"]["results"]
                     if (r["dtype"], r["passes"]) == unit]
        taken |= units
    return rows
