"""Reads the committed results (benchmarks/results/) and picks the latest per device and suite:
the input of the results index and of the README's generated tables (see report.main).

Every suite writes JSON with its suite name and date. Two kept result files predate that: a
sweep in JSON without a suite name (read as the sweep), and the CPU targets' printed text
(`EARLIER_FORMATS` says what it holds; the parsers below read such text, as in git history).
"""
from __future__ import annotations

import json
import os
import re

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# file -> (suites, when measured): the one result kept from before the suites wrote JSON, the text
# the CPU LayerNorm and linear-attention targets printed on the 2-core development VM.
EARLIER_FORMATS = {
    "cpu-targets-2026-11-22.txt": (("target_cpu_layer_norm", "target_cpu_linear_attention"), "2026-11-22T12:00"),
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
