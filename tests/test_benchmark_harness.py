"""The benchmark harness on tiny sizes: the command (benchmarks/run.py) and its suites, the pieces
that decide what gets reported (the correctness gate, the crossover statement), and the report
tool that turns the committed results into the index and the README's tables."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is run from the repository root, not installed

from benchmarks import cases, report, summary, tables  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One thread: on a busy 2-core machine, two OpenMP threads make every tiny op wait ~20 ms at a barrier.
TINY = ["--device", "cpu", "--dtype", "float32", "--seq-lens", "16", "32", "--batch", "1", "--heads", "2",
        "--head-dim", "16", "--repeats", "2", "--min-repeats", "2", "--budget", "0", "--min-sample-ms", "0",
        "--train-seq-lens", "8", "--train-d-model", "16", "--train-heads", "2", "--train-layers", "1",
        "--train-vocab", "11", "--no-progress", "--threads", "1"]


def _bench(*args, timeout=600):
    """Runs the command exactly as a user does (a subprocess from the repository root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "TRANSFORMER_FAST_BENCH_NO_REEXEC"}
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


CPU_SUITES = ("attention", "layer_norm", "train_step", "target_cpu_attention", "target_cpu_layer_norm",
              "target_cpu_linear_attention", "host", "models", "linear_state", "varlen", "distributed")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Every CPU suite in one run of the command, as a user runs it."""
    out = tmp_path_factory.mktemp("bench")
    proc = _bench(*TINY, "--smoke", "--only", ",".join(CPU_SUITES), "--out", str(out), "--name", "smoke")
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out / "smoke.json") as f:
        result = json.load(f)
    return out, proc.stdout, result


def test_json_is_well_formed(harness):
    _, _, result = harness
    assert result["schema_version"] == 1
    assert result["device"]["type"] == "cpu" and result["device"]["name"] and result["device"]["slug"] == "cpu"
    assert result["versions"]["torch"] == torch.__version__ and result["versions"]["transformer_fast"]
    assert result["dtype"] == "float32"
    assert result["ceilings"]["matmul"]["flops_per_s"] > 0 and result["ceilings"]["copy"]["bytes_per_s"] > 0
    # the command re-executed itself with the malloc settings that keep big outputs off fresh maps
    assert result["environment"]["MALLOC_MMAP_MAX_"] == "0"
    assert result["settings"]["seq_lens"] == [16, 32] and result["settings"]["heads"] == 2

    cases_ = result["cases"]
    expected = {(f, i) for f in ("attention", "layer_norm", "train_step") for i in cases.IMPLS[f]}
    assert {(c["family"], c["impl"]) for c in cases_} == expected
    # attention: 2 lengths x causal or not x fwd, fwd+bwd; LayerNorm: x residual or not; training: 1 length
    assert len(cases_) == 5 * 8 + 2 * 8 + 3 * 1
    for c in cases_:
        assert c["status"] in ("ok", "wrong", "error", "skipped", "n/a")
        assert c["status"] != "wrong", f"{c['label']} gave a wrong result: {c['note']}"
        if c["status"] == "ok":
            assert c["correct"] is True and c["max_error"] <= c["error_bound"]
            assert c["time"]["median_ms"] > 0 and c["time"]["samples"] >= 2
            assert c["time"]["q1_ms"] <= c["time"]["median_ms"] <= c["time"]["q3_ms"]
            assert c["tokens_per_s"] > 0
            assert isinstance(c["peak_memory_bytes"], int) and c["peak_memory_bytes"] >= 0
        else:
            assert c["time"] is None and c["note"], c  # reported with a reason, never timed
        if c["status"] == "error":  # only a kernel that is still a placeholder may fail to run
            assert "not implemented" in c["note"], c
    # the plain PyTorch implementations always run, and are checked before timing
    for family, impl in [("attention", "naive"), ("attention", "torch_sdpa"), ("attention", "torch_linear"),
                         ("layer_norm", "torch"), ("train_step", "torch")]:
        assert all(c["status"] == "ok" for c in cases_ if (c["family"], c["impl"]) == (family, impl)), (family, impl)
    # the naive reference materialises N x N: its measured peak grows with N
    naive = {c["seq_len"]: c["peak_memory_bytes"] for c in cases_
             if c["impl"] == "naive" and c["config"] == {"causal": False, "pass": "fwd"}}
    assert naive[32] > naive[16] > 0
    ours = [c for c in cases_ if c["impl"] == "ours_softmax" and c["status"] == "ok"]
    assert all(c.get("speedup_vs_baseline", 0) > 0 for c in ours)

    statements = [c["statement"] for c in result["crossovers"]]
    assert len(statements) == 2 * 4  # (ours vs ours, ours vs torch SDPA) x causal or not x fwd, fwd+bwd
    assert all(s.startswith("Crossover (") for s in statements)


def test_markdown_table_and_plots(harness):
    out, stdout, result = harness
    md = (out / "smoke.md").read_text()
    assert "## Crossover" in md and "Crossover (causal, forward)" in md
    assert "| case | N | naive reference | torch SDPA | ours softmax | ours linear | PyTorch linear |" in md
    assert "| non-causal, fwd | 16 |" in md and "| causal, fwd+bwd | 32 |" in md
    assert "## All measurements" in md
    # the method as prose: no heading repeated after its label, no reStructuredText double backticks
    assert "- Time: CPU: the implementations" in md and "- Memory: CUDA: `torch.cuda" in md
    assert "Time: Time." not in md and "``" not in md
    pngs = sorted(out.glob("smoke-*.png"))
    names = {p.name for p in pngs}
    assert {"smoke-attention-time.png", "smoke-attention-memory.png", "smoke-layer_norm-time.png",
            "smoke-train_step-time.png"} <= names
    assert set(result["images"]) == names
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png  # a real figure, not an empty file
        assert f"]({png.name})" in md
    # the console: the table and the crossover statements
    assert "Crossover (non-causal, forward):" in stdout and "Crossover (causal, forward+backward):" in stdout
    assert "| non-causal, fwd | 16 |" in stdout


def test_progress_in_a_log_is_plain_lines():
    """Where stderr is not a terminal (a log, CI), one line per case instead of a progress bar's
    carriage returns."""
    tiny = [a for a in TINY if a != "--no-progress"]
    proc = _bench(*tiny, "--smoke", "--only", "layer_norm", "--no-plots", "--out", "/tmp", "--name", "progress-check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    n = len(lines)
    assert "\r" not in proc.stderr and n >= 2 and lines[0].startswith(f"[1/{n}] layer_norm"), proc.stderr[-2000:]
    assert lines[-1].startswith(f"[{n}/{n}] "), lines


def test_log_axes_tick_every_power_of_two():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([128, 256, 512], [0.3, 2.0, 20.0])
    report._log_axes(ax, {128, 256, 512}, [0.3, 2.0, 20.0], "ms", "t")
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["1/4", "1/2", "1", "2", "4", "8", "16", "32"], labels
    ax.cla()
    report._log_axes(ax, {128, 256}, [19.0, 21.0], "MiB", "t")  # within a power of two: quarters labelled too
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()][:6] == ["16", "20", "24", "28", "32", "40"]
    plt.close(fig)


def test_best_figure_of_a_group():
    assert tables._best([(1.2, "a"), (0.8, "b")]) == "**1.20x** (a); 0.80-1.20x over 2 cases"
    assert tables._best([(3.0, "only")]) == "**3.00x** (only)"
    assert tables._best([(None, "not run")]) is None


def committed_results(tmp_path):
    """benchmarks/results/ as the repository holds it: a copy of its files that git tracks, where it
    is a git checkout. The README's benchmark command writes its own run there too, untracked, and
    running the tests after it (the README's two commands in turn) must not count that run."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=REPO, check=True,
                                 capture_output=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        return Path(summary.RESULTS)
    tracked = [name for name in tracked if name]
    if not tracked:  # not a git checkout (an unpacked source tree): the folder as it is
        return Path(summary.RESULTS)
    for name in tracked:
        (tmp_path / Path(name).name).write_bytes((REPO / name).read_bytes())
    return tmp_path


def test_results_folder_keeps_what_the_index_lists(tmp_path):
    """benchmarks/results/ keeps the latest run per device and suite, at most 30 files: each is
    listed in INDEX.md (a sweep's plots through its Markdown), older runs are in git history."""
    folder = committed_results(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    index = (folder / "INDEX.md").read_text()
    linked = {n for n in names if f"]({n})" in index}
    plots = {n for n in names if n.endswith(".png") and any(
        f"]({n})" in (folder / m).read_text() for m in linked if m.endswith(".md"))}
    json_twins = {n for n in names if n.endswith(".json") and n[:-5] + ".md" in linked}
    assert len(names) <= 30, names
    assert set(names) - {"INDEX.md"} - linked - plots - json_twins == set()
    assert "git log --diff-filter=D" in index


def test_readme_headline_is_short_and_names_its_results():
    readme = (REPO / "README.md").read_text()
    block = readme.split(tables.BEGIN)[1].split(tables.END)[0].strip().splitlines()
    assert 3 <= len(block) <= 25, len(block)
    rows = [line for line in block if line.startswith("| ") and "](" in line]
    assert rows and all((Path(summary.RESULTS) / link.split("](benchmarks/results/")[1].split(")")[0]).exists()
                        for row in rows for link in row.split("[`")[1:]), rows
    performance = (REPO / "docs" / "performance.md").read_text()
    assert performance.count("\n| ") > 3 * len(rows)  # the full tables live there


class _Args:
    max_call_seconds, no_memory, repeats, min_repeats, budget, min_sample_ms = 100.0, False, 3, 3, 0.0, 0.0


def test_a_wrong_implementation_is_reported_not_timed(monkeypatch):
    real = cases.attention_output

    def broken(impl, q, k, v, causal):
        out = real(impl, q, k, v, causal)
        return out * 1.01 if impl == "torch_sdpa" else out  # a 1% error

    monkeypatch.setattr(cases, "attention_output", broken)
    for pass_ in cases.PASSES:
        group = cases.AttentionGroup(33, {"causal": True, "pass": pass_}, ["naive", "torch_sdpa"], torch.float32,
                                     "cpu", batch=1, heads=2, head_dim=16)
        records = {r["impl"]: r for r in bench_run.run_group(group, _Args, torch.device("cpu"), 2**40, {})}
        assert records["torch_sdpa"]["status"] == "wrong" and records["torch_sdpa"]["correct"] is False
        assert records["torch_sdpa"]["time"] is None and "correctness" in records["torch_sdpa"]["note"]
        assert records["naive"]["status"] == "ok" and records["naive"]["time"]["median_ms"] > 0
        assert "speedup_vs_baseline" not in records["naive"]  # no timed baseline: no ratio


def test_a_wrong_gradient_is_caught(monkeypatch):
    class ScaledGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    real = cases.attention_output
    monkeypatch.setattr(cases, "attention_output",
                        lambda impl, q, k, v, c: real(impl, ScaledGrad.apply(q), k, v, c) if impl == "torch_linear"
                        else real(impl, q, k, v, c))
    group = cases.AttentionGroup(17, {"causal": False, "pass": "fwd+bwd"}, ["torch_linear"], torch.float32, "cpu",
                                 batch=1, heads=2, head_dim=16)
    group.setup()
    ok, err, bound, note = group.check("torch_linear")
    assert not ok and "grad query" in note and err > bound
    fwd = cases.AttentionGroup(17, {"causal": False, "pass": "fwd"}, ["torch_linear"], torch.float32, "cpu",
                               batch=1, heads=2, head_dim=16)
    fwd.setup()
    assert fwd.check("torch_linear")[0]  # the forward alone is right


def _synthetic(times_linear, times_softmax, causal=False, pass_="fwd"):
    recs = []
    for impl, times in (("ours_linear", times_linear), ("ours_softmax", times_softmax)):
        for n, t in times.items():
            recs.append({"family": "attention", "impl": impl, "config": {"causal": causal, "pass": pass_},
                         "seq_len": n, "status": "ok", "time": {"median_ms": t}, "note": ""})
    return recs


def test_crossover_statement():
    lengths = [256, 512, 1024, 2048, 4096]
    # softmax ~ N^2, linear ~ 1000 N: they meet at N = 1000
    got = report.crossover(_synthetic({n: 1000.0 * n for n in lengths}, {n: float(n * n) for n in lengths}), False, "fwd")
    assert got["kind"] == "measured" and math.isclose(got["seq_len"], 1000, rel_tol=1e-9)
    assert "overtakes softmax at N ~ 1,000" in got["statement"]
    # not reached in the measured range: extrapolated from the last two lengths
    got = report.crossover(_synthetic({n: 10000.0 * n for n in lengths}, {n: float(n * n) for n in lengths}),
                           False, "fwd")
    assert got["kind"] == "extrapolated" and math.isclose(got["seq_len"], 10000, rel_tol=1e-9)
    # a noisy win at one length does not count: linear must stay faster from there on
    lin = {256: 1.0, 512: 3.0, 1024: 3.0, 2048: 1.0, 4096: 1.0}
    soft = {256: 2.0, 512: 2.0, 1024: 2.0, 2048: 2.0, 4096: 2.0}
    got = report.crossover(_synthetic(lin, soft), False, "fwd")
    assert got["kind"] == "measured" and 1024 < got["seq_len"] < 2048
    # faster only in the middle: not a crossover; faster everywhere; a failed kernel gives a reason
    assert report.crossover(_synthetic(soft, lin), False, "fwd")["kind"] == "not_reached"
    assert report.crossover(_synthetic(lin, {n: 10.0 for n in lengths}), False, "fwd")["kind"] == "below_range"
    failed = _synthetic(lin, {})
    failed.append({"family": "attention", "impl": "ours_softmax", "config": {"causal": False, "pass": "fwd"},
                   "seq_len": 256, "status": "error", "time": None, "note": "RuntimeError: boom"})
    got = report.crossover(failed, False, "fwd")
    assert got["kind"] == "unavailable" and "boom" in got["statement"]


def test_torch_linear_attention_baseline_matches_reference():
    q, k, v = (torch.randn(2, 3, 19, 5, dtype=torch.float64) for _ in range(3))
    from transformer_fast import reference

    for causal in (False, True):
        torch.testing.assert_close(cases.torch_linear_attention(q, k, v, causal).double(),
                                   reference.linear_attention(q, k, v, is_causal=causal), rtol=1e-5, atol=1e-6)


def test_only_selects_families_and_implementations(capsys):
    args = bench_run.parse_args(["--only", "attention", "ours_softmax"])
    assert args.families == ["attention"] and args.impls["attention"] == ["ours_softmax"]
    args = bench_run.parse_args(["--only", "ours_linear", "layer_norm:ours"])
    assert args.families == ["attention", "layer_norm", "train_step"]
    assert args.impls["layer_norm"] == ["ours"] and args.impls["attention"] == ["ours_linear"]
    assert bench_run.parse_args([]).families == list(cases.FAMILIES)
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--only", "nonsense"])
    assert "unknown name 'nonsense'" in capsys.readouterr().err


def test_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_run.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for suite in bench_run.SUITES:
        assert f"  {suite} " in text, suite
    assert set(bench_run.TARGETS) | set(cases.FAMILIES) | {"gpu"} == set(bench_run.SUITES)


def test_only_takes_suites_comma_separated():
    args = bench_run.parse_args(["--only", "target_cpu_attention,layer_norm", "target_cpu_layer_norm"])
    assert args.targets == ["target_cpu_attention", "target_cpu_layer_norm"] and args.families == ["layer_norm"]
    args = bench_run.parse_args(["--only", "target_cpu_linear_attention"])
    assert args.families == [] and args.targets == ["target_cpu_linear_attention"] and not args.gpu
    assert bench_run.parse_args(["--only", "gpu"]).gpu


def test_cpu_target_suites_write_their_results(harness):
    """The three CPU target suites on tiny shapes: each checks, times and writes JSON and Markdown."""
    out, _, _ = harness
    results = {}
    for suite in ("target_cpu_attention", "target_cpu_layer_norm", "target_cpu_linear_attention"):
        with open(out / f"smoke-{suite}.json") as f:
            results[suite] = json.load(f)
        assert results[suite]["suite"] == suite and results[suite]["smoke"] is True
        assert (out / f"smoke-{suite}.md").read_text().startswith(f"# {suite}:")
    rows = results["target_cpu_attention"]["result"]["rows"]
    assert [r["case"] for r in rows] == list(summary.CPU_CASES)
    assert all(r["status"] == "ok" and r["ratio"] > 0 and r["max_error"] <= r["error_bound"] for r in rows)
    ln = results["target_cpu_layer_norm"]["result"]
    assert ln["status"] == "ok" and ln["forward_ratio"] > 0 and ln["copy_gb_per_s"] > 0
    la = results["target_cpu_linear_attention"]["result"]
    assert set(la["passes"]) == {"forward", "forward+backward"} and set(la["crossover_vs_sdpa"]) == {"causal",
                                                                                                  "non-causal"}
    # smoke runs never count as results
    assert summary.load_all(str(out)) == []


def test_distributed_suite_checks_and_times_every_mode(harness):
    """Two gloo processes: every context-parallel mode checked against the one-process run, then
    timed forward and forward+backward, with memory, bytes sent and a profile per rank."""
    out, _, _ = harness
    result = json.loads((out / "smoke-distributed.json").read_text())
    body = result["result"]
    assert result["suite"] == "distributed" and body["world"] == 2
    from benchmarks import distributed
    assert list(body["checks"]) == list(distributed.IMPLS)
    assert all(c["ok"] and c["max_error"] <= c["error_bound"] for c in body["checks"].values()), body["checks"]
    rows = body["rows"]
    assert {(r["impl"], r["pass"]) for r in rows} == {(i, p) for i in distributed.IMPLS
                                                      for p in ("forward", "forward+backward")}
    for r in rows:
        assert r["status"] == "ok" and r["efficiency"] > 0 and r["memory_ratio"] > 0, r
        assert len(r["bytes_sent_per_rank"]) == 2 and min(r["bytes_sent_per_rank"]) >= r["ideal_bytes_per_rank"], r
        assert all(p["compute_ms"] >= 0 for p in r["profile_per_rank"]), r
    assert (out / "smoke-distributed.md").read_text().startswith("# distributed:")


def test_linear_state_suite_checks_and_times_each_variant(harness):
    out, _, _ = harness
    result = json.loads((out / "smoke-linear_state.json").read_text())
    body = result["result"]
    assert result["suite"] == "linear_state" and body["status"] == "ok"
    assert list(body["checks"]) == ["no state", "state in, out", "two calls"]
    assert all(c["ok"] and c["max_error"] <= c["error_bound"] for c in body["checks"].values())
    for row in body["passes"].values():
        assert row["no state"]["ms"] > 0
        assert all(row[v]["ratio_to_no_state"] > 0 and isinstance(row[v]["met"], bool) for v in ("state in, out",
                                                                                                 "two calls"))
    assert (out / "smoke-linear_state.md").read_text().startswith("# linear_state:")


def test_linear_state_check_catches_a_wrong_state(monkeypatch):
    from benchmarks import linear_state

    q, k, v, S0, z0 = linear_state._inputs(1, 2, 40, 8, 0)
    rows = cases.check_rows(40)
    assert linear_state.check("two calls", q, k, v, S0, z0, rows)[0]
    original = linear_state._call
    monkeypatch.setattr(linear_state, "_call", lambda *a: (lambda o, S, z: (o, S, z * 1.001))(*original(*a)))
    assert not linear_state.check("state in, out", q, k, v, S0, z0, rows)[0]


def test_varlen_suite_checks_and_times_each_case(harness):
    """The pack, the window and every decoding shape (with GQA and without) are checked against
    float64 and timed; the generated tables give each decoding shape its own row."""
    out, _, _ = harness
    result = json.loads((out / "smoke-varlen.json").read_text())
    body = result["result"]
    assert result["suite"] == "varlen"
    for part in (body["pack"], body["window"], *body["decode"]["rows"]):
        assert part["status"] == "ok" and part["max_error"] <= part["error_bound"], part
    for r in (*body["pack"]["rows"], *body["window"]["rows"], *body["decode"]["rows"]):
        assert r["torch_ms"] > 0 and r["ours_ms"] > 0 and r["ratio"] > 0 and isinstance(r["met"], bool), r
    decode = body["decode"]["rows"]
    assert {r["dtype"] for r in decode} == {"float32", "bfloat16"}
    assert {r["case"].split()[1] for r in decode} == {"float32", "bfloat16", "MHA"}
    shapes = list(dict.fromkeys(r["shape"] for r in decode))
    assert len(shapes) == 2 and "Hk=2" in shapes[0] and "H=4 Hk=4" in shapes[1]
    entry = {"data": body, "created": result["created"], "file": "smoke-varlen.json"}
    table_rows = [row[0] for row in tables._varlen_rows(entry, "")]
    assert [row for row in table_rows if row.startswith("one decoding step")] == [
        f"one decoding step, {shape}: against `F.sdpa` (`enable_gqa=True`)" for shape in shapes]
    assert (out / "smoke-varlen.md").read_text().startswith("# varlen:")


def test_varlen_check_catches_a_wrong_output():
    from benchmarks import varlen
    from transformer_fast import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    exact = reference.scaled_dot_product_attention(q.double(), k.double(), v.double())
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert varlen._check(theirs.clone(), theirs, exact, torch.float32)[0]
    assert not varlen._check(theirs * 1.001, theirs, exact, torch.float32)[0]


HOST_FUNCTIONS = ("scaled_dot_product_attention", "scaled_dot_product_attention causal",
                  "scaled_dot_product_attention key_padding_mask", "layer_norm", "layer_norm residual", "rms_norm",
                  "linear_attention", "linear_attention causal", "linear_attention_step")


def test_host_suite_times_every_public_function(harness):
    out, _, _ = harness
    result = json.loads((out / "smoke-host.json").read_text())
    assert result["suite"] == "host" and result["result"]["threads"] == 1
    rows = result["result"]["rows"]
    assert [(r["function"], r["pass"]) for r in rows] == [(f, p) for f in HOST_FUNCTIONS for p in ("forward",
                                                                                                      "fwd+bwd")]
    for r in rows:
        assert r["status"] == "ok" and r["max_error"] <= r["error_bound"], r
        assert r["torch_us"] > 0 and r["ours_us"] > 0 and r["ratio"] > 0 and isinstance(r["met"], bool)
        assert r["calls_per_sample"] >= 1 and r["rounds"] >= 2
    md = (out / "smoke-host.md").read_text()
    assert md.startswith("# host:") and "| layer_norm residual |" in md and "rows meet their target" in md


def test_host_check_catches_a_wrong_function():
    import torch.nn.functional as F

    from benchmarks import host

    x, w, b = torch.randn(8, 64), torch.randn(64), torch.randn(64)
    from transformer_fast import reference

    def exact(x_, w_, b_):
        return reference.layer_norm(x_, (64,), w_, b_)

    def plain(x_, w_, b_):
        return F.layer_norm(x_, (64,), w_, b_)

    assert host.check(plain, plain, exact, (x, w, b))[0]
    ok, err, bound, note = host.check(lambda *a: plain(*a) * 1.01, plain, exact, (x, w, b))
    assert not ok and err > bound and "output 0" in note

    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    ok, _, _, note = host.check(lambda x_, w_, b_: plain(WrongGrad.apply(x_), w_, b_), plain, exact, (x, w, b))
    assert not ok and note.startswith("grad 0")


def test_models_suite_checks_and_times_each_model(harness):
    out, _, _ = harness
    result = json.loads((out / "smoke-models.json").read_text())
    body = result["result"]
    assert result["suite"] == "models" and body["preset"] == "smoke" and body["dtypes"] == ["float32"]
    # the rates the bfloat16 skip predictor scales float32 times by, per kind of case
    assert set(body["linear_gflops"]) == {"float32", "bfloat16"}
    assert all(r["forward"] > 0 and r["train"] > 0 for r in body["linear_gflops"].values())
    rows = {(r["model"], r.get("case"), r.get("batch")): r for r in body["rows"]}
    encdec = rows[("encdec", "train step", 1)]
    try:
        import transformers  # noqa: F401
    except ImportError:  # the Hugging Face models are skipped with the reason; the encoder-decoder still runs
        skipped = [r for r in body["rows"] if r["status"] == "skipped"]
        assert {r["model"] for r in skipped} == {"bert", "llama"}
        assert all("transformers is not installed" in r["note"] for r in skipped)
    else:
        assert set(rows) == {("bert", "forward", 2), ("bert", "train step", 2), ("llama", "train step", 2),
                             ("llama", "generate 4 tokens", 1), ("llama", "generate 4 tokens", 2),
                             ("encdec", "train step", 1)}
        assert rows[("llama", "generate 4 tokens", 2)]["tokens"] == 2 * 4
        assert 0 <= rows[("llama", "generate 4 tokens", 1)]["same_greedy_tokens"] <= 1
        assert rows[("bert", "forward", 2)]["converted"] == ["LayerNorm"]  # convert swapped BERT's norms
    for r in body["rows"]:
        if r["status"] == "skipped":
            continue
        assert r["status"] == "ok" and r["max_error"] <= r["error_bound"], r
        assert r["sdpa_ms"] > 0 and r["ours_ms"] > 0 and r["ratio"] > 0 and r["tokens_per_s_ours"] > 0
        assert r["ratio_low"] <= r["ratio"] <= r["ratio_high"], r
        assert r["below_target_at_95"] == (r["ratio_high"] < r["target_ratio"])
        if r["model"] != "encdec":  # the control: the sdpa model against its deep copy
            low, high = r["twin_interval"]
            assert low <= r["twin_ratio"] <= high and r["twin_ratio"] > 0, r
        assert 0 < r["share_attention"] < 1 and 0 < r["share_norms"] < 1, r
        assert r["target_ratio"] == (1.15 if r["share_attention"] + r["share_norms"] >= 0.4 else 1.0)
    assert encdec["status"] == "ok"
    md = (out / "smoke-models.md").read_text()
    assert md.startswith("# models:") and "| encdec | train step | 1 | 8 | float32 |" in md


def test_paired_ratio_interval_is_the_binomial_order_statistics():
    """The ranks of the distribution-free 95% interval for a median (any statistics table): n = 10
    -> 2nd and 9th ratios, 25 -> 8th and 18th, 50 -> 18th and 33rd; below 6 rounds, the range."""
    from benchmarks import measure

    for n, (low, high) in {5: (1, 5), 6: (1, 6), 10: (2, 9), 25: (8, 18), 50: (18, 33)}.items():
        ratios = [float(r) for r in range(n, 0, -1)]  # base times n .. 1 against a constant: ratios n .. 1
        times = {"base": {"samples_ms": ratios}, "impl": {"samples_ms": [1.0] * n}}
        assert measure.paired_ratio_interval(times, "base", "impl") == (low, high), n
        assert low <= measure.paired_ratio(times, "base", "impl") <= high


def test_profiled_pieces_attribute_forward_and_backward():
    """Attention by operator, a norm module by its forward scope and the backward of what it ran
    (matched by autograd sequence number). Sleeps make the expected shares hold on a busy machine:
    the norm's backward sleeps 50 ms, the model 20 ms outside both."""
    import time

    from benchmarks import models

    class SlowGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.05)
            return g * 2

    class SlowLayerNorm(torch.nn.Module):
        def forward(self, x):
            return SlowGrad.apply(x)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = SlowLayerNorm()

        def forward(self, x):
            time.sleep(0.02)
            return torch.nn.functional.scaled_dot_product_attention(x, x, x) + self.norm(x)

    model = Block()
    x = torch.randn(1, 2, 256, 64, requires_grad=True)

    def forward_only():
        with torch.no_grad():
            model(x)

    def train():
        model(x).sum().backward()

    def shares(fn):
        fn()  # warm
        ms = models.profiled_pieces(model, fn)
        return {k: ms[k] / ms["total"] for k in ("attention", "norms")}

    fwd, both = shares(forward_only), shares(train)
    assert 0 < fwd["attention"] < 0.9 and 0 <= fwd["norms"] < 0.2, fwd
    assert 0 < both["attention"] < 0.7 and 0.25 < both["norms"] < 0.9, both  # the backward's sleep is the norm's
    assert both["attention"] + both["norms"] < 0.9  # the 20 ms outside is neither


def test_model_output_check_bound():
    from benchmarks import models

    exact = torch.randn(2, 5, 7, dtype=torch.float64)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    ref = exact.float()
    assert models._compare(ref, ref, exact, valid, torch.float32)[0]
    assert not models._compare(ref * 1.01, ref, exact, valid, torch.float32)[0]
    wrong_padding = ref.clone()
    wrong_padding[1, 4] += 1.0  # a padded position: not compared
    assert models._compare(wrong_padding, ref, exact, valid, torch.float32)[0]
    assert not models._compare(torch.full_like(ref, float("nan")), ref, exact, valid, torch.float32)[0]


def test_install_check_runs_every_family_against_the_reference():
    """The gpu suite's install check, on the CPU: every family in every dtype within the bound,
    and a kernel 1% off is caught."""
    from benchmarks import gpu_suite

    checks = gpu_suite.family_checks(torch.device("cpu"))
    assert set(checks) == {f"{f} {d}" for f in ("attention", "linear_attention", "layer_norm")
                           for d in ("float16", "bfloat16", "float32")}
    assert all(c["ok"] for c in checks.values()), checks
    exact = torch.randn(5, dtype=torch.float64)
    assert not gpu_suite._check(exact * 1.01, exact, exact.float())["ok"]


def test_gpu_suite_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench_run.main(["--only", "gpu", "--gpu-steps", "install"]) == 1
    captured = capsys.readouterr()
    assert "CUDA is not available" in captured.out and "no CUDA GPU here" in captured.err


ATTENTION_LOG = """float32 B=1 H=8 N=2048 D=64, 2 threads, 15 interleaved pairs
case                    torch ms   ours ms   ratio
forward                     59.6      50.0    1.18
fwd+bwd                    196.2     161.5    1.23

case                    torch ms   ours ms   ratio
forward                     72.8      55.9    1.15
fwd+bwd                    217.3     181.5    1.24
## bf16
forward 1.05, causal 0.96, padded 1.51; fwd+bwd 1.88, causal 2.01, padded 2.65
"""


def test_text_results_are_parsed_per_run():
    rows = summary.parse_attention_log(ATTENTION_LOG)["rows"]
    fp32 = [(r["case"], r["ratio"], r["run"]) for r in rows if r["dtype"] == "float32"]
    assert fp32 == [("forward", 1.18, 0), ("fwd+bwd", 1.23, 0), ("forward", 1.15, 1), ("fwd+bwd", 1.24, 1)]
    bf16 = {r["case"]: r["ratio"] for r in rows if r["dtype"] == "bfloat16"}
    assert bf16 == dict(zip(summary.CPU_CASES, (1.05, 0.96, 1.51, 1.88, 2.01, 2.65)))
    assert all(r["shape"] == "B=1 H=8 N=2048 D=64" for r in rows)
    assert tables._range([1.18, 1.15]) == "1.15-1.18x" and tables._range([1.05]) == "1.05x"


def test_a_partial_gpu_grid_run_supersedes_only_what_it_measured():
    def entry(name, created, units):
        results = [{"dtype": d, "passes": p, "N": 1024, "ratio": 1.0} for d, p in units]
        return {"file": name, "created": created, "data": {"results": results}}

    old = entry("old.json", "2026-01-01", [("bfloat16", "fwd"), ("bfloat16", "fwd+bwd"), ("float16", "fwd")])
    new = entry("new.json", "2026-01-02", [("bfloat16", "fwd+bwd")])
    rows = summary.latest_gpu_grid_rows([new, old])
    assert {(r["dtype"], r["passes"]): r["file"] for r in rows} == {
        ("bfloat16", "fwd+bwd"): "new.json", ("bfloat16", "fwd"): "old.json", ("float16", "fwd"): "old.json"}


def test_a_sweep_of_one_family_supersedes_only_its_rows():
    def entry(name, created, families):
        cases = [{"family": f, "impl": impl, "config_label": label, "seq_len": 1024, "status": "ok",
                  "speedup_vs_baseline": 2.0 if name == "new.json" else 1.0}
                 for f, impl, label in (("attention", "ours_linear", "causal, fwd"),
                                        ("layer_norm", "ours", "+ residual, fwd")) if f in families]
        settings = {"batch": 4, "heads": 16, "head_dim": 64, "seq_lens": [1024], "ln_width": 1024}
        return {"file": name, "created": created, "data": {"settings": settings, "dtype": "bfloat16", "cases": cases}}

    old = entry("old.json", "2026-01-01", ("attention", "layer_norm"))
    new = entry("new.json", "2026-01-02", ("layer_norm",))
    rows, used = tables._latest_sweep_rows([new, old], "", cpu=False)
    assert {r[0].split(",")[0]: (r[1].split()[0], r[-1]) for r in rows} == {
        "fused residual + LayerNorm": ("2.00x", "[`new.md`](new.md)"),
        "linear attention": ("1.00x", "[`old.md`](old.md)")}
    assert [e["file"] for e in used] == ["new.json", "old.json"]


def test_generated_tables_are_up_to_date(tmp_path):
    """README.md, docs/performance.md and benchmarks/results/INDEX.md hold what the report tool
    makes of the committed results (run `python -m benchmarks.report` after adding results)."""
    assert report.main(["--check", "--results", str(committed_results(tmp_path))]) == 0


def test_generated_block_replaces_only_its_own_lines():
    text = f"intro\n{tables.BEGIN}\nold table\n{tables.END}\noutro\n"
    new = tables.replace_block(text, "| new |")
    assert new.startswith("intro\n" + tables.BEGIN) and new.endswith(tables.END + "\noutro\n")
    assert "old table" not in new and "| new |" in new


@pytest.mark.parametrize("causal", [False, True])
def test_forward_tile_sweep_launches_the_planned_forward(causal):
    """benchmarks/tools/sweep_attention_tiles_gpu's forward launch (the bare kernel with an explicit
    tile, as attention_forward plans it) gives the float64 result for tiles other than the table's,
    checked here so that a GPU run does not spend its time finding out."""
    from benchmarks.tools import sweep_attention_tiles_gpu as sweep

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 24, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    for tile in [(16, 32, 4, 1), (32, 16, 4, 1)]:
        (out,), _ = sweep._launch_fwd(tile, q, k, v, 24 ** -0.5, causal)
        assert (out.double() - ref).abs().max().item() < 1e-5, tile
