"""transformer_fast.convert: what it replaces (and what it leaves alone), and that converted models
compute what the originals did, forward and backward (fp32: atol=1e-5, rtol=1e-4, the kernels'
fp32 error at these sizes)."""
import copy
import logging

import pytest
import torch
from torch import nn

import transformer_fast as tf

TOL = dict(atol=1e-5, rtol=1e-4)
E, H = 20, 4  # head dim 5


def outputs_and_grads(model, inputs, run):
    args = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = run(model, *args)
    dout = torch.randn_like(out, generator=torch.Generator().manual_seed(7))
    float_args = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(out, float_args + list(model.parameters()), dout)
    return out, grads


def assert_same_function(original, converted, inputs, run=lambda m, *a: m(*a)):
    out_a, grads_a = outputs_and_grads(original, inputs, run)
    out_b, grads_b = outputs_and_grads(converted, inputs, run)
    torch.testing.assert_close(out_b, out_a, **TOL)
    assert len(grads_a) == len(grads_b)
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"gradient {i}: {m}")


class Block(nn.Module):
    """A custom module nesting the convertible ones among others."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True)
        self.norm = nn.RMSNorm(E)
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        y = self.attn(x, x, x, need_weights=False)[0]
        return self.proj(self.norm(x + y))


class NotConverted(nn.LayerNorm):
    """A user subclass: its forward may differ, so convert leaves it alone."""

    def forward(self, x):
        return super().forward(x) * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E), nn.GELU())
        self.blocks = nn.ModuleList([Block(), Block()])
        self.heads = nn.ModuleDict({
            "encoder": nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, 0.0, batch_first=True,
                                                                        norm_first=True), 2, nn.LayerNorm(E),
                                             enable_nested_tensor=False),
            "mixer": nn.MultiheadAttention(E, H, batch_first=True, kdim=7, vdim=9),
        })
        self.odd = NotConverted(E)

    def forward(self, x, mem_k, mem_v):
        x = self.seq(x)
        for block in self.blocks:
            x = block(x)
        x = self.heads["encoder"](x, is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))
        x = x + self.heads["mixer"](x, mem_k, mem_v)[0]  # need_weights=True: torch's path
        x = x + self.heads["mixer"](x, mem_k, mem_v, need_weights=False)[0]
        return self.odd(x)


EXPECTED = {  # name -> our class, for Model
    "seq.1": tf.LayerNorm,
    "blocks.0.attn": tf.MultiheadAttention, "blocks.0.norm": tf.RMSNorm,
    "blocks.1.attn": tf.MultiheadAttention, "blocks.1.norm": tf.RMSNorm,
    "heads.encoder": tf.TransformerEncoder,
    "heads.encoder.layers.0": tf.TransformerEncoderLayer, "heads.encoder.layers.0.self_attn": tf.MultiheadAttention,
    "heads.encoder.layers.0.norm1": tf.LayerNorm, "heads.encoder.layers.0.norm2": tf.LayerNorm,
    "heads.encoder.layers.1": tf.TransformerEncoderLayer, "heads.encoder.layers.1.self_attn": tf.MultiheadAttention,
    "heads.encoder.layers.1.norm1": tf.LayerNorm, "heads.encoder.layers.1.norm2": tf.LayerNorm,
    "heads.encoder.norm": tf.LayerNorm,
    "heads.mixer": tf.MultiheadAttention,
}


def test_convert_nested_model(caplog):
    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_()
    types_before = {name: type(m) for name, m in model.named_modules()}
    with caplog.at_level(logging.INFO, logger="transformer_fast.convert"):
        converted, report = tf.convert(model, inplace=False, return_report=True)
    assert {r.name: r.new for r in report} == EXPECTED
    assert all(r.old is types_before[r.name] for r in report)
    assert "heads.mixer" in caplog.text and "MultiheadAttention" in caplog.text
    # the original is untouched (deep copy), the rest of the converted model is as it was
    assert {name: type(m) for name, m in model.named_modules()} == types_before
    for name, m in converted.named_modules():
        assert type(m) is EXPECTED.get(name, types_before[name]), name
    assert type(converted.odd) is NotConverted
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), converted.parameters()))
    x, mem_k, mem_v = torch.randn(2, 6, E), torch.randn(2, 9, 7), torch.randn(2, 9, 9)
    assert_same_function(model, converted, [x, mem_k, mem_v])
    # the state dict is the same, keys and values
    assert list(model.state_dict()) == list(converted.state_dict())
    converted.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(converted.state_dict(), strict=True)


@pytest.mark.parametrize("norm_first", [False, True])
def test_convert_torch_transformer(norm_first):
    model = nn.Transformer(E, H, 2, 2, 32, dropout=0.0, norm_first=norm_first, batch_first=True).eval()
    converted = tf.convert(copy.deepcopy(model))
    assert type(converted) is tf.Transformer and not converted.training
    assert type(converted.decoder.layers[1].multihead_attn) is tf.MultiheadAttention
    src, tgt = torch.randn(3, 7, E), torch.randn(3, 5, E)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, -2:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(5)

    def run(m, s, t):
        return m(s, t, tgt_mask=mask, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)

    assert_same_function(model, converted, [src, tgt], run)
    with torch.no_grad():  # eval + no grad: torch's fast paths; compare the unpadded outputs
        torch.testing.assert_close(run(converted, src, tgt), run(model, src, tgt), **TOL)


def test_convert_inplace_and_idempotent():
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 32, 0.0), nn.LayerNorm(E)).train()
    same, report = tf.convert(model, inplace=True, return_report=True)
    assert same is model and type(model[0]) is tf.TransformerEncoderLayer and type(model[1]) is tf.LayerNorm
    assert model.training and model[0].self_attn.training
    assert [r.name for r in report] == ["0", "0.self_attn", "0.norm1", "0.norm2", "1"]
    again, report = tf.convert(model, return_report=True)
    assert report == [] and type(again[0]) is tf.TransformerEncoderLayer


def test_convert_in_place_keeps_the_parameters_an_optimizer_holds():
    """The README's ``model = convert(model)``: the same model and the same Parameter objects, so
    an optimizer built before the swap trains the converted model (not an orphaned copy's
    originals), and nothing is copied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 32, 0.0, batch_first=True), nn.LayerNorm(E))
    params = list(model.parameters())
    storage = [p.data_ptr() for p in params]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    converted = tf.convert(model)
    assert converted is model and type(model[0]) is tf.TransformerEncoderLayer
    assert all(a is b for a, b in zip(params, converted.parameters()))
    assert storage == [p.data_ptr() for p in converted.parameters()]
    before = [p.detach().clone() for p in params]
    converted(torch.randn(2, 5, E)).square().sum().backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, converted.parameters()))


def test_convert_inplace_false_copies():
    model = nn.Sequential(nn.LayerNorm(E))
    converted = tf.convert(model, inplace=False)
    assert converted is not model and type(model[0]) is nn.LayerNorm and type(converted[0]) is tf.LayerNorm
    assert converted[0].weight is not model[0].weight


def test_convert_root_module_keeps_dtype_and_mode():
    mha = nn.MultiheadAttention(E, H).double().eval()
    converted = tf.convert(mha, inplace=False)
    assert type(converted) is tf.MultiheadAttention and type(mha) is nn.MultiheadAttention
    assert converted.in_proj_weight.dtype == torch.float64 and not converted.training
    x = torch.randn(5, 2, E, dtype=torch.float64)
    torch.testing.assert_close(converted(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0],
                               atol=1e-12, rtol=1e-10)


def test_convert_linear_attention():
    model = nn.Transformer(E, H, 1, 1, 32, dropout=0.0)
    converted = tf.convert(model, attention="linear")
    kinds = {m.attention for m in converted.modules() if isinstance(m, tf.MultiheadAttention)}
    assert kinds == {"linear"}
    out = converted(torch.randn(6, 2, E), torch.randn(4, 2, E),
                    tgt_mask=nn.Transformer.generate_square_subsequent_mask(4))
    assert out.shape == (4, 2, E) and torch.isfinite(out).all()


def test_convert_bad_arguments():
    with pytest.raises(ValueError, match="attention"):
        tf.convert(nn.LayerNorm(E), attention="flash")
    with pytest.raises(TypeError, match="model"):
        tf.convert(copy)
