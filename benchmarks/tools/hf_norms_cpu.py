"""Hugging Face transformers' RMSNorm modules against the same modules after `transformer_fast.convert`
(transformer_fast/integrations/huggingface_norms.py), on the CPU, one thread: a decoding step's
call (one token of width 1024, forward without grad) and a training step's (2 x 512 tokens,
forward+backward), bfloat16, for Llama's form and Gemma's. Timed round-robin
(`measure.time_interleaved`, medians), with the harness's malloc settings.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 python -m benchmarks.tools.hf_norms_cpu
"""
from __future__ import annotations

import copy

import torch

from benchmarks import measure


def _cases(tf):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    cases = {}
    for form, cls in (("Llama", LlamaRMSNorm), ("Gemma", GemmaRMSNorm)):
        theirs = cls(1024).bfloat16()
        with torch.no_grad():
            theirs.weight.normal_(0, 0.1, generator=g)
        ours = tf.convert(copy.deepcopy(theirs))
        token = torch.randn(1, 1, 1024, generator=g).bfloat16()
        batch = torch.randn(2, 512, 1024, generator=g).bfloat16().requires_grad_()
        grad = torch.randn(2, 512, 1024, generator=g).bfloat16()
        for lib, module in (("transformers", theirs), ("converted", ours)):
            def decode(module=module):
                with torch.no_grad():
                    module(token)
            cases[f"{form} form, decoding 1 x 1024, forward [{lib}]"] = decode
            cases[f"{form} form, training 2 x 512 x 1024, forward+backward [{lib}]"] = \
                lambda module=module: torch.autograd.grad((module(batch),), [batch, module.weight], (grad,))
    return cases


def main():
    import transformer_fast as tf

    torch.set_num_threads(1)
    cases = _cases(tf)
    timings = {}
    for kind in ("decoding", "training"):  # each timed among its own kind (the training calls flush the caches)
        group = {name: fn for name, fn in cases.items() if kind in name}
        timings.update(measure.time_interleaved(group, torch.device("cpu"), max_repeats=15, min_repeats=15,
                                                min_sample_s=0.05, budget_s=30.0))
    print(f"torch {torch.__version__}, one thread; medians of {timings[next(iter(cases))]['samples']} interleaved "
          f"rounds")
    for name in dict.fromkeys(name.rsplit(" [", 1)[0] for name in cases):
        theirs = timings[f"{name} [transformers]"]["median_ms"] * 1e3
        ours = timings[f"{name} [converted]"]["median_ms"] * 1e3
        print(f"{name:58s} transformers {theirs:9.1f} us  converted {ours:9.1f} us  {theirs / ours:5.2f}x")


if __name__ == "__main__":
    main()
