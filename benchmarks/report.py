"""What the benchmark writes: the crossover statements, the tables (console and Markdown), the
JSON record and the PNG plots; and, run as a command, the results index and the README's tables.

    python -m benchmarks.report              # rewrites benchmarks/results/INDEX.md, the README's headline
                                             # (best figures) and docs/performance.md's full tables
    python -m benchmarks.report --check      # exit status 1 if any of them is out of date
"""
from __future__ import annotations

import json
import math
import os

from . import cases

STATUS_TEXT = {"wrong": "WRONG", "error": "error", "skipped": "skipped", "n/a": "n/a"}
CROSSOVER_PAIRS = (("ours_linear", "ours_softmax"), ("ours_linear", "torch_sdpa"))


# --------------------------------------------------------------------------------------------
# Crossover: the length from which linear attention stays faster than softmax attention
# --------------------------------------------------------------------------------------------
def _times(records, impl, causal, pass_):
    return {r["seq_len"]: r["time"]["median_ms"] for r in records
            if r["family"] == "attention" and r["impl"] == impl and r["config"]["causal"] == causal
            and r["config"]["pass"] == pass_ and r["status"] == "ok" and r["time"]}


def _status_reason(records, impl, causal, pass_):
    notes = {f"{r['status']} at N={r['seq_len']}: {r['note']}" for r in records
             if r["family"] == "attention" and r["impl"] == impl and r["config"]["causal"] == causal
             and r["config"]["pass"] == pass_ and r["status"] != "ok"}
    return sorted(notes)[0] if notes else "not run"


def crossover(records, causal, pass_, linear="ours_linear", softmax="ours_softmax"):
    """The sequence length at which `linear` becomes and stays faster than `softmax`,
    interpolated in log-log between the bracketing measured lengths (or extrapolated)."""
    what = "causal" if causal else "non-causal"
    name = {"fwd": "forward", "fwd+bwd": "forward+backward"}.get(pass_, pass_)
    head = (f"Crossover ({what}, {name}): {cases.label('attention', linear)} attention vs "
            f"{cases.label('attention', softmax)} attention")
    out = {"causal": causal, "pass": pass_, "linear": linear, "softmax": softmax, "seq_len": None}
    t_lin, t_soft = _times(records, linear, causal, pass_), _times(records, softmax, causal, pass_)
    lengths = sorted(set(t_lin) & set(t_soft))
    if not lengths:
        missing = linear if not t_lin else softmax
        out.update(kind="unavailable",
                   statement=f"{head}: not available ({cases.label('attention', missing)}: "
                             f"{_status_reason(records, missing, causal, pass_)})")
        return out
    log_ratio = [math.log(t_lin[n] / t_soft[n]) for n in lengths]  # < 0: linear is faster
    out["ratios"] = {str(n): t_lin[n] / t_soft[n] for n in lengths}
    # the first index from which linear is faster at every longer length
    first = len(lengths)
    while first > 0 and log_ratio[first - 1] < 0:
        first -= 1
    if first == 0:
        out.update(kind="below_range", seq_len=lengths[0],
                   statement=f"{head}: linear is already faster at the shortest length measured, "
                             f"N={lengths[0]} ({t_soft[lengths[0]] / t_lin[lengths[0]]:.2f}x)")
    elif first < len(lengths):
        a, b = first - 1, first
        la, lb = math.log(lengths[a]), math.log(lengths[b])
        n_star = math.exp(la + (0 - log_ratio[a]) * (lb - la) / (log_ratio[b] - log_ratio[a]))
        out.update(kind="measured", seq_len=n_star,
                   statement=f"{head}: linear overtakes softmax at N ~ {n_star:,.0f} "
                             f"(between the measured N={lengths[a]} and N={lengths[b]}; "
                             f"{t_soft[lengths[-1]] / t_lin[lengths[-1]]:.2f}x faster at N={lengths[-1]})")
    else:
        n_last = lengths[-1]
        slope = None
        if len(lengths) >= 2:
            slope = (log_ratio[-1] - log_ratio[-2]) / (math.log(lengths[-1]) - math.log(lengths[-2]))
        if slope is not None and slope < -1e-3:
            n_star = n_last * math.exp(-log_ratio[-1] / slope)
            out.update(kind="extrapolated", seq_len=n_star,
                       statement=f"{head}: linear is still {t_lin[n_last] / t_soft[n_last]:.2f}x slower at the "
                                 f"longest length measured, N={n_last}; extrapolating the last two lengths, "
                                 f"it would overtake at N ~ {n_star:,.0f}")
        else:
            out.update(kind="not_reached",
                       statement=f"{head}: linear is slower at every length measured (up to N={n_last}, "
                                 f"{t_lin[n_last] / t_soft[n_last]:.2f}x) and the gap is not closing")
    return out


def crossovers(records):
    configs = sorted({(r["config"]["causal"], r["config"]["pass"]) for r in records if r["family"] == "attention"},
                     key=lambda c: (c[0], cases.PASSES.index(c[1]) if c[1] in cases.PASSES else 9))
    return [crossover(records, causal, pass_, lin, soft) for lin, soft in CROSSOVER_PAIRS
            for causal, pass_ in configs]


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def _ms(x):
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _cell(rec):
    if rec is None:
        return ""
    if rec["status"] != "ok" or not rec["time"]:
        return STATUS_TEXT.get(rec["status"], rec["status"])
    text = _ms(rec["time"]["median_ms"])
    if rec.get("speedup_vs_baseline"):
        text += f" ({rec['speedup_vs_baseline']:.2f}x)"
    return text


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def family_title(result, family):
    s = result["settings"]
    if family == "attention":
        return (f"Attention: batch {s['batch']}, {s['heads']} heads, head dim {s['head_dim']}, {result['dtype']}")
    if family == "layer_norm":
        return f"LayerNorm: {s['batch']} x N rows of width {s['ln_width']}, {result['dtype']}"
    return (f"Training step (AdamW, cross-entropy; source and target length N; batch {s['batch']}, "
            f"{result['dtype']})")


def pivot_tables(result):
    """One Markdown table per family: a row per (configuration, N), a column per implementation,
    cells = median time per call in ms (speed-up against the PyTorch counterpart)."""
    out = []
    records = result["cases"]
    for family in cases.FAMILIES:
        recs = [r for r in records if r["family"] == family]
        if not recs:
            continue
        impls = [i for i in cases.IMPLS[family] if any(r["impl"] == i for r in recs)]
        header = ["case", "N"] + [cases.label(family, i) for i in impls]
        rows, seen = [], []
        for r in recs:
            key = (r["config_label"], r["seq_len"])
            if key not in seen:
                seen.append(key)
        for config_label, n in seen:
            by_impl = {r["impl"]: r for r in recs if r["config_label"] == config_label and r["seq_len"] == n}
            rows.append([config_label, n] + [_cell(by_impl.get(i)) for i in impls])
        note = "ms per call, median; (Nx) = speed-up over the PyTorch counterpart"
        if family == "attention":
            note += " (softmax: torch SDPA, linear: PyTorch linear)"
        elif family == "train_step":
            params = {r["impl"]: r.get("parameters") for r in recs if r.get("parameters")}
            if params:
                note += "; parameters: " + ", ".join(f"{cases.label(family, i)} {p / 1e6:.2f} M"
                                                     for i, p in params.items())
        out.append((family, family_title(result, family), note, _md_table(header, rows)))
    return out


def _fmt_bytes(n):
    return "" if n is None else f"{n / 2**20:,.1f}"


def detail_table(result):
    ceil = result["ceilings"]
    header = ["family", "case", "N", "implementation", "status", "median ms", "IQR ms", "samples", "tokens/s",
              "GFLOP/s", "GB/s", "% of ceiling", "peak MiB", "vs PyTorch", "check error / bound", "note"]
    rows = []
    for r in result["cases"]:
        t = r["time"] or {}
        pct = ""
        if r.get("flops_per_s"):
            pct = f"{100 * r['flops_per_s'] / ceil['matmul']['flops_per_s']:.0f}% matmul"
        elif r.get("bytes_per_s"):
            pct = f"{100 * r['bytes_per_s'] / ceil['copy']['bytes_per_s']:.0f}% copy"
        check = "" if r["max_error"] is None else f"{r['max_error']:.1e} / {r['error_bound']:.1e}"
        rows.append([r["family"], r["config_label"], r["seq_len"], r["label"], r["status"],
                     _ms(t["median_ms"]) if t else "", f"{_ms(t['q1_ms'])}-{_ms(t['q3_ms'])}" if t else "",
                     t.get("samples", ""),
                     f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "",
                     f"{r['flops_per_s'] / 1e9:,.1f}" if r.get("flops_per_s") else "",
                     f"{r['bytes_per_s'] / 1e9:,.1f}" if r.get("bytes_per_s") else "", pct,
                     _fmt_bytes(r["peak_memory_bytes"]),
                     f"{r['speedup_vs_baseline']:.2f}x" if r.get("speedup_vs_baseline") else "", check,
                     r["note"].replace("|", "/")])
    return _md_table(header, rows)


def header_lines(result):
    d, v, c = result["device"], result["versions"], result["ceilings"]
    lines = [f"Device: {d['type']} - {d['name']} ({d['threads']} torch threads, {d['cpu_count']} CPUs); "
             f"dtype {result['dtype']}",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"Backend for ours: {result['backends']['selected'].get('attention')}",
             f"Measured ceilings: {c['matmul']['dtype']} matmul {c['matmul']['flops_per_s'] / 1e9:,.1f} GFLOP/s "
             f"({c['matmul']['size']}^3), copy {c['copy']['bytes_per_s'] / 1e9:,.1f} GB/s (read + write)"]
    load = result.get("load_average") or {}
    if load.get("start"):
        lines.append(f"Load average (1, 5, 15 min) at start {load['start']}, at end {load.get('end')} "
                     f"on {d['cpu_count']} CPUs" + (": a busy machine, noisy timings"
                                                    if load["start"][0] > (d["cpu_count"] or 1) else ""))
    if result.get("interrupted"):
        lines.append("INTERRUPTED: partial results")
    return lines


def console_text(result):
    parts = ["\n".join(header_lines(result))]
    for _, title, note, table in pivot_tables(result):
        parts.append(f"{title}\n({note})\n{table}")
    parts.append("\n".join(c["statement"] for c in result["crossovers"] if c["softmax"] == "ours_softmax")
                 or "Crossover: no attention cases were run")
    bad = [r for r in result["cases"] if r["status"] in ("wrong", "error")]
    if bad:
        parts.append("Failures:\n" + "\n".join(f"  {r['family']} {r['label']} [{r['config_label']}, N={r['seq_len']}]:"
                                                f" {r['status']}: {r['note']}" for r in bad))
    return "\n\n".join(parts)


def markdown(result, images):
    s = result["settings"]
    lines = [f"# transformer_fast benchmark: {result['device']['slug']}, {result['created']}", ""]
    lines += [f"- {line}" for line in header_lines(result)]
    lines += [f"- Command: `{result['command']}`",
              f"- Sequence lengths: {s['seq_lens']} (training step: {s['train_seq_lens']}); wall time "
              f"{result['wall_time_s']:.0f} s",
              f"- Time: {result['method']['time']}",
              f"- Memory: {result['method']['memory']}",
              f"- Check: {result['method']['check']}", "", "## Crossover", ""]
    lines += [f"- {c['statement']}" for c in result["crossovers"]] or ["- no attention cases were run"]
    for family, title, note, table in pivot_tables(result):
        lines += ["", f"## {title}", "", f"_{note}_", "", table]
        for path in images.get(family, []):
            lines += ["", f"![{family}]({os.path.basename(path)})"]
    lines += ["", "## All measurements", "", detail_table(result), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------
COLORS = {"naive": "tab:gray", "torch_sdpa": "tab:blue", "ours_softmax": "tab:red", "ours_linear": "tab:orange",
          "torch_linear": "tab:green", "torch": "tab:blue", "ours": "tab:red"}
# PyTorch's implementations drawn as hollow markers, ours as filled ones: told apart where lines overlap
MARKERS = {"naive": "x", "torch_sdpa": "o", "ours_softmax": "s", "ours_linear": "D", "torch_linear": "^",
           "torch": "o", "ours": "s"}
HOLLOW = {"torch_sdpa", "torch_linear", "torch"}


def _series(records, impl, config, key):
    pts = []
    for r in records:
        if r["impl"] == impl and r["config_label"] == config and r["status"] == "ok":
            value = key(r)
            if value:
                pts.append((r["seq_len"], value))
    return sorted(pts)


def _power_of_two_label(y, _pos=None):
    """A log-2 axis's label: 1/4, 1/2, 1, 2, 4, ..., 1024 as 1k."""
    if y <= 0:
        return ""
    if abs(math.log2(y) - round(math.log2(y))) > 1e-9:  # a tick between powers of two (a narrow range)
        return f"{y / 1024:.3g}k" if y >= 1024 else f"{y:.3g}"
    if y < 1:
        return f"1/{round(1 / y)}"
    return f"{round(y / 1024)}k" if y >= 1024 and round(y) % 1024 == 0 else f"{round(y)}"


def _log_axes(ax, xs, ys, ylabel, title):
    """Both axes in base 2, a tick at every power of two in the data's range (a decade of ms or MiB
    spans three or four of them, so even a narrow range gets several labelled ticks)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    if xs:
        ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)  # room for the implementations' offsets, even at one N
        ax.set_xticks(sorted(xs))
        ax.set_xticklabels([_power_of_two_label(x) for x in sorted(xs)], fontsize=8)
        ax.xaxis.set_minor_locator(NullLocator())
    if ys:
        low, high = math.floor(math.log2(min(ys))), math.ceil(math.log2(max(ys)))
        steps = (1, 1.25, 1.5, 1.75) if high - low < 3 else (1,)  # within two powers of two: quarters too
        ax.yaxis.set_major_locator(FixedLocator([2.0 ** e * f for e in range(low, high + 1) for f in steps]))
        ax.set_ylim(2.0 ** low / 1.1, 2.0 ** high * 1.1)
    ax.yaxis.set_major_formatter(FuncFormatter(_power_of_two_label))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


def _time_ms(r):
    return r["time"]["median_ms"] if r["time"] else None


def _mem_mib(r):
    return r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] else None


def plot_family(result, family, path, metric):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result["cases"] if r["family"] == family]
    configs = []
    for r in records:
        if r["config_label"] not in configs:
            configs.append(r["config_label"])
    key, ylabel = (_time_ms, "time per call (ms)") if metric == "time" else (_mem_mib, "peak memory (MiB)")
    if family == "attention":
        cols = sorted({r["config"]["causal"] for r in records})
        rows = [p for p in cases.PASSES if any(r["config"]["pass"] == p for r in records)]
        fig, axes = plt.subplots(len(rows), len(cols), figsize=(6 * len(cols), 4.2 * len(rows)), squeeze=False)
        panels = []
        for i, p in enumerate(rows):
            for j, c in enumerate(cols):
                label = f"{'causal' if c else 'non-causal'}, {p}"
                panels.append((axes[i][j], [label], label, (c, p)))
    elif family == "layer_norm":  # a panel per pass, a line per implementation and residual or not
        passes = [p for p in cases.PASSES if any(r["config"].get("pass") == p for r in records)]
        fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.5), squeeze=False)
        panels = [(axes[0][j], [c for c in configs if c.endswith(", " + p)], p, None) for j, p in enumerate(passes)]
    else:
        fig, axes = plt.subplots(1, 1, figsize=(7.5, 5), squeeze=False)
        panels = [(axes[0][0], configs, configs[0] if len(configs) == 1 else "", None)]
    any_data = False
    impls = cases.IMPLS[family]
    for ax, panel_configs, title, attn_config in panels:
        xs, ys = set(), []
        styles = ["-", "--", ":", "-."]
        for ci, config in enumerate(panel_configs):
            for k, impl in enumerate(impls):
                pts = _series(records, impl, config, key)
                if not pts:
                    continue
                any_data = True
                xs.update(x for x, _ in pts)
                ys += [y for _, y in pts]
                extra = config.rsplit(", ", 1)[0] if family == "layer_norm" else config
                name = cases.label(family, impl) + ("" if len(panel_configs) == 1 else f" [{extra}]")
                # lines that coincide stay visible: each implementation a few percent to the side
                shift = 2 ** (0.05 * (k - (len(impls) - 1) / 2))
                color = COLORS.get(impl)
                ax.plot([x * shift for x, _ in pts], [y for _, y in pts], styles[ci % len(styles)],
                        marker=MARKERS.get(impl, "o"), markersize=6 if impl in HOLLOW else 5, color=color,
                        alpha=0.8, label=name,
                        markerfacecolor="white" if impl in HOLLOW else color)
        if attn_config is not None and metric == "time":
            for c in result["crossovers"]:
                if (c["causal"], c["pass"]) == attn_config and c["softmax"] == "ours_softmax" and c["seq_len"] \
                        and c["kind"] == "measured":
                    ax.axvline(c["seq_len"], color="black", linestyle=":", linewidth=1)
                    ax.annotate(f" crossover\n N~{c['seq_len']:,.0f}", (c["seq_len"], 0.82),
                                xycoords=("data", "axes fraction"), fontsize=8, ha="left")
        _log_axes(ax, xs, ys, ylabel, title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    title = {"attention": "Attention", "layer_norm": "LayerNorm", "train_step": "Training step"}[family]
    fig.suptitle(f"{title} {metric} vs N, {result['device']['slug']} ({result['dtype']}); lower is better",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return any_data


def _finite(obj):
    """JSON has no inf/nan: they are written as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_all(result, out_dir, stem, plots=True):
    os.makedirs(out_dir, exist_ok=True)
    images = {}
    if plots:
        for family in cases.FAMILIES:
            if not any(r["family"] == family for r in result["cases"]):
                continue
            for metric in ("time", "memory"):
                if metric == "memory" and not any(r["peak_memory_bytes"] for r in result["cases"]
                                                  if r["family"] == family):
                    continue
                path = os.path.join(out_dir, f"{stem}-{family}-{metric}.png")
                if plot_family(result, family, path, metric):
                    images.setdefault(family, []).append(path)
                elif os.path.exists(path):
                    os.remove(path)
    result["images"] = [os.path.basename(p) for ps in images.values() for p in ps]
    json_path = os.path.join(out_dir, f"{stem}.json")
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump(_finite(result), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown(result, images))
    return [json_path, md_path] + [p for ps in images.values() for p in ps]


# --------------------------------------------------------------------------------------------
# Suite records (the target suites and the gpu suite)
# --------------------------------------------------------------------------------------------
def header_block(result):
    """The Markdown head of a suite's record: what ran where, when, with which versions."""
    d, v = result.get("device") or {}, result["versions"]
    lines = [f"# {result['suite']}: {d.get('name', 'no GPU')}, {result['created']}", "",
             f"- Device: {d.get('type')} - {d.get('name')} ({d.get('cpu_count')} CPUs)",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"- Command: `{result['command']}`"]
    load = result.get("load_average") or {}
    if load.get("start"):
        lines.append(f"- Load average at start {load['start']}, at end {load.get('end')}")
    if result.get("smoke"):
        lines.append("- SMOKE RUN: tiny sizes, the numbers mean nothing")
    return lines + [""]


def write_suite(result, out_dir, stem, markdown_fn):
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump(_finite(result), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown_fn(result))
    return [json_path, md_path]


def write_index(folder):
    from . import tables

    path = os.path.join(folder, "INDEX.md")
    with open(path, "w") as f:
        f.write(tables.index_markdown(folder))
    return path


def main(argv=None):
    import argparse
    import sys

    from . import summary, tables

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=summary.RESULTS, help="the results folder")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated file is stale")
    args = p.parse_args(argv)
    wanted = {os.path.join(args.results, "INDEX.md"): lambda _old: tables.index_markdown(args.results),
              os.path.join(root, "README.md"):
                  lambda old: tables.replace_block(old, tables.headline_summary(args.results)),
              os.path.join(root, "docs", "performance.md"):
                  lambda old: tables.replace_block(old, tables.performance_block(args.results))}
    stale = []
    for path, make in wanted.items():
        old = open(path).read() if os.path.exists(path) else ""
        new = make(old)
        if new != old:
            stale.append(os.path.relpath(path, root))
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
