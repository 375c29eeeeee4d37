"""The modules where torch's own machinery calls them: nested tensors (torch.nn.TransformerEncoder
makes them in eval mode), module hooks and overridden forwards inside our pre-norm stacks, and
torch's inference fast path inside user subclasses that convert leaves alone."""
import copy

import pytest
import torch
from torch import nn

import transformer_fast as tf


def _nested():
    torch.manual_seed(0)
    return torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)])


def test_layer_norm_takes_nested_tensors():
    """As nn.LayerNorm does (torch's own computation), with the residual added too."""
    x, r = _nested(), _nested()
    ours, theirs = tf.LayerNorm(16), nn.LayerNorm(16)
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(ours(x).to_padded_tensor(0), theirs(x).to_padded_tensor(0))
    y, h = ours(x, residual=r)
    assert torch.equal(h.to_padded_tensor(0), (x + r).to_padded_tensor(0))
    assert torch.equal(y.to_padded_tensor(0), theirs(x + r).to_padded_tensor(0))


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_encoder_runs_our_layers_on_nested_tensors(norm_first):
    """torch.nn.TransformerEncoder (enable_nested_tensor, the default) turns a padded batch into a
    nested tensor in eval mode under no_grad and hands it to each layer: ours give torch's result."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first),
                                   2).eval()
    ours = copy.deepcopy(theirs)
    for layer in ours.layers:
        tf.TransformerEncoderLayer.from_torch(layer)
    x = torch.randn(2, 6, 16)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with torch.no_grad():
        expected = theirs(x, src_key_padding_mask=padding)
        got = ours(x, src_key_padding_mask=padding)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_linear_attention_refuses_nested_tensors():
    mha = tf.MultiheadAttention(16, 4, batch_first=True, attention="linear")
    x = _nested()
    with pytest.raises(ValueError, match="attention='linear' does not take nested tensors"):
        mha(x, x, x, need_weights=False)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_pre_norm_stacks_call_hooked_and_overriding_layers(stack):
    """A pre-norm stack chains its layers' (delta, residual) pairs only for layers whose call would
    run our forward alone: a layer with a forward hook, a forward pre-hook or an overridden forward
    is called as a module, as in torch."""
    torch.manual_seed(0)
    layer_cls = tf.TransformerEncoderLayer if stack == "encoder" else tf.TransformerDecoderLayer
    stack_cls = tf.TransformerEncoder if stack == "encoder" else tf.TransformerDecoder
    x = torch.randn(5, 2, 16)

    def run(model):
        return model(x) if stack == "encoder" else model(x, x)

    model = stack_cls(layer_cls(16, 4, 32, norm_first=True, dropout=0.0), 3)
    plain = run(model)
    calls = []
    model.layers[0].register_forward_hook(lambda module, args, out: calls.append("hook"))
    model.layers[1].register_forward_pre_hook(lambda module, args: calls.append("pre-hook"))
    torch.testing.assert_close(run(model), plain, atol=1e-5, rtol=1e-5)  # the same result, unchained
    assert calls == ["hook", "pre-hook"]

    class Zeroed(layer_cls):
        def forward(self, *args, **kwargs):
            return 0 * super().forward(*args, **kwargs)

    zeroed = stack_cls(Zeroed(16, 4, 32, norm_first=True, dropout=0.0), 2)
    assert torch.equal(run(zeroed), torch.zeros(5, 2, 16))


def test_convert_to_linear_refuses_subclassed_encoder_layers():
    """A user subclass of nn.TransformerEncoderLayer keeps torch's forward, whose inference fast path
    (eval, no grad) reads self_attn's weights without calling it: linear attention given to its
    self_attn would apply only with grad on. convert refuses, and changes nothing."""
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    model = nn.Sequential(nn.LayerNorm(16), MyLayer(16, 4, 32, batch_first=True))
    with pytest.raises(ValueError, match=r"1 is a .*MyLayer.*fast path would bypass the linear attention"):
        tf.convert(model, attention="linear")
    assert type(model[0]) is nn.LayerNorm and type(model[1].self_attn) is nn.MultiheadAttention
    tf.convert(model)  # softmax: the fast path computes what our attention does
    assert type(model[1].self_attn) is tf.MultiheadAttention
