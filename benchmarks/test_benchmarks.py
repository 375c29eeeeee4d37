"""The benchmark cases under pytest-benchmark (see conftest.py for the options).

Each test checks its implementation against the float64 oracle first (a wrong result fails the
test and is never timed), records the peak memory of one call in ``extra_info``, then lets
pytest-benchmark time it. Tests of one case share a ``benchmark.group``, so the comparison
table puts ours next to PyTorch's.
"""
import pytest
import torch

from benchmarks import cases, measure


def _run(benchmark, settings, group, impl):
    device = settings["device"]
    limit = measure.available_memory_bytes(device) * (0.9 if device.type == "cuda" else 0.5)
    if group.memory_estimate(impl) > limit:
        pytest.skip(f"needs ~{group.memory_estimate(impl) / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB available")
    group.setup()
    try:
        try:
            ok, err, bound, note = group.check(impl)
            fn = group.function(impl)
        except cases.NotAvailable as exc:
            pytest.skip(str(exc))
        if not ok:
            pytest.fail(f"{cases.label(group.family, impl)} failed the correctness check, not timed: {note}")
        _, peak, _ = measure.run_measuring_memory(fn, device)
        benchmark.group = group.key
        benchmark.extra_info.update({k: v for k, v in group.work(impl).items() if v is not None})
        benchmark.extra_info.update(peak_memory_bytes=peak, max_error=err, error_bound=bound,
                                    device=str(device), dtype=str(group.dtype))
        if device.type == "cuda":
            def timed():
                fn()
                torch.cuda.synchronize(device)
        else:
            timed = fn
        benchmark.pedantic(timed, warmup_rounds=1, rounds=_rounds(fn, device), iterations=1)
    finally:
        group.teardown()


def _rounds(fn, device, budget_s=1.0):
    seconds = measure.time_once(fn, device)
    return int(max(3, min(50, budget_s / max(seconds, 1e-6))))


@pytest.mark.parametrize("impl", list(cases.IMPLS["attention"]))
@pytest.mark.parametrize("pass_", cases.PASSES)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_attention(benchmark, bench_settings, seq_len, causal, pass_, impl):
    s = bench_settings
    group = cases.AttentionGroup(seq_len, {"causal": causal, "pass": pass_}, [impl], s["dtype"], s["device"],
                                 batch=s["batch"], heads=s["heads"], head_dim=s["head_dim"])
    _run(benchmark, s, group, impl)


@pytest.mark.parametrize("impl", list(cases.IMPLS["layer_norm"]))
@pytest.mark.parametrize("pass_", cases.PASSES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_layer_norm(benchmark, bench_settings, seq_len, residual, pass_, impl):
    s = bench_settings
    group = cases.LayerNormGroup(seq_len, {"residual": residual, "pass": pass_}, [impl], s["dtype"], s["device"],
                                 batch=s["batch"], width=s["heads"] * s["head_dim"])
    _run(benchmark, s, group, impl)


@pytest.mark.parametrize("impl", list(cases.IMPLS["train_step"]))
def test_train_step(benchmark, bench_settings, seq_len, impl):
    s = bench_settings
    group = cases.TrainStepGroup(seq_len, {"pass": "train"}, [impl], s["dtype"], s["device"], batch=s["batch"],
                                 d_model=256, nhead=4, num_layers=2, dim_feedforward=1024, vocab=1000)
    _run(benchmark, s, group, impl)
