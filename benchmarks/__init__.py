"""The transformer_fast benchmark suite (run from the repository root; not installed by setup.py).

    python -m benchmarks.run            # quick sweep (about 2 minutes on a 2-core CPU)
    python -m benchmarks.run --full     # long sweep
    pytest benchmarks/ --benchmark-only # the same cases under pytest-benchmark

``cases`` defines what is measured (shared by both entry points), ``measure`` how (timing,
peak memory, hardware ceilings), ``report`` what is written (JSON, Markdown, PNG plots).
"""
