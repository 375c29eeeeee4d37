"""The README's Python examples run as written (under CPU autocast, as they are written)."""
import os
import re

import pytest
import torch

import transformer_fast

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_the_readme_has_examples():
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index):
    code = python_blocks()[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    namespace = {}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    if "optimizer" in namespace:  # the swap: the optimizer built before convert trained the converted model
        model = namespace["model"]
        assert all(p.grad is not None for p in model.parameters())
        assert isinstance(model.encoder.layers[0], transformer_fast.TransformerEncoderLayer)
        assert torch.isfinite(namespace["out"]).all()
    if "logits" in namespace:
        assert torch.isfinite(namespace["logits"]).all()
