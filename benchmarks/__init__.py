"""The transformer_fast benchmarks (run from the repository root; not installed by setup.py).

    python -m benchmarks.run --help     # every suite
    python -m benchmarks.report         # the results index and the README's tables

``run`` is the entry point; ``cases`` defines what the sweep measures, ``measure`` how (timing,
peak memory, hardware ceilings), ``targets`` and ``target_gpu`` the target suites, ``gpu_suite``
the one-command GPU run, ``report`` what is written (JSON, Markdown, PNG plots), ``summary`` and
``tables`` how the committed results become the index and the README's tables.
"""
