"""Smoke test of the benchmark command (benchmarks/run.py) on tiny sizes, plus the pieces of it
that decide what gets reported: the correctness gate and the crossover statement."""
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

from benchmarks import cases, report  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One thread: on a busy 2-core machine, two OpenMP threads make every tiny op wait ~20 ms at a barrier.
TINY = ["--device", "cpu", "--dtype", "float32", "--seq-lens", "16", "32", "--batch", "1", "--heads", "2",
        "--head-dim", "16", "--repeats", "2", "--min-repeats", "2", "--budget", "0", "--min-sample-ms", "0",
        "--train-seq-lens", "8", "--train-d-model", "16", "--train-heads", "2", "--train-layers", "1",
        "--train-vocab", "11", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Runs the command exactly as a user does (a subprocess from the repository root)."""
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "TRANSFORMER_FAST_BENCH_NO_REEXEC"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *TINY, "--out", str(out), "--name", "smoke"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
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
