"""attn_implementation="transformer_fast" under torch.compile: tiny BERT, Llama (GQA, attention
dropout), Mistral (a sliding window), GPT-2 and T5 models in training mode trace to as many graphs
as on "sdpa", one with torch 2.13 (the mask builder's per-family lookup imports a module, which
Dynamo cannot trace: it is answered while tracing, torch.compiler.assume_constant_result);
compiled, they give what eager gives, and a compiled decoding step on a static KV cache gives sdpa's logits."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformer_fast.integrations.huggingface as tf_hf  # noqa: E402

SMALL = dict(vocab_size=100)


def _family(name):
    t = transformers
    if name == "bert":
        return t.BertModel, t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, attention_probs_dropout_prob=0.1, **SMALL)
    if name == "llama":
        return t.LlamaModel, t.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=128, attention_dropout=0.1,
                                           **SMALL)
    if name == "mistral":
        return t.MistralModel, t.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128, sliding_window=4,
                                               **SMALL)
    if name == "gpt2":
        return t.GPT2Model, t.GPT2Config(n_embd=64, n_layer=2, n_head=4, **SMALL)
    return t.T5Model, t.T5Config(d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16, **SMALL)


def _inputs(name):
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    if name == "t5":
        inputs["decoder_input_ids"] = ids
    return inputs


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tf_hf.register()


@pytest.mark.parametrize("name", ["bert", "llama", "mistral", "gpt2", "t5"])
def test_training_model_traces_to_as_many_graphs_as_on_sdpa(name):
    model_cls, config = _family(name)
    counts = {}
    for implementation in ("sdpa", "transformer_fast"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = model_cls._from_config(config, attn_implementation=implementation).train()
        explained = torch._dynamo.explain(model)(**_inputs(name))
        counts[implementation] = (explained.graph_count, explained.graph_break_count)
    # (1, 0) on torch 2.13; torch 2.11's Dynamo breaks T5's sdpa model too, at the same places
    assert counts["transformer_fast"] == counts["sdpa"], counts


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_compiled_model_gives_what_eager_gives(name):
    model_cls, config = _family(name)
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="transformer_fast").eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    inputs = _inputs(name)
    if name == "t5":  # torch 2.11's Dynamo cannot build T5's DynamicCache (it deep-copies the config)
        inputs["use_cache"] = False
    with torch.no_grad():
        expected, got = model(**inputs).last_hidden_state, compiled(**inputs).last_hidden_state
    valid = inputs["attention_mask"].bool() if name == "llama" else slice(None)  # padded queries: any value
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-4)


def test_compiled_static_cache_decoding_gives_sdpa_logits():
    model_cls, config = transformers.LlamaForCausalLM, _family("llama")[1]
    config.attention_dropout = 0.0
    torch.manual_seed(0)
    ours = model_cls._from_config(config, attn_implementation="transformer_fast").eval()
    ref = model_cls._from_config(config, attn_implementation="sdpa").eval()
    ref.load_state_dict(ours.state_dict())
    torch._dynamo.reset()
    ids = _inputs("llama")["input_ids"]
    logits = {}
    with torch.no_grad():
        for name, model, step in (("sdpa", ref, ref.forward),
                                  ("ours", ours, torch.compile(ours.forward, fullgraph=True, backend="aot_eager"))):
            cache = transformers.StaticCache(config=config, max_cache_len=32)
            model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ids.shape[1]))
            token, steps = ids[:, -1:], []
            for position in range(ids.shape[1], ids.shape[1] + 4):
                out = step(token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([position]))
                token = out.logits[:, -1:].argmax(-1)
                steps.append(out.logits)
            logits[name] = torch.cat(steps, dim=1)
    torch.testing.assert_close(logits["ours"], logits["sdpa"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["bert", "llama", "mistral", "gpt2", "t5"])
def test_exported_model_gives_what_eager_gives(name):
    """torch.export traces the op into the exported program, which then computes what the model does."""
    model_cls, config = _family(name)
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="transformer_fast").eval()
    inputs = dict(_inputs(name), use_cache=False) if name != "bert" else _inputs(name)
    exported = torch.export.export(model, (), inputs)
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert any(op.startswith("transformer_fast.") for op in ops), sorted(ops)
    with torch.no_grad():
        expected, got = model(**inputs).last_hidden_state, exported.module()(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
