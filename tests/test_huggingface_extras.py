"""attn_implementation="transformer_fast" with sliding windows, logit soft-capping, attention sinks
and packed sequences: tiny Mistral, Qwen2, Gemma 2, gpt-oss and Llama models built from configs
(nothing downloaded) give the outputs (at the valid positions), parameter gradients and greedy
generations of the same weights on transformers' "eager" implementation (fp32: atol=1e-5,
rtol=1e-4), and the kernels receive the window, cap and sinks."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformer_fast.integrations.huggingface as tf_hf  # noqa: E402
from transformers import masking_utils  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tf_hf.register()


@pytest.fixture
def kernel_calls(monkeypatch):
    """The keyword arguments of every scaled_dot_product_attention and varlen_attn call the
    integration makes, in order, with the function's name under "fn"."""
    calls = []
    for fn in ("scaled_dot_product_attention", "varlen_attn"):
        original = getattr(tf_hf, fn)

        def spy(*args, _original=original, _fn=fn, **kwargs):
            calls.append(dict(kwargs, fn=_fn, args=args))
            return _original(*args, **kwargs)

        monkeypatch.setattr(tf_hf, fn, spy)
    return calls


def pair(model_cls, config, seed=0):
    """The model on eager and the same weights on transformer_fast."""
    torch.manual_seed(seed)
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation="transformer_fast")
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def assert_logits_and_grads(ref, ours, inputs, valid=None, loss=None):
    """Outputs at the ``valid`` (B, N) positions and every parameter gradient of a random
    projection of them (or of ``loss(output)``) agree."""
    out_r, out_o = ref(**inputs).logits, ours(**inputs).logits
    if valid is not None:
        out_r, out_o = out_r[valid], out_o[valid]
    torch.testing.assert_close(out_o, out_r, **TOL)
    if loss is None:
        weight = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(3))
        loss = lambda out: (out * weight).sum()  # noqa: E731
    named_r = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    params_o = [p for _, p in ours.named_parameters() if p.requires_grad]
    grads_r = torch.autograd.grad(loss(out_r), [p for _, p in named_r], allow_unused=True)
    grads_o = torch.autograd.grad(loss(out_o), params_o, allow_unused=True)
    for (name, _), a, b in zip(named_r, grads_o, grads_r):
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad of {name}: {m}")


def right_padded(vocab, batch, length, pad_id=0, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 5:] = 0
    ids[mask == 0] = pad_id
    return ids, mask


def left_padded(vocab, batch, length, pad_id=0, seed=2):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :3] = 0
    ids[mask == 0] = pad_id
    return ids, mask


def mistral_config(**overrides):
    values = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return transformers.MistralConfig(**values)


def qwen2_config():
    # layer 0 full attention, layer 1 a window of 5 keys
    return transformers.Qwen2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def windows(calls):
    return [c.get("window_size") for c in calls if c["fn"] == "scaled_dot_product_attention"]


# ------------------------------------------------------------------------------------------------
# Sliding windows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
def test_mistral_sliding_window(padded, kernel_calls):
    ref, ours = pair(transformers.MistralForCausalLM, mistral_config())
    ids, mask = right_padded(61, 3, 13)
    inputs = dict(input_ids=ids, attention_mask=mask) if padded else dict(input_ids=ids)
    assert_logits_and_grads(ref, ours, inputs, valid=mask.bool() if padded else None)
    # the window reached the kernels, with the mask that encodes it as well
    assert windows(kernel_calls) == [(3, 0)] * 2
    assert all(c["attn_mask"] is not None or c["key_padding_mask"] is not None for c in kernel_calls)


def test_qwen2_sliding_and_full_layers(kernel_calls):
    ref, ours = pair(transformers.Qwen2ForCausalLM, qwen2_config())
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    ids, mask = right_padded(61, 3, 12)
    assert_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask), valid=mask.bool())
    assert windows(kernel_calls) == [(-1, 0), (4, 0)]


@pytest.mark.parametrize("model", ["mistral", "qwen2"])
def test_greedy_generation_with_left_padding_past_the_window(model, kernel_calls):
    """Prompts of 7 tokens (one left-padded by 3) and 9 new tokens: the sliding caches drop keys
    and the masks are aligned to the bottom right (the last query at the last key)."""
    if model == "mistral":
        ref, ours = pair(transformers.MistralForCausalLM, mistral_config())
    else:
        ref, ours = pair(transformers.Qwen2ForCausalLM, qwen2_config())
    ids, mask = left_padded(61, 2, 7)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False, num_beams=1)
    with torch.no_grad():
        expected = ref.generate(ids, **kwargs)
        generated = ours.generate(ids, **kwargs)
    assert torch.equal(generated, expected)
    decoding = [c for c in kernel_calls if c["args"][0].shape[2] == 1]
    assert decoding and any(c.get("window_size") not in (None, (-1, 0)) for c in decoding)


def test_chunked_prefill_continues_a_sliding_cache():
    """Three forwards of several tokens each through one cache: 5 queries against up to 8 keys,
    the window's alignment when a chunk continues a cache."""
    ref, ours = pair(transformers.MistralForCausalLM, mistral_config())
    ids, mask = left_padded(61, 2, 15)
    caches = {id(ref): transformers.DynamicCache(config=ref.config),
              id(ours): transformers.DynamicCache(config=ours.config)}
    # `cache` from transformers 5.2x on, `past_key_values` before (deprecated since, removed in 5.40)
    cache_kwarg = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 10), (10, 15)):
            outs = [m(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], use_cache=True,
                      **{cache_kwarg: caches[id(m)]}).logits for m in (ref, ours)]
            valid = mask[:, start:stop].bool()
            torch.testing.assert_close(outs[1][valid], outs[0][valid], **TOL)
    assert [cache.get_seq_length() for cache in caches.values()] == [15, 15]  # the chunks went through the caches


# ------------------------------------------------------------------------------------------------
# Soft-capping and sinks
# ------------------------------------------------------------------------------------------------
def test_gemma2_softcap_with_sliding_and_full_layers(kernel_calls):
    config = transformers.Gemma2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=1.5, final_logit_softcapping=None, query_pre_attn_scalar=8, pad_token_id=0)
    ref, ours = pair(transformers.Gemma2ForCausalLM, config)
    assert ref.config.layer_types == ["sliding_attention", "full_attention"]
    ids, mask = right_padded(61, 3, 11)
    assert_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask), valid=mask.bool())
    assert [c["softcap"] for c in kernel_calls] == [1.5, 1.5]
    assert windows(kernel_calls) == [(3, 0), (-1, 0)]
    # the cap matters at this size: without it the logits differ
    ours.model.layers[0].self_attn.attn_logit_softcapping = None
    ours.model.layers[1].self_attn.attn_logit_softcapping = None
    uncapped = ours(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(uncapped, ref(input_ids=ids, attention_mask=mask).logits, atol=1e-3)


def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_gpt_oss_sinks(kernel_calls):
    ref, ours = pair(transformers.GptOssForCausalLM, gpt_oss_config())
    with torch.no_grad():  # sinks large enough to matter
        for model in (ref, ours):
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, 4) + i)
    ids, mask = right_padded(61, 3, 11)
    assert_logits_and_grads(ref, ours, dict(input_ids=ids, attention_mask=mask), valid=mask.bool())
    assert all(c["sinks"] is not None and c["sinks"].shape == (4,) for c in kernel_calls)
    assert windows(kernel_calls) == [(3, 0), (-1, 0)]


def test_gpt_oss_greedy_generation(kernel_calls):
    ref, ours = pair(transformers.GptOssForCausalLM, gpt_oss_config())
    ids, mask = left_padded(61, 2, 6)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


# ------------------------------------------------------------------------------------------------
# Packed sequences
# ------------------------------------------------------------------------------------------------
def llama_config(**overrides):
    values = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return transformers.LlamaConfig(**values)


LENGTHS = (5, 3, 7, 1, 4)


def flattened(flash_kwargs):
    generator = torch.Generator().manual_seed(4)
    features = [{"input_ids": torch.randint(3, 61, (n,), generator=generator).tolist()} for n in LENGTHS]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")
    return features, collator(features)


def separate_loss_and_grads(model, features):
    """The summed token loss of each sequence run alone, and its parameter gradients."""
    total = 0.0
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        logits = model(input_ids=ids).logits
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
    return total, torch.autograd.grad(total, list(model.parameters()))


def packed_loss_and_grads(model, batch, **kwargs):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, **kwargs).logits[0]
    labels = batch["labels"][0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_llama_packed_training(flash_kwargs, kernel_calls):
    """transformers' DataCollatorWithFlattening: one row of 5 sequences, without a cache (transformers
    reads packing from position_ids only then). Loss and gradients equal running the sequences
    separately, and running eager on the same packed row (whose mask transformers builds
    block-diagonal from the position_ids)."""
    ref, ours = pair(transformers.LlamaForCausalLM, llama_config())
    ref.train()
    ours.train()
    features, batch = flattened(flash_kwargs)
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    loss_o, grads_o = packed_loss_and_grads(ours, batch, use_cache=False)
    varlen = [c for c in kernel_calls if c["fn"] == "varlen_attn"]
    assert len(varlen) == 2 and not [c for c in kernel_calls if c["fn"] != "varlen_attn"]
    cu = torch.tensor([0, 5, 8, 15, 16, 20], dtype=torch.int32)
    assert all(torch.equal(c["args"][3], cu) and c["window_size"] == (-1, 0) for c in varlen)
    loss_e, grads_e = packed_loss_and_grads(ref, batch, use_cache=False)
    loss_s, grads_s = separate_loss_and_grads(ref, features)
    torch.testing.assert_close(loss_o, loss_e, **TOL)
    torch.testing.assert_close(loss_o, loss_s, **TOL)
    for (name, _), a, b, c in zip(ref.named_parameters(), grads_o, grads_e, grads_s):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad of {name} vs eager: {m}")
        torch.testing.assert_close(a, c, **TOL, msg=lambda m: f"grad of {name} vs separate: {m}")


def test_cu_seq_lens_with_a_cache(kernel_calls):
    """With use_cache left on, transformers builds no packed mask (no mask at all here), but the
    cu_seq_lens_* keyword arguments still describe the sequences (as its flash-attention path
    reads them): the loss and gradients of running them separately."""
    ref, ours = pair(transformers.LlamaForCausalLM, llama_config())
    features, batch = flattened(True)
    loss_o, grads_o = packed_loss_and_grads(ours, batch, use_cache=True)
    assert [c["fn"] for c in kernel_calls] == ["varlen_attn"] * 2
    loss_s, grads_s = separate_loss_and_grads(ref, features)
    torch.testing.assert_close(loss_o, loss_s, **TOL)
    for (name, _), a, c in zip(ref.named_parameters(), grads_o, grads_s):
        torch.testing.assert_close(a, c, **TOL, msg=lambda m: f"grad of {name} vs separate: {m}")


def test_restarting_positions_without_a_packed_mask_warn(kernel_calls):
    """With a cache, transformers reads no packing from position_ids: the attention spans the
    sequences, as eager's (and sdpa's) does, and a warning says so."""
    ref, ours = pair(transformers.LlamaForCausalLM, llama_config())
    _, batch = flattened(False)
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
    with pytest.warns(UserWarning, match="position_ids restart inside the row"):
        out = ours(**inputs).logits
    torch.testing.assert_close(out, ref(**inputs).logits, **TOL)


@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens with a cache"])
def test_packed_with_a_sliding_window(route, kernel_calls):
    """Mistral (a window of 4 keys) on packed sequences: varlen_attn with window (3, 0) in each. With
    a cache, transformers' mask is the window over the whole row: the cu_seq_lens_* keyword
    arguments separate the sequences (as its flash-attention path does), as running them alone."""
    ref, ours = pair(transformers.MistralForCausalLM, mistral_config())
    features, batch = flattened(route != "position_ids")
    if route == "position_ids":
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        assert_logits_and_grads(ref, ours, inputs)
    else:
        loss_o, grads_o = packed_loss_and_grads(ours, batch, use_cache=True)
        loss_s, grads_s = separate_loss_and_grads(ref, features)
        torch.testing.assert_close(loss_o, loss_s, **TOL)
        for (name, _), a, c in zip(ref.named_parameters(), grads_o, grads_s):
            torch.testing.assert_close(a, c, **TOL, msg=lambda m: f"grad of {name} vs separate: {m}")
    varlen = [c for c in kernel_calls if c["fn"] == "varlen_attn"]
    assert len(varlen) == 2 and all(c["window_size"] == (3, 0) for c in varlen)


def test_restarting_positions_with_a_padding_mask_are_not_packed(kernel_calls):
    """With an attention_mask, transformers does not read packing from position_ids (its mask is
    causal over the whole row, padding included): the dense path, as eager."""
    ref, ours = pair(transformers.LlamaForCausalLM, llama_config())
    _, batch = flattened(False)
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -2:] = 0
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask)
    assert_logits_and_grads(ref, ours, inputs, valid=mask.bool())
    assert all(c["fn"] == "scaled_dot_product_attention" for c in kernel_calls)


def test_cu_seq_lens_that_contradict_the_mask_raise():
    ref, ours = pair(transformers.LlamaForCausalLM, llama_config())
    _, batch = flattened(True)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 8, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="neither their block-diagonal mask nor plain causal"):
        ours(**batch, use_cache=False)


# ------------------------------------------------------------------------------------------------
# The mask builder
# ------------------------------------------------------------------------------------------------
def sdpa_cases():
    padding = torch.tensor([[1] * 9, [0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 6 + [0] * 3], dtype=torch.bool)
    causal, bidirectional = masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function
    sliding = masking_utils.sliding_window_causal_mask_function(3)
    both_ways = masking_utils.sliding_window_bidirectional_mask_function(3)
    chunked = masking_utils.chunked_causal_mask_function(3, torch.zeros(3, dtype=torch.long))
    return [
        # (mask function, local size, q_length, kv_length, q_offset, kv_offset, padding, expected tag)
        (causal, None, 9, 9, 0, 0, padding, (-1, 0)),
        (causal, None, 4, 9, 5, 0, padding, (-1, 0)),  # a chunk continuing a cache
        (causal, None, 1, 9, 8, 0, padding, (-1, 0)),
        (sliding, 3, 9, 9, 0, 0, padding, (2, 0)),
        (sliding, 3, 9, 9, 0, 0, None, (2, 0)),
        (sliding, 3, 3, 5, 6, 4, padding, (2, 0)),  # a sliding cache: kv_offset > 0
        (sliding, 3, 4, 9, 0, 0, padding, None),  # a static cache: keys past the last query
        (both_ways, 3, 9, 9, 0, 0, padding, (3, 3)),
        (chunked, 3, 9, 9, 0, 0, padding, None),
        (bidirectional, None, 9, 9, 0, 0, padding, None),
        (bidirectional, None, 5, 9, 0, 0, padding, None),
    ]


@pytest.mark.parametrize("case", range(len(sdpa_cases())))
def test_build_attention_mask_equals_sdpa_mask(case):
    mask_function, local_size, q_length, kv_length, q_offset, kv_offset, padding, tag = sdpa_cases()[case]
    config = llama_config(sliding_window=local_size) if local_size else llama_config()
    is_causal_pattern = mask_function is not masking_utils.bidirectional_mask_function and tag != (3, 3)
    args = dict(batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                mask_function=mask_function, attention_mask=padding, local_size=local_size,
                allow_is_causal_skip=is_causal_pattern, allow_is_bidirectional_skip=not is_causal_pattern)
    expected = masking_utils.sdpa_mask(**args)
    got = tf_hf.build_attention_mask(config=config, **args)
    assert torch.equal(got.expand_as(expected), expected)
    assert getattr(got, tf_hf._WINDOW_TAG, None) == tag
    if mask_function is masking_utils.bidirectional_mask_function:  # the padding row, O(N) memory
        assert got.shape == (3, 1, q_length, kv_length) and got.stride()[2] == 0


def test_masks_verified_block_diagonal_are_tagged_packed():
    """A mask that is exactly causal within runs of tokens gets their cumulative lengths: packed
    sequences, and chunked attention (Llama 4) without padding, whose chunks are such runs."""
    chunked = masking_utils.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    args = dict(batch_size=2, q_length=10, kv_length=10, mask_function=chunked, local_size=4)
    mask = tf_hf.build_attention_mask(config=llama_config(), **args)
    assert torch.equal(mask, masking_utils.sdpa_mask(**args))
    cu, max_len, window = getattr(mask, tf_hf._PACKED_TAG)
    assert cu.tolist() == [0, 4, 8, 10, 14, 18, 20] and max_len == 4 and window == (-1, 0)
    with_padding = tf_hf.build_attention_mask(config=llama_config(), attention_mask=torch.ones(2, 10, dtype=torch.bool),
                                              **args)
    assert not hasattr(with_padding, tf_hf._PACKED_TAG)  # only where no padding or cache can be in it


def test_a_static_cache_prefill_keeps_its_mask():
    """sdpa_mask leaves out the causal mask of a static cache's prefill (4 queries, 9 cache slots,
    top-left causal); build_attention_mask keeps it, so that a missing mask with fewer queries than
    keys always means bottom-right causal."""
    args = dict(batch_size=2, q_length=4, kv_length=9, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    assert masking_utils.sdpa_mask(**args) is None
    got = tf_hf.build_attention_mask(config=llama_config(), **args)
    assert torch.equal(got, masking_utils.sdpa_mask(allow_is_causal_skip=False, **args))


def test_a_missing_causal_mask_with_fewer_queries_is_bottom_right(kernel_calls):
    """A model that keeps only its last queries (Gemma 4's KV-shared layers) with no mask."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    out, _ = tf_hf.attention_forward(module, q, k, k, None)
    bottom_right = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=bottom_right)
    torch.testing.assert_close(out, expected.transpose(1, 2), **TOL)
    assert kernel_calls[0]["window_size"] == (-1, 0) and not kernel_calls[0]["is_causal"]


def test_a_float32_mask_with_a_bfloat16_query_stays_float32(kernel_calls):
    """transformers' sdpa passes a float32 mask on to a bf16 attention unchanged (torch adds it in
    float32); so does the integration. Values near 2000 (bf16's spacing there is 16) show it: the
    mask rounded to bf16 would move every softmax by O(1)."""
    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(2, 4, 6, 8).bfloat16() for _ in range(3))
    mask = 2000 + 3 * torch.rand(2, 1, 6, 6)
    out, _ = tf_hf.attention_forward(module, q, k, v, mask)
    assert kernel_calls[0]["attn_mask"].dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                attn_mask=mask.double()).transpose(1, 2)
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert (out.double() - expected).abs().max() <= 2 * (torch_bf16.double() - expected).abs().max() + 2e-3


def test_flex_only_families_get_no_mask_left_out():
    """PEGASUS-X (served through its flex-attention support) declares is_causal=False on its
    decoder's self-attention: its causal masks are never left out."""
    config = transformers.PegasusXConfig()
    assert tf_hf.build_attention_mask(3, 5, 5, config=config) is not None
    assert masking_utils.sdpa_mask(3, 5, 5) is None
    assert tf_hf.build_attention_mask(3, 5, 5, config=llama_config()) is None


# ------------------------------------------------------------------------------------------------
# What is served and what is refused
# ------------------------------------------------------------------------------------------------
def test_pegasus_x_without_padding_matches_eager():
    config = transformers.PegasusXConfig(
        vocab_size=61, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
        block_size=4, num_global_tokens=2, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
        decoder_start_token_id=0)
    ref, ours = pair(transformers.PegasusXForConditionalGeneration, config)
    ids = torch.randint(3, 61, (2, 8))
    decoder_ids = torch.randint(3, 61, (2, 6))
    assert_logits_and_grads(ref, ours, dict(input_ids=ids, decoder_input_ids=decoder_ids))


def test_kwargs_with_an_unimplemented_meaning_raise():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="Module: attn_implementation='transformer_fast' does not support indices"):
        tf_hf.attention_forward(module, q, q, q, None, indices=torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="does not support sinks"):
        tf_hf.attention_forward(module, q, q, q, None, sinks=torch.zeros(1, 2, 3, 1))
    with pytest.raises(ValueError, match="does not support the keyword argument 'something_new'"):
        tf_hf.attention_forward(module, q, q, q, None, something_new=1)
    with pytest.raises(ValueError, match=r"s_aux of shape \(3,\)"):
        tf_hf.attention_forward(module, q, q, q, None, s_aux=torch.zeros(3))
    with pytest.warns(UserWarning, match="returns no attention weights"):  # as sdpa logs it
        assert tf_hf.attention_forward(module, q, q, q, None, output_attentions=True)[1] is None
    # harmless ones, and None values, pass
    tf_hf.attention_forward(module, q, q, q, None, position_ids=torch.arange(3)[None], output_attentions=False,
                            indices=None, sliding_window=2)


def test_integer_masks():
    """A 4-D mask of 0/1 integers would be added to the scores (no masking at all): refused, as sdpa
    refuses it. A 2-D (batch, keys) padding mask of integers (1 = attend) is a padding mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 8)
    module = torch.nn.Module()
    causal = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 1, 3, 3)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        with pytest.raises(TypeError, match=f"Module: attention_mask must be bool .* or float .*, got {dtype}"):
            tf_hf.attention_forward(module, q, q, q, causal.to(dtype))
        with pytest.raises(TypeError, match="attention_mask must be bool"):  # nor added to a T5-style bias
            tf_hf.attention_forward(module, q, q, q, causal.to(dtype), position_bias=torch.zeros(1, 2, 3, 3))
    padding = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expected, _ = tf_hf.attention_forward(module, q, q, q, padding.bool()[:, None, None, :], is_causal=False)
    got, _ = tf_hf.attention_forward(module, q, q, q, padding, is_causal=False)
    assert torch.equal(got, expected)


def test_models_that_fold_indexer_masks_only_for_eager_and_sdpa_are_refused():
    cls = transformers.DeepseekV32Model
    assert not tf_hf.supports_model(cls)
    assert "passes 'transformer_fast' sparse indices" in tf_hf.unsupported_model_message(cls)
    assert tf_hf.supports_model(transformers.Gemma2Model) and tf_hf.supports_model(transformers.GptOssModel)
    # a vision tower beside such a text model in the same module does not use its attention
    # (in transformers 5.24; 5.17 has no such model)
    if hasattr(transformers, "HYV4VLVisionModel"):
        assert tf_hf.supports_model(transformers.HYV4VLVisionModel)
