"""attn_implementation="transformer_fast" over the model families transformers ships (tests/hf_families.py):
each family served matches sdpa (eager where it refuses sdpa) in outputs and gradients on a padded
batch, each family it cannot serve (neither sdpa nor flex attention, attention outside
AttentionInterface, options it does not implement) is refused with a clear ValueError. A
representative subset runs here; the whole sweep is marked slow (docs/huggingface_families.md
records its last result)."""
import pytest

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402

# Falcon runs its own attention classes before transformers 5.25 and AttentionInterface since.
FALCON_OUTSIDE_INTERFACE = hasattr(transformers.models.falcon.modeling_falcon, "FALCON_ATTENTION_CLASSES")

SERVED = [
    # encoder-only
    "bert", "roberta", "electra", "distilbert", "modernbert",
    # decoder-only; mistral, qwen2 and qwen3 with grouped-query attention (4 query heads, 2 key/value heads)
    "gpt2", "llama", "mistral", "qwen2", "qwen3", "opt", "gemma3_text",
    # multi-head latent attention (query/key head size 16, value head size 8)
    "deepseek_v3",
    # encoder-decoder; t5 with its relative position bias as a float mask
    "bart", "t5", "m2m_100",
    # served through its flex-attention support, compared with eager: sinks and sliding windows
    "gpt_oss",
] + ([] if FALCON_OUTSIDE_INTERFACE else ["falcon"])
# Their attention does not go through AttentionInterface: served, they lost the causal mask (bloom,
# xglm, gpt_neox_japanese), ignored padding (convbert, mpnet, ibert, big_bird, canine) or failed
# with a KeyError (falcon before transformers 5.25, git).
REFUSED = ["bloom", "xglm", "gpt_neox_japanese", "convbert", "mpnet", "ibert", "big_bird", "canine", "git",
           # folds its indexer's top-k selection into the mask only for eager and sdpa, else passes `indices`
           "deepseek_v32"] + (["falcon"] if FALCON_OUTSIDE_INTERFACE else [])


@pytest.mark.parametrize("family", SERVED)
def test_served_family_matches(family):
    result = hf_families.check_family(family)
    assert result.served_correctly, result


@pytest.mark.parametrize("family", ["t5", "bart", "llama"])
def test_served_family_matches_in_training_mode(family):
    """Dropout is 0 in the small configs: training mode takes the other code paths (T5's bias)."""
    result = hf_families.check_family(family, train=True)
    assert result.served_correctly, result


@pytest.mark.parametrize("family, norm", [("llama", "LlamaRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
                                          ("gemma3_text", "Gemma3RMSNorm"), ("t5", "T5LayerNorm"),
                                          ("deepseek_v3", "DeepseekV3RMSNorm"), ("bert", "LayerNorm")])
def test_served_family_matches_converted(family, norm):
    """The same with convert's norms as well: transformers' RMSNorm forms and torch.nn.LayerNorm."""
    result = hf_families.check_family(family, convert=True)
    assert result.served_correctly, result
    assert norm in result.detail.split("; converted: ")[1].split(", "), result


@pytest.mark.parametrize("family", REFUSED)
def test_family_outside_the_attention_interface_is_refused(family):
    result = hf_families.check_family(family)
    assert result.status == "refused", result
    assert result.detail.startswith(result.model_class), result


@pytest.mark.parametrize("family", ["bloom", "mpnet"])
def test_a_served_family_that_misreads_the_masks_is_a_mismatch(family, monkeypatch):
    """What the sweep reports if the refusal is lifted (as before it existed): BLOOM adds the bool
    causal mask to its scores (token 0 sees the last token), MPNet ignores the padding."""
    from transformer_fast.integrations import huggingface as tf_hf
    monkeypatch.setattr(tf_hf, "supports_model", lambda model: True)
    result = hf_families.check_family(family)
    assert result.status == "MISMATCH", result


@pytest.mark.slow
def test_every_family():
    """About 10 minutes on 2 cores; docs/huggingface_families.md is the same sweep's table."""
    transformers.logging.set_verbosity_error()  # thousands of config warnings otherwise
    results = [hf_families.check_family(family) for family in hf_families.families()]
    bad = [r for r in results if r.status in ("MISMATCH", "ERROR")]
    assert not bad, "\n".join(map(str, bad))
    assert sum(r.served_correctly for r in results) >= 100
