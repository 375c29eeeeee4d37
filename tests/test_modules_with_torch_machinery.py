"""The modules where torch's own machinery calls them: nested tensors (torch.nn.TransformerEncoder
makes them in eval mode), module hooks and overridden forwards on our layers and their norms,
user layers inside our stacks, torch's inference fast path inside user subclasses that convert
leaves alone, and numpy sizes."""
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


def test_functions_refuse_nested_tensors():
    """The ops have no nested-tensor kernels: the functions name the argument (the modules above run
    torch's own computation instead)."""
    x = _nested()
    q = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=torch.jagged)
    strided = torch.randn(2, 2, 3, 8)
    message = "must be a strided tensor, got a nested tensor"
    for call, name in ((lambda: tf.layer_norm(x, (16,)), "input"), (lambda: tf.rms_norm(x, (16,)), "input"),
                       (lambda: tf.layer_norm(torch.randn(2, 16), (16,), residual=x), "residual"),
                       (lambda: tf.scaled_dot_product_attention(q, q, q), "query"),
                       (lambda: tf.scaled_dot_product_attention(strided, q, q), "key"),
                       (lambda: tf.linear_attention(q, q, q), "query")):
        with pytest.raises(TypeError, match=f"^{name} {message}"):
            call()


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


def _recording_hooks(module, log, name):
    """Records what `module`'s forward pre-hook and forward hook see, and doubles its output (a
    hook that changes the result must change it as it does in torch)."""
    module.register_forward_pre_hook(lambda m, args: log.append((name, "in", [a.clone() for a in args])))

    def hook(m, args, out):
        log.append((name, "out", out.clone() if isinstance(out, torch.Tensor) else out))
        return 2 * out
    module.register_forward_hook(hook)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_norm_hooks_see_what_torch_passes(kind, norm_first):
    """Hooks on a layer's norms (and a stack's final norm) see torch's calls: one input, the sum of
    the residual and the sublayer's output, and a tensor out, so the residual add is not fused for
    hooked norms; a hook's returned output is used as in torch."""
    torch.manual_seed(0)
    if kind == "encoder":
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, norm_first=norm_first)
        theirs = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        norms = ["norm1", "norm2"]
    else:
        layer = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, norm_first=norm_first)
        theirs = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(16))
        norms = ["norm1", "norm2", "norm3"]
    ours = tf.convert(copy.deepcopy(theirs))
    assert isinstance(ours.layers[0].norm1, tf.LayerNorm)
    x = torch.randn(5, 2, 16)
    logs = []
    for model in (theirs, ours):
        log = []
        for i, layer in enumerate(model.layers):
            for name in norms:
                _recording_hooks(getattr(layer, name), log, f"layers.{i}.{name}")
        _recording_hooks(model.norm, log, "norm")
        out = model(x) if kind == "encoder" else model(x, x)
        logs.append((out, log))
    (expected, log_t), (got, log_o) = logs
    assert [entry[:2] for entry in log_o] == [entry[:2] for entry in log_t]
    for (name, what, seen_o), (_, _, seen_t) in zip(log_o, log_t):
        if what == "in":
            assert len(seen_o) == len(seen_t) == 1, f"{name}: {len(seen_o)} positional inputs"
            seen_o, seen_t = seen_o[0], seen_t[0]
        assert isinstance(seen_o, torch.Tensor), f"{name} returned {type(seen_o).__name__}"
        torch.testing.assert_close(seen_o, seen_t, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {what}: {m}")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class _RecordingLayer(nn.Module):
    """A user's own layer in a torch stack: records how the stack calls it."""

    def __init__(self, calls):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(16, 4)  # torch's stacks read self_attn.batch_first
        self.calls = calls

    def forward(self, x, *args, **kwargs):
        self.calls.append((len(args), {k: v.clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in kwargs.items()}))
        return x + 1


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_stacks_call_custom_layers_as_torch_does(kind):
    """A stack calls a layer that is not ours with torch's arguments: the decoder passes every mask
    and flag by keyword, and the encoder passes its masks in torch's canonical form (bool masks as
    float ones of the input's dtype)."""
    x = torch.randn(5, 2, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5).isinf()  # bool, True above the diagonal
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    seen = []
    for stack in (nn.TransformerEncoder, tf.TransformerEncoder) if kind == "encoder" else \
            (nn.TransformerDecoder, tf.TransformerDecoder):
        calls = []
        kwargs = dict(enable_nested_tensor=False) if kind == "encoder" else {}
        model = stack(_RecordingLayer(calls), 2, **kwargs)
        for layer in model.layers:
            layer.calls = calls
        if kind == "encoder":
            out = model(x, mask=causal, src_key_padding_mask=padding)
        else:
            out = model(x, x, tgt_mask=causal, tgt_key_padding_mask=padding, memory_key_padding_mask=padding)
        assert torch.equal(out, x + 1 + 1)
        seen.append(calls)
    expected, got = seen
    assert len(got) == len(expected) == 2
    for (n_got, kw_got), (n_expected, kw_expected) in zip(got, expected):
        assert n_got == n_expected
        assert sorted(kw_got) == sorted(kw_expected)
        for name, value in kw_expected.items():
            if isinstance(value, torch.Tensor):
                assert kw_got[name].dtype == value.dtype, name
                assert torch.equal(kw_got[name], value), name
            else:
                assert kw_got[name] == value, name


def test_multihead_attention_takes_numpy_ints():
    """As torch's does (any integral type for the sizes)."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(np.int64(16), np.int64(2), batch_first=True)
    ours = tf.MultiheadAttention(np.int64(16), np.int64(2), batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], theirs(x, x, x, need_weights=False)[0],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        tf.MultiheadAttention(16, 2.0)
    with pytest.raises(ValueError, match="embed_dim must be a positive multiple of num_heads"):
        tf.MultiheadAttention(np.float32(16), 2)
