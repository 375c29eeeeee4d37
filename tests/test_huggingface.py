"""attn_implementation="transformer_fast" in Hugging Face transformers: tiny BART and BERT models
built from configs (nothing downloaded) give the logits, gradients and greedy generations of the
same weights on transformers' "sdpa" implementation (fp32: atol=1e-5, rtol=1e-4)."""
import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformer_fast.integrations.huggingface as tf_hf  # noqa: E402
from helpers import MODEL_TOL, compare_logits_and_grads  # noqa: E402

TOL = MODEL_TOL


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tf_hf.register()


@pytest.fixture
def count_kernel_calls(monkeypatch):
    calls = []
    original = tf_hf.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_hf, "scaled_dot_product_attention", counting)
    return calls


def pair(model_cls, config):
    """The model on sdpa and the same weights on transformer_fast (separate configs: the
    implementation is stored in the config)."""
    torch.manual_seed(0)
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation="transformer_fast")
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert ref.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == "transformer_fast"
    return ref, ours


def bart_config():
    return transformers.BartConfig(
        vocab_size=97, d_model=24, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, forced_bos_token_id=None)


def bert_config():
    return transformers.BertConfig(
        vocab_size=101, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def padded_batch(vocab, batch, length, pad_id):
    ids = torch.randint(3, vocab, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 4:] = 0  # right padding
    mask[2, length - 1:] = 0
    ids[mask == 0] = pad_id
    return ids, mask


@pytest.mark.parametrize("train", [False, True])
def test_bart_logits_and_gradients(train, count_kernel_calls):
    ref, ours = pair(transformers.BartForConditionalGeneration, bart_config())
    ref.train(train)
    ours.train(train)
    ids, mask = padded_batch(97, 3, 11, pad_id=1)
    decoder_ids = torch.randint(3, 97, (3, 7))
    compare_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids))
    # encoder self-attention, decoder self-attention and cross-attention, 2 layers each
    assert len(count_kernel_calls) == 6
    assert any(c["is_causal"] for c in count_kernel_calls)


def test_bart_greedy_generation(count_kernel_calls):
    ref, ours = pair(transformers.BartForConditionalGeneration, bart_config())
    ref.eval()
    ours.eval()
    ids, mask = padded_batch(97, 3, 9, pad_id=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, num_beams=1)
    with torch.no_grad():
        expected = ref.generate(ids, **kwargs)
        generated = ours.generate(ids, **kwargs)
    assert generated.shape == expected.shape == (3, 11)
    assert torch.equal(generated, expected)
    assert count_kernel_calls  # the cached decoding steps ran our kernel too


@pytest.mark.parametrize("train", [False, True])
def test_bert_logits_and_gradients(train, count_kernel_calls):
    ref, ours = pair(transformers.BertForMaskedLM, bert_config())
    ref.train(train)
    ours.train(train)
    ids, mask = padded_batch(101, 3, 13, pad_id=0)
    compare_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask))
    assert len(count_kernel_calls) == 2
    # the padding reaches the kernel as its key padding mask (True = padded), no (B, 1, N, N) mask
    first = count_kernel_calls[0]
    assert first["attn_mask"] is None and not first["is_causal"]
    assert torch.equal(first["key_padding_mask"], mask == 0)


def test_bert_without_padding_passes_no_mask(count_kernel_calls):
    ref, ours = pair(transformers.BertModel, bert_config())
    ids = torch.randint(3, 101, (2, 9))
    torch.testing.assert_close(ours(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state, **TOL)
    assert all(c["attn_mask"] is None and not c["is_causal"] for c in count_kernel_calls)


def test_set_attn_implementation_on_an_existing_model():
    torch.manual_seed(0)
    ref = transformers.BertModel._from_config(bert_config(), attn_implementation="sdpa")
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("transformer_fast")
    assert ours.config._attn_implementation == "transformer_fast"
    ids, mask = padded_batch(101, 3, 8, pad_id=0)
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).last_hidden_state,
                               ref(input_ids=ids, attention_mask=mask).last_hidden_state, **TOL)


def test_softcap_and_sinks_reach_the_kernel(count_kernel_calls):
    q = torch.randn(1, 2, 3, 8)
    sinks = torch.tensor([0.5, -1.0])
    tf_hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0, s_aux=sinks)
    assert count_kernel_calls[0]["softcap"] == 30.0 and count_kernel_calls[0]["sinks"] is sinks


def test_importing_transformer_fast_does_not_import_transformers():
    code = "import sys, transformer_fast; assert 'transformers' not in sys.modules, 'transformers was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama_grouped_query_attention_with_left_padding(count_kernel_calls):
    """A decoder-only model with grouped-query attention (4 query heads, 2 key/value heads),
    causal masks combined with left padding, and greedy generation with a cache."""
    config = transformers.LlamaConfig(
        vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref, ours = pair(transformers.LlamaForCausalLM, config)
    ids = torch.randint(3, 89, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    ids[mask == 0] = 0
    out_r = ref(input_ids=ids, attention_mask=mask).logits
    out_o = ours(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded query rows attend to nothing: compare the real tokens
    torch.testing.assert_close(out_o[keep], out_r[keep], **TOL)
    assert any(c.get("enable_gqa") for c in count_kernel_calls)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


# Models whose attention does not go through AttentionInterface would run their own attention code
# on the masks built for transformer_fast (bool, or None for "causal") and misread them: BLOOM and
# XGLM lost the causal mask, ConvBERT and MPNet ignored padding, Falcon failed with a KeyError.
def tiny_bloom_config():
    return transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)


# Falcon picks its attention class from FALCON_ATTENTION_CLASSES before transformers 5.25; since,
# it dispatches through AttentionInterface (ALiBi models add the bias to the float mask).
FALCON_OUTSIDE_INTERFACE = hasattr(transformers.models.falcon.modeling_falcon, "FALCON_ATTENTION_CLASSES")


@pytest.mark.parametrize("model_cls, config, instead", [
    ("BloomModel", tiny_bloom_config, "eager"),
    ("XGLMModel", lambda: transformers.XGLMConfig(vocab_size=64, d_model=16, num_layers=1, attention_heads=2,
                                                  ffn_dim=32), "eager"),
    ("MPNetModel", lambda: transformers.MPNetConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32), "eager"),
    pytest.param("FalconModel", lambda: transformers.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                                  num_attention_heads=2), "sdpa",
                 marks=pytest.mark.skipif(not FALCON_OUTSIDE_INTERFACE, reason="served since transformers 5.25 "
                                          "(test_falcon_served_through_the_attention_interface)")),
])
def test_models_it_cannot_serve_are_refused_when_built(model_cls, config, instead):
    cls = getattr(transformers, model_cls)
    assert not tf_hf.supports_model(cls)
    message = (rf"{model_cls} does not support attn_implementation='transformer_fast': .*\. "
               rf"Use attn_implementation='{instead}'\.")
    with pytest.raises(ValueError, match=message):
        cls._from_config(config(), attn_implementation="transformer_fast")
    with pytest.raises(ValueError, match=message):
        transformers.AutoModel.from_config(config(), attn_implementation="transformer_fast")
    cls._from_config(config(), attn_implementation=instead)  # what the message recommends works


def test_refused_by_from_pretrained(tmp_path):
    model = transformers.BloomForCausalLM._from_config(tiny_bloom_config(), attn_implementation="eager")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomForCausalLM does not support attn_implementation='transformer_fast'"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="transformer_fast")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")


def test_a_sub_model_outside_the_interface_refuses_the_composite_model():
    """DeepSeek-VL-Hybrid itself dispatches through the interface, but builds a SAM vision encoder
    that picks its attention classes from a table keyed by the implementation name."""
    from hf_families import small_config
    config = small_config("deepseek_vl_hybrid")
    with pytest.raises(ValueError, match="SamVisionModel does not support attn_implementation='transformer_fast'"):
        transformers.DeepseekVLHybridModel._from_config(config, attn_implementation="transformer_fast")


def test_supports_model_follows_the_attention_interface():
    for served in ("BertModel", "BartForConditionalGeneration", "T5Model", "LlamaForCausalLM", "GPT2Model",
                   "Gemma3ForCausalLM", "Gemma2Model", "GptOssModel", "PegasusXModel"):
        assert tf_hf.supports_model(getattr(transformers, served)), served
    for refused in ("BloomModel", "ConvBertModel", "BigBirdModel", "CanineModel", "GitModel",
                    "SamVisionModel", "LongformerModel", "DeepseekV32Model"):
        assert not tf_hf.supports_model(getattr(transformers, refused)), refused
    assert tf_hf.supports_model(transformers.FalconModel) is not FALCON_OUTSIDE_INTERFACE
    assert tf_hf.supports_model(transformers.BertModel._from_config(bert_config()))  # instances too


@pytest.mark.skipif(FALCON_OUTSIDE_INTERFACE, reason="transformers < 5.25: Falcon is refused (its own attention)")
@pytest.mark.parametrize("alibi, new_decoder_architecture", [(False, True), (True, False)])
def test_falcon_served_through_the_attention_interface(alibi, new_decoder_architecture):
    """Falcon with rotary embeddings (grouped key/value heads) and with ALiBi (multi-query; the bias
    comes added to the float mask, padding masked in it) against sdpa: logits, gradients, generation."""
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_kv_heads=2, alibi=alibi, new_decoder_architecture=new_decoder_architecture,
                                       hidden_dropout=0.0, attention_dropout=0.0)
    ref, ours = pair(transformers.FalconForCausalLM, config)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    compare_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask))
    kwargs = dict(max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids[:1], **kwargs), ref.generate(ids[:1], **kwargs))


def test_register_twice_and_under_another_name():
    tf_hf.register()
    tf_hf.register("transformer_fast_alias")
    tf_hf.register()
    with pytest.raises(ValueError, match="does not support attn_implementation='transformer_fast_alias'"):
        transformers.BloomModel._from_config(tiny_bloom_config(), attn_implementation="transformer_fast_alias")
    model = transformers.BertModel._from_config(bert_config(), attn_implementation="transformer_fast_alias")
    assert model.config._attn_implementation == "transformer_fast_alias"
    # one wrapper, however often registered
    checked = transformers.PreTrainedModel.get_correct_attn_implementation
    assert checked._transformer_fast_names == {"transformer_fast", "transformer_fast_alias"}
    assert not hasattr(checked.__wrapped__, "_transformer_fast_names")


def test_models_without_sdpa_or_flex_attention_are_refused():
    """BigBird supports neither: its masks and options are its own."""
    config = transformers.BigBirdConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32)
    with pytest.raises(ValueError, match="BigBirdModel does not support .*neither 'sdpa' nor 'flex_attention'.*"
                                         "Use attn_implementation='eager'"):
        transformers.BigBirdModel._from_config(config, attn_implementation="transformer_fast")


def test_models_served_through_their_flex_attention_support():
    """Gemma 2 (soft-capping) and PEGASUS-X refuse sdpa but support flex attention, whose masks come
    from the same mask functions: served, and compared with eager."""
    from hf_families import check_family
    for family in ("gemma2", "pegasus_x"):
        result = check_family(family)
        # compared with sdpa where this transformers lets the model use it (Gemma 2 in 5.17)
        model_cls = getattr(transformers, result.model_class)
        compared_with = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
        assert result.status == f"matches {compared_with}", result
