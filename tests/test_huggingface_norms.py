"""convert() on Hugging Face transformers' norm modules (transformer_fast.integrations.huggingface_norms):
which modules are taken (by their forward's code, never by name), that the fused forward matches
the float64 formula within the comparison policy (tests/helpers.py: transformers' own forward in
the same dtype is the plain-torch reference), that every call it does not serve runs transformers'
forward unchanged, and that converted models compute what the originals did (fp32: helpers.MODEL_TOL)
and survive pickling."""
import copy
import io

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import transformer_fast as tf  # noqa: E402
from transformer_fast.integrations import huggingface_norms  # noqa: E402
from helpers import compare_logits_and_grads, compare_with_reference  # noqa: E402
from transformers.models.cohere.modeling_cohere import CohereLayerNorm  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.mt5.modeling_mt5 import MT5LayerNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402



class Gemma3nRMSNormBefore525(nn.Module):
    """Gemma 3n's norm as transformers wrote it before 5.25 (also Gemma 4's): the epsilon named `eps`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if self.with_scale:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=True)

    def _norm(self, hidden_states: torch.Tensor):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
        return hidden_states * torch.pow(mean_squared, -0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed_output = self._norm(hidden_states.float())
        if self.with_scale:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


FORMS = {"llama": LlamaRMSNorm, "t5": T5LayerNorm, "olmo2": Olmo2RMSNorm, "gemma": GemmaRMSNorm,
         "gemma3n": Gemma3nRMSNorm, "gemma3n before 5.25": Gemma3nRMSNormBefore525, "cohere": CohereLayerNorm}


class PowerThreeNorm(nn.Module):
    """LlamaRMSNorm's attributes and nearly its forward (a cube for the square): not taken."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(3).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DoubledLlamaNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


class InheritedLlamaNorm(LlamaRMSNorm):
    """A subclass that keeps LlamaRMSNorm's forward: the same function, so taken."""


class ShiftedGemmaNorm(GemmaRMSNorm):
    """Gemma's forward with another `_norm`: not taken."""

    def _norm(self, x):
        return super()._norm(x) + 1


def converted(module):
    _, report = tf.convert(module, return_report=True)
    return [item.name for item in report]


@pytest.mark.parametrize("make", [LlamaRMSNorm, Qwen3RMSNorm, T5LayerNorm, MT5LayerNorm, InheritedLlamaNorm,
                                  Olmo2RMSNorm, GptOssRMSNorm, GemmaRMSNorm, Gemma3RMSNorm, Gemma3nRMSNorm,
                                  lambda n: Gemma3nRMSNorm(n, with_scale=False), Gemma3nRMSNormBefore525,
                                  lambda n: Gemma3nRMSNormBefore525(n, with_scale=False), CohereLayerNorm])
def test_forms_taken(make):
    module = make(16)
    cls = type(module)
    assert huggingface_norms.is_convertible_norm(module)
    assert converted(module) == [""]
    assert isinstance(module, cls) and type(module).__name__ == cls.__name__
    assert type(module).forward in huggingface_norms.FUSED_FORWARDS
    assert converted(module) == []  # never twice


def test_other_norms_left_alone():
    patched = LlamaRMSNorm(16)
    patched.forward = lambda hidden_states: hidden_states  # as accelerate's hooks replace forward
    without_weight = LlamaRMSNorm(16)
    without_weight.weight = None
    matrix_weight = LlamaRMSNorm(16)
    matrix_weight.weight = nn.Parameter(torch.ones(2, 16))
    scale_without_weight = Gemma3nRMSNorm(16)
    del scale_without_weight.weight
    per_head = CohereLayerNorm((4, 16))  # Cohere's query/key norm: a weight per head
    # Mamba-2's gated norm: MambaRMSNormGated before transformers 5.25, Mamba2RMSNormGated since
    gated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    for module in (gated(16, 16), ShiftedGemmaNorm(16), per_head, PowerThreeNorm(16),
                   DoubledLlamaNorm(16), patched, without_weight, matrix_weight, scale_without_weight):
        before = type(module)
        assert not huggingface_norms.is_convertible_norm(module), before.__name__
        assert converted(module) == [] and type(module) is before


@pytest.mark.parametrize("form", sorted(FORMS) + ["gemma3n without scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0, 17), (1, 1), (3, 17), (2, 5, 129), (1, 1, 1024)])
def test_fused_forward_against_float64(form, dtype, shape):
    eps = 1e-6
    scaled = form != "gemma3n without scale"

    def make():
        return FORMS[form](shape[-1], eps) if scaled else Gemma3nRMSNorm(shape[-1], eps, with_scale=False)

    module = tf.convert(make())
    x = torch.randn(shape) * 3
    w = torch.rand(shape[-1]) + 0.5

    def run(module, x, w=None):
        return torch.func.functional_call(module, {"weight": w} if scaled else {}, (x,))

    def reference(x, w=None):
        if x.dtype != torch.float64:  # transformers' own forward
            return run(make().to(x.dtype), x, w)
        if form == "cohere":
            centred = x - x.mean(-1, keepdim=True)
            return w * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
        normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return normalized if not scaled else normalized * (1 + w) if form == "gemma" else w * normalized

    inputs = [x.to(dtype), w.to(dtype)] if scaled else [x.to(dtype)]
    out = compare_with_reference(lambda *args: run(module, *args), reference, inputs,
                                 grad_inputs=(0, 1) if scaled else (0,), what=f"{form} {dtype} {shape}")
    assert out.dtype == dtype and out.shape == shape


@pytest.fixture
def fused_calls(monkeypatch):
    """The input dtypes of the fused ops' calls (RMSNorm's, and LayerNorm's for Cohere's form)."""
    calls = []
    for name in ("rms_norm", "layer_norm"):
        def counting(*args, original=getattr(huggingface_norms, name), **kwargs):
            calls.append(args[0].dtype)
            return original(*args, **kwargs)

        monkeypatch.setattr(huggingface_norms, name, counting)
    return calls


@pytest.mark.parametrize("form", sorted(FORMS))
def test_calls_it_does_not_serve_run_transformers_forward(form, fused_calls):
    width = 12
    original = FORMS[form](width)
    nn.init.normal_(original.weight)
    ours = tf.convert(copy.deepcopy(original))
    x32 = torch.randn(2, 3, width)
    cases = {
        "weight of one element": (lambda m: m, x32),
    }
    if form in ("llama", "t5"):  # the other forms multiply in float32 whatever the dtypes: served
        cases["bfloat16 input, float32 weight"] = (lambda m: m, x32.bfloat16())
    for what, (prepare, x) in cases.items():
        a = copy.deepcopy(original)
        b = copy.deepcopy(ours)
        if what == "weight of one element":  # broadcast along the last dim by transformers' forward
            a.weight = nn.Parameter(torch.full((1,), 1.5))
            b.weight = nn.Parameter(torch.full((1,), 1.5))
        expected, actual = prepare(a)(x), prepare(b)(x)
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), what
    class Passthrough(torch.Tensor):  # a subclass (as DTensor is): transformers' forward handles it
        pass

    subclass = x32.as_subclass(Passthrough)
    assert torch.equal(ours(subclass), original(subclass))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = copy.deepcopy(original).bfloat16()
        expected = bf16(x32.bfloat16())
        actual = tf.convert(bf16)(x32.bfloat16())
    assert torch.equal(actual, expected)
    assert fused_calls == []
    ours(x32)
    ours.bfloat16()(x32.bfloat16())
    assert fused_calls == [torch.float32, torch.bfloat16]


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def tiny_t5():
    config = transformers.T5Config(vocab_size=97, d_model=24, d_kv=6, d_ff=40, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def tiny_gemma2():
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64, sliding_window=4)
    return transformers.Gemma2ForCausalLM(config)


def with_random_norm_weights(model):
    """transformers initialises norm weights to ones (zeros in Gemma's form): a fused forward that
    dropped the weight would pass with them. Noise of 0.2 around the initial values."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
                module.weight.add_(torch.randn_like(module.weight), alpha=0.2)
    return model


def tiny_olmo2():
    config = transformers.Olmo2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Olmo2ForCausalLM(config)


def tiny_cohere():
    config = transformers.CohereConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       use_qk_norm=True)
    return transformers.CohereForCausalLM(config)


@pytest.mark.parametrize("make", [tiny_llama, tiny_t5, tiny_gemma2, tiny_olmo2, tiny_cohere])
def test_converted_models_compute_the_same(make):
    torch.manual_seed(0)
    original = with_random_norm_weights(make()).train()
    ours = copy.deepcopy(original)
    names = converted(ours)
    norm_names = [name for name, m in original.named_modules()  # Cohere's per-head query/key norms stay
                  if type(m).__name__.endswith(("RMSNorm", "LayerNorm")) and m.weight.dim() == 1]
    assert names == norm_names and len(names) >= 3
    ids = torch.randint(3, 97, (2, 9))
    compare_logits_and_grads(original, ours, dict(input_ids=ids, labels=ids) if make is tiny_t5 else
                             dict(input_ids=ids))


def test_pickling_deep_copies_and_state_dicts():
    torch.manual_seed(0)
    original = tiny_llama().eval()
    ours = tf.convert(copy.deepcopy(original))
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
        buffer = io.BytesIO()
        torch.save(ours, buffer)
        buffer.seek(0)
        for restored in (torch.load(buffer, weights_only=False), copy.deepcopy(ours)):
            assert type(restored.model.norm) is type(ours.model.norm)
            assert type(restored.model.norm).forward is huggingface_norms._fused_llama
            assert torch.equal(restored(input_ids=ids).logits, expected)
    assert list(ours.state_dict()) == list(original.state_dict())
    tiny_llama().load_state_dict(ours.state_dict(), strict=True)


def test_torch_compile_fullgraph_traces_the_fused_op():
    module = tf.convert(LlamaRMSNorm(24)).bfloat16()
    nn.init.normal_(module.weight)
    x = torch.randn(3, 5, 24, dtype=torch.bfloat16)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module

    torch.testing.assert_close(torch.compile(module, fullgraph=True, backend=backend)(x), module(x), atol=0, rtol=0)
    assert len(graphs) == 1 and "torch.ops.transformer_fast.layer_norm" in graphs[0]


@pytest.mark.parametrize("cls", [GemmaRMSNorm, Olmo2RMSNorm, Gemma3nRMSNorm, CohereLayerNorm])
def test_float32_weight_with_a_bfloat16_input(cls, fused_calls):
    original = cls(40)
    nn.init.normal_(original.weight, std=0.1)
    ours = tf.convert(copy.deepcopy(original))
    x = torch.randn(3, 40).bfloat16()
    expected, actual = original(x), ours(x)
    assert fused_calls == [torch.bfloat16] and actual.dtype == expected.dtype == torch.bfloat16
    # both round float32 results of the same formula once: at most one bfloat16 step apart
    torch.testing.assert_close(actual, expected, atol=0, rtol=2 ** -7)


@pytest.mark.gpu
def test_gpu_converted_llama_under_cuda_autocast(fused_calls):
    """CUDA autocast: the float32 residual stream's norms run fused (our op keeps float32 there, as
    transformers' forward does); a bfloat16 input under autocast runs transformers' forward (our
    op would return float32)."""
    torch.manual_seed(0)
    original = with_random_norm_weights(tiny_llama()).cuda().eval()
    ours = tf.convert(copy.deepcopy(original))
    ids = torch.randint(3, 97, (2, 9), device="cuda")
    with torch.no_grad():
        exact = copy.deepcopy(original).double()(input_ids=ids).logits
        with torch.autocast("cuda", dtype=torch.bfloat16):
            theirs, actual = original(input_ids=ids).logits, ours(input_ids=ids).logits
            x = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16)
            norm = copy.deepcopy(ours.model.norm).bfloat16()
            assert torch.equal(norm(x), norm._transformers_forward(x))
    assert fused_calls and set(fused_calls) == {torch.float32}
    assert actual.dtype == theirs.dtype
    # the comparison policy: at most twice transformers' own error under autocast, against float64
    error, their_error = ((t.double() - exact).abs().max().item() for t in (actual, theirs))
    assert error <= 2 * their_error + 1e-3, (error, their_error)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_float64_is_normalised_in_float64(form, fused_calls):
    """transformers' forwards compute a float64 input in float32; converted, a float64 model is
    float64-accurate (the package's rule for float64)."""
    width, eps = 33, 1e-6
    original = FORMS[form](width, eps).double()
    with torch.no_grad():
        original.weight.add_(torch.randn(width, dtype=torch.float64), alpha=0.2)
    ours = tf.convert(copy.deepcopy(original))
    x = torch.randn(4, width, dtype=torch.float64) * 3
    centred = x - x.mean(-1, keepdim=True) if form == "cohere" else x
    normalized = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    w = original.weight.detach()
    exact = normalized * (1 + w) if form == "gemma" else normalized * w
    actual = ours(x)
    assert fused_calls == [torch.float64] and actual.dtype == torch.float64
    assert (actual - exact).abs().max().item() < 1e-13
    assert (original(x) - exact).abs().max().item() > 1e-9  # what transformers' forward gives: float32's error
