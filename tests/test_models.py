"""The encoder-decoder Transformer: positional encoding, padding, incremental decoding, gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from transformer_fast.nn import PositionalEncoding, Seq2SeqTransformer

PAD, BOS, EOS, VOCAB = 0, 1, 2, 13


def make_model(attention="softmax", norm_first=False, d_model=24, nhead=3, dropout=0.1, **kwargs):
    """A small model with random weights large enough that its greedy outputs vary with the input
    and the position (the trained-from-scratch initialisation emits one token everywhere)."""
    kwargs = dict(dict(num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=40, max_len=64), **kwargs)
    model = Seq2SeqTransformer(VOCAB, pad_id=PAD, d_model=d_model, nhead=nhead, dropout=dropout,
                               norm_first=norm_first, attention=attention, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
        model.generator.bias.zero_()
    return model


def random_src(B=4, S=17, lengths=(17, 9, 1, 13)):
    src = torch.randint(3, VOCAB, (B, S))
    for b, n in enumerate(lengths):
        src[b, n:] = PAD
    return src


ATTENTIONS = ["softmax", "linear"]


# ----------------------------------------------------------------------------------------------
# Positional encoding
# ----------------------------------------------------------------------------------------------
def test_positional_encoding_values():
    d = 8
    pe = PositionalEncoding(d, dropout=0.0, max_len=10).pe
    assert pe.shape == (10, d)
    for pos in range(4):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)
    # a few hand-evaluated values: pos 1, i = 1 -> 1 / 10000**0.25 = 0.1
    assert pe[1, 2].item() == pytest.approx(math.sin(0.1), abs=1e-7)
    assert pe[3, 5].item() == pytest.approx(math.cos(0.03), abs=1e-7)  # i = 2: 3 / 10000**0.5
    assert pe[2, 7].item() == pytest.approx(math.cos(2e-3), abs=1e-7)  # i = 3: 2 / 10000**0.75


def test_positional_encoding_forward_offset_odd_dim_and_limits():
    module = PositionalEncoding(7, dropout=0.0, max_len=20)
    assert module.pe.shape == (20, 7)
    assert module.pe[5, 6].item() == pytest.approx(math.sin(5 / 10000 ** (6 / 7)), abs=1e-7)
    x = torch.randn(2, 3, 7)
    torch.testing.assert_close(module(x, offset=4), x + module.pe[4:7])
    with pytest.raises(ValueError, match="max_len"):
        module(torch.randn(1, 5, 7), offset=16)


# ----------------------------------------------------------------------------------------------
# Forward, padding, gradients
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_shape_and_source_padding(attention, norm_first):
    model = make_model(attention, norm_first).eval()
    src = random_src()
    tgt = torch.randint(3, VOCAB, (4, 5))
    logits = model(src, tgt)
    assert logits.shape == (4, 5, VOCAB)
    assert torch.isfinite(logits).all()
    # padded source positions are masked in every encoder layer and every cross-attention:
    # changing the tokens there (keeping the mask) must not change the logits
    mask = src == PAD
    other = torch.where(mask, torch.randint(3, VOCAB, src.shape), src)
    torch.testing.assert_close(model(other, tgt, src_key_padding_mask=mask), logits, rtol=0, atol=1e-5)
    assert (model(other, tgt) - logits).abs().max() > 1e-4  # unmasked, they matter
    # while changing an unpadded source token does change them
    changed = src.clone()
    changed[1, 0] = 3 if src[1, 0] != 3 else 4
    assert (model(changed, tgt)[1] - logits[1]).abs().max() > 1e-4


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_target_padding_and_causality(attention):
    model = make_model(attention).eval()
    src = random_src()
    tgt = torch.randint(3, VOCAB, (4, 6))
    tgt[0, 4:] = PAD
    logits = model(src, tgt)
    # a later target token never changes earlier logits (causal), padded or not
    later = tgt.clone()
    later[:, 3] = torch.where(later[:, 3] == 5, 6, 5)
    later[0, 4:] = 7
    torch.testing.assert_close(model(src, later)[:, :3], logits[:, :3], rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradients_reach_every_parameter(attention):
    model = make_model(attention, norm_first=(attention == "linear")).train()
    src = random_src()
    tgt = torch.randint(3, VOCAB, (4, 6))
    tgt[2, 3:] = PAD
    logits = model(src, tgt[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1), ignore_index=PAD)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_bad_input():
    model = make_model()
    with pytest.raises(ValueError, match="src"):
        model(torch.randn(2, 3), torch.randint(0, VOCAB, (2, 3)))
    with pytest.raises(ValueError, match="batch size"):
        model(torch.randint(0, VOCAB, (2, 3)), torch.randint(0, VOCAB, (3, 3)))
    with pytest.raises(ValueError, match="attention"):
        make_model("sparse")
    with pytest.raises(ValueError, match="divisible"):
        make_model(d_model=10, nhead=3)


# ----------------------------------------------------------------------------------------------
# Incremental decoding
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_generate_with_cache_matches_full_recompute(attention, norm_first):
    model = make_model(attention, norm_first, nhead=2).train()  # generate switches to eval itself
    src = random_src()
    cached, cached_logits = model.generate(src, 19, BOS, return_logits=True)
    full, full_logits = model.generate(src, 19, BOS, use_cache=False, return_logits=True)
    assert model.training
    assert cached.shape == (4, 20) and cached_logits.shape == (4, 19, VOCAB)
    assert torch.equal(cached, full)
    torch.testing.assert_close(cached_logits, full_logits, rtol=0, atol=1e-4)
    assert len(set(cached[:, 1:].flatten().tolist())) > 1  # a non-degenerate random model
    # the step logits are the teacher-forced logits of the generated prefix
    model.eval()
    prefix = cached[:, :-1]  # (the random model may emit PAD: it is a token here, not padding)
    torch.testing.assert_close(model(src, prefix, tgt_key_padding_mask=torch.zeros_like(prefix, dtype=torch.bool)),
                               cached_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_stops_finished_sequences(attention):
    model = make_model(attention).eval()
    src = random_src()
    free = model.generate(src, 12, BOS)
    eos = int(free[0, 3])  # make the 3rd token sequence 0 produces the end-of-sequence token
    out = model.generate(src, 12, BOS, eos)
    for b in range(src.shape[0]):
        hits = (free[b, 1:] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else free.shape[1] - 1  # tokens up to and with eos
        assert torch.equal(out[b, :end + 1], free[b, :end + 1])
        assert (out[b, end + 1:] == PAD).all()
    assert out.shape[1] <= free.shape[1]
    assert torch.equal(out, model.generate(src, 12, BOS, eos, use_cache=False))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_decode_step_cache_growth(attention):
    model = make_model(attention, nhead=3).eval()
    src = random_src(B=2, S=11, lengths=(11, 4))
    with torch.no_grad():
        memory, mask = model.encode(src)
        cache = model.init_cache(memory, mask)
        tokens = torch.randint(3, VOCAB, (2, 7))
        tokens[:, 0] = BOS
        step_logits = []
        for t in range(tokens.shape[1]):
            step_logits.append(model.decode_step(tokens[:, t], cache))
            assert cache.position == t + 1
            for layer_cache in cache.layers:
                if attention == "softmax":
                    assert layer_cache.self_k.shape == (2, 3, t + 1, 8)  # grows by one per token
                    assert layer_cache.self_v.shape == (2, 3, t + 1, 8)
                    assert layer_cache.cross_k.shape == (2, 3, 11, 8)  # the memory, projected once
                    assert layer_cache.self_state is None
                else:
                    assert layer_cache.self_k is None and layer_cache.cross_k is None
                    assert layer_cache.self_state.S.shape == (2, 3, 8, 8)  # constant-size state
                    assert layer_cache.self_state.z.shape == (2, 3, 8)
                    assert layer_cache.cross_state.S.shape == (2, 3, 8, 8)
        full = model.decode(tokens, memory, mask)
    torch.testing.assert_close(torch.stack(step_logits, 1), full, rtol=0, atol=1e-4)


def test_generate_checks_its_length_budget_up_front(monkeypatch):
    """Past max_len, generate refuses before decoding anything rather than failing mid-decode."""
    model = make_model(max_len=8)
    steps = []
    original = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda *a: steps.append(1) or original(*a))
    with pytest.raises(ValueError, match="max_len=8"):
        model.generate(random_src(B=2, S=5, lengths=(5, 3)), max_new_tokens=9, bos_id=BOS)
    assert steps == []
    tokens = model.generate(random_src(B=2, S=5, lengths=(5, 3)), max_new_tokens=8, bos_id=BOS)
    assert tokens.shape == (2, 9) and len(steps) == 8
