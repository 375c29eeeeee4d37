"""Models under ``transformer_fast.distributed.context_parallel`` on 2 gloo ranks: each rank runs
the model on its shard of the sequence (``shard_sequence``, global ``position_ids`` from
``shard_positions``), the loss is summed over every token of the sequence (all-reduced), and the
parameter gradients are summed over the ranks. Compared with the same model in one process in
float64 (the reference): the context-parallel float32 error must stay within 2x the one-process
float32 model's error (plus one float32 ulp of the largest reference value, for values the
one-process model happens to get exact).

A Hugging Face Llama (``attn_implementation="transformer_fast"``, grouped-query attention, RoPE)
in every mode; a converted ``nn.TransformerEncoder`` with a causal mask (softmax and linear
attention); the context manager's semantics; and what the context-parallel forms cannot serve
raising ValueError on every rank. Two spawns of 2 processes (the imports dominate the time)."""
import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_launch import run_ranks

import transformer_fast
from transformer_fast.distributed.context import context_parallel

SEQ, BATCH = 16, 2
LLAMA_MODES = [("ring", True), ("ring", False), ("all_gather", True), ("ulysses", True)]  # (mode, use_cache)


def _errors(got, ref, base):
    """(context-parallel error, one-process float32 error, floor), as max abs differences from ref."""
    floor = torch.finfo(torch.float32).eps * float(ref.abs().max())
    return float((got.double() - ref).abs().max()), float((base.double() - ref).abs().max()), floor


def _too_far(errors):
    """The names whose context-parallel error exceeds 2x the one-process float32 error + floor."""
    return {name: e for name, e in errors.items() if e[0] > 2 * e[1] + e[2]}


def _all_reduced_grads(model):
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[name] = g
    return grads


def _compare(total, grads, ref_loss, ref_params, base_loss, base_grads):
    assert grads.keys() == base_grads.keys()
    errors = {"loss": _errors(total, ref_loss.detach(), base_loss.detach())}
    ref_grads = {n: p.grad for n, p in ref_params}
    for name, grad in grads.items():
        errors[name] = _errors(grad, ref_grads[name], base_grads[name])
    return errors


def _refusal(call):
    """The ValueError's message, or None where the call went through."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# Hugging Face Llama
# ------------------------------------------------------------------------------------------------
def _llama(attn_implementation, dtype=torch.float32):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).to(dtype)


def _llama_loss(model, ids, targets, count, **kwargs):
    logits = model(input_ids=ids, **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count


def _llama_body(rank, world, group):
    import transformer_fast.integrations.huggingface as tf_hf
    from transformer_fast.distributed.sequence import shard_positions, shard_sequence
    tf_hf.register()
    model = _llama("transformer_fast")
    reference = _llama("eager", torch.float64)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 61, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]  # shifted over the whole sequence, before sharding
    targets[1, 3] = -100
    count = int((targets != -100).sum())

    ref_loss = _llama_loss(reference, ids, targets, count)
    ref_loss.backward()
    base_loss = _llama_loss(model, ids, targets, count)
    base_loss.backward()
    base_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    ids_local, targets_local = shard_sequence(ids, group, dim=1), shard_sequence(targets, group, dim=1)
    positions = shard_positions(SEQ, group)[None].expand(BATCH, -1)
    results = {}
    for mode, use_cache in LLAMA_MODES:
        model.zero_grad()
        with context_parallel(group, mode=mode):
            loss = _llama_loss(model, ids_local, targets_local, count, position_ids=positions, use_cache=use_cache)
        loss.backward()
        dist.all_reduce(total := loss.detach().clone())
        results[(mode, use_cache)] = (float(total), _compare(total, _all_reduced_grads(model), ref_loss,
                                                             reference.named_parameters(), base_loss, base_grads))
    return {"parity": results, "refusals": _llama_refusals(model, ids, group, rank)}


def _llama_refusals(model, ids, group, rank):
    from transformer_fast.distributed.sequence import shard_positions, shard_sequence
    ids_local, positions = shard_sequence(ids, group, dim=1), shard_positions(SEQ, group)[None]

    def under_cp(**kwargs):
        with context_parallel(group):
            return model(**kwargs)

    refusals = {}
    # Padding at the end of the sequence: only rank 0 (which holds the last chunk) sees it, and
    # both ranks raise (else rank 1 would wait in the ring for rank 0).
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[0, -2:] = 0
    mask_local = shard_sequence(padding, group, dim=1)
    assert bool(mask_local.all()) == (rank == 1)
    refusals["padding"] = _refusal(lambda: under_cp(input_ids=ids_local, position_ids=positions,
                                                    attention_mask=mask_local))
    # No position_ids: the model numbers the shard's rows 0..N_local-1
    refusals["no position_ids"] = _refusal(lambda: under_cp(input_ids=ids_local))
    # Packed sequences, which transformers separates (without a cache) by a mask of the local lengths
    packed = torch.cat([torch.arange(10), torch.arange(6)])[None]
    refusals["packed"] = _refusal(lambda: under_cp(input_ids=ids_local, use_cache=False,
                                                   position_ids=shard_sequence(packed, group, dim=1)))
    # Decoding against the cache a context-parallel forward filled
    cache = under_cp(input_ids=ids_local, position_ids=positions).past_key_values
    refusals["decoding"] = _refusal(lambda: under_cp(input_ids=ids_local[:, :1], position_ids=positions[:, -1:] + 1,
                                                     past_key_values=cache))
    # An all-ones attention_mask is no padding: served, and the same as none
    ones = under_cp(input_ids=ids_local, position_ids=positions, attention_mask=torch.ones_like(ids_local)).logits
    refusals["all-ones mask equals none"] = bool(torch.equal(
        ones, under_cp(input_ids=ids_local, position_ids=positions).logits))
    return refusals


@pytest.fixture(scope="module")
def llama_ranks():
    pytest.importorskip("transformers")
    return run_ranks(_llama_body, 2)


@pytest.mark.parametrize("mode", LLAMA_MODES, ids=lambda m: f"{m[0]}-cache{m[1]}")
def test_llama_loss_and_gradients_match_one_process(llama_ranks, mode):
    """Ring (with transformers' cache, and without: then transformers reads a packed sequence off
    the shard's position_ids, which the integration recognises as the shard's), all-gather, Ulysses."""
    (loss0, errors), (loss1, _) = (r["parity"][mode] for r in llama_ranks)
    assert loss0 == loss1
    assert not _too_far(errors), _too_far(errors)


def test_llama_refuses_what_it_cannot_serve_on_every_rank(llama_ranks):
    expected = {"padding": "padding", "no position_ids": "position_ids are 0..7",
                "packed": "position_ids that are not this rank's shard", "decoding": "cache holding earlier tokens"}
    for refusals in (r["refusals"] for r in llama_ranks):
        for case, words in expected.items():
            assert refusals[case] is not None and words in refusals[case], (case, refusals[case])
        assert refusals["all-ones mask equals none"] is True


# ------------------------------------------------------------------------------------------------
# transformer_fast modules (a converted nn.TransformerEncoder) and the public functions
# ------------------------------------------------------------------------------------------------
def _encoder(attention):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=24, dropout=0.0, batch_first=True)
    torch_model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return torch_model, transformer_fast.convert(copy.deepcopy(torch_model), attention=attention)


def _encoder_loss(model, x, weight):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)  # the local length
    return (model(x, mask=mask, is_causal=True) * weight).sum()


def _encoder_errors(group, attention):
    from transformer_fast.distributed.sequence import shard_sequence
    torch_model, model = _encoder(attention)
    # softmax: torch's own encoder in float64; linear: the converted one in float64 (torch has none)
    reference = (torch_model if attention == "softmax" else copy.deepcopy(model)).double()
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(BATCH, SEQ, 16, generator=gen), torch.randn(BATCH, SEQ, 16, generator=gen)
    ref_loss = _encoder_loss(reference, x.double(), weight.double())
    ref_loss.backward()
    base_loss = _encoder_loss(model, x, weight)
    base_loss.backward()
    base_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with context_parallel(group):
        loss = _encoder_loss(model, shard_sequence(x, group, dim=1), shard_sequence(weight, group, dim=1))
    loss.backward()
    dist.all_reduce(total := loss.detach().clone())
    return float(total), _compare(total, _all_reduced_grads(model), ref_loss, reference.named_parameters(),
                                  base_loss, base_grads)


def _semantics(group, world):
    from transformer_fast.distributed import context
    from transformer_fast.distributed.sequence import shard_sequence
    attention_module = __import__("transformer_fast.attention", fromlist=["_"])
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, SEQ, 8, generator=gen) for _ in range(3))
    q_local, k_local, v_local = (shard_sequence(t, group) for t in (q, k, v))
    n_local = SEQ // world
    whole = transformer_fast.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    expected = shard_sequence(whole, group).float()
    local_only = transformer_fast.scaled_dot_product_attention(q_local, k_local, v_local, is_causal=True)

    def sdpa(*args, **kwargs):
        return transformer_fast.scaled_dot_product_attention(*args, **kwargs)

    facts, refusals = {}, {}
    outer = context_parallel(group, mode="ring")
    with outer:
        routed = sdpa(q_local, k_local, v_local, is_causal=True)
        with context_parallel(group, mode="all_gather"):  # nested: the inner setting counts
            facts["inner mode"] = context.active().mode
            with outer:  # the same object entered again
                facts["re-entered mode"] = context.active().mode
            gathered = sdpa(q_local, k_local, v_local, is_causal=True)
        facts["mode after the inner block"] = context.active().mode
        other_thread = []
        thread = threading.Thread(target=lambda: other_thread.append(sdpa(q_local, k_local, v_local, is_causal=True)))
        thread.start()
        thread.join(60)
        refusals["attn_mask"] = _refusal(lambda: sdpa(q_local, k_local, v_local,
                                                      attn_mask=torch.ones(n_local, n_local, dtype=torch.bool)))
        padded = torch.zeros(1, n_local, dtype=torch.bool)
        refusals["key_padding_mask"] = _refusal(lambda: sdpa(q_local, k_local, v_local, key_padding_mask=padded))
        refusals["local queries"] = _refusal(lambda: sdpa(q_local[:, :, :1], k_local, v_local))
        refusals["backend"] = _refusal(lambda: sdpa(q_local, k_local, v_local, backend="cpp"))
        refusals["decoding step"] = _refusal(lambda: transformer_fast.linear_attention_step(
            q_local[:, :, 0], k_local[:, :, 0], v_local[:, :, 0]))
        mha, x = transformer_fast.MultiheadAttention(16, 2, batch_first=True), torch.randn(1, n_local, 16)
        refusals["need_weights"] = _refusal(lambda: mha(x, x, x))  # torch's unfused path: not routed
    facts["restored on exit"] = context.active() is None and attention_module._context_parallel is None
    try:
        with context_parallel(group):
            raise KeyError("x")
    except KeyError:
        facts["restored on an exception"] = context.active() is None and attention_module._context_parallel is None
    after = sdpa(q_local, k_local, v_local, is_causal=True)

    facts["ring error"] = float((routed - expected).abs().max())
    facts["all_gather error"] = float((gathered - expected).abs().max())
    facts["shard-local error"] = float((local_only - expected).abs().max())
    facts["other thread is shard-local"] = bool(torch.equal(other_thread[0], local_only))
    facts["shard-local after the block"] = bool(torch.equal(after, local_only))
    return facts, refusals


def _modules_body(rank, world, group):
    return {"encoder": {attention: _encoder_errors(group, attention) for attention in ("softmax", "linear")},
            "semantics": _semantics(group, world)}


@pytest.fixture(scope="module")
def module_ranks():
    return run_ranks(_modules_body, 2)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_converted_encoder_with_causal_mask(module_ranks, attention):
    """torch's encoder passes is_causal with its causal mask (built for the local length), so the
    converted attention passes is_causal alone: causal attention over the whole sequence."""
    (loss0, errors), (loss1, _) = (r["encoder"][attention] for r in module_ranks)
    assert loss0 == loss1
    assert not _too_far(errors), _too_far(errors)


def test_context_manager_nests_restores_and_stays_in_its_thread(module_ranks):
    for facts, _ in (r["semantics"] for r in module_ranks):
        assert facts["inner mode"] == "all_gather" and facts["re-entered mode"] == "ring"
        assert facts["mode after the inner block"] == "ring"
        assert facts["restored on exit"] and facts["restored on an exception"]
        assert facts["ring error"] < 1e-5 and facts["all_gather error"] < 1e-5
        assert facts["shard-local error"] > 1e-2  # what an unrouted call gives: the shards alone
        assert facts["other thread is shard-local"] and facts["shard-local after the block"]


def test_public_functions_refuse_what_the_forms_cannot_serve(module_ranks):
    expected = {"attn_mask": "does not take an attn_mask", "key_padding_mask": "does not take a key_padding_mask",
                "local queries": "1 local queries against 8 local keys", "backend": "backend='cpp'",
                "decoding step": "linear_attention_step under context_parallel",
                "need_weights": "MultiheadAttention with need_weights=True"}
    for _, refusals in (r["semantics"] for r in module_ranks):
        for case, words in expected.items():
            assert refusals[case] is not None and words in refusals[case], (case, refusals[case])


def test_arguments_checked_without_a_group():
    with pytest.raises(ValueError, match="mode must be one of"):
        context_parallel(mode="rings")
    with pytest.raises(ValueError, match="layout must be one of"):
        context_parallel(layout="zigzag")
    with pytest.raises(TypeError, match="group must be"):
        context_parallel(group=3)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            with context_parallel():
                pass
