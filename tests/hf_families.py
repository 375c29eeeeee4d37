"""The model families Hugging Face transformers ships, each built from a small config (nothing
downloaded) and run with ``attn_implementation="transformer_fast"``.

For each family (a ``model_type`` with a base model class in transformers' ``MODEL_MAPPING``):
  * "refused": building the model with ``transformer_fast`` raises a ValueError that names a model
    class and points to "sdpa"/"eager";
  * "matches sdpa" / "matches eager": the same weights give the same outputs and parameter
    gradients on ``transformer_fast`` as on ``sdpa`` (``eager`` where transformers refuses sdpa),
    fp32, on a right-padded batch (outputs compared at the unpadded positions); compared with
    eager, also on the same tokens without padding (the masks transformers would leave out);
  * "not run" / "not built" (with the reason): served but not compared (no token-id inputs, or the
    shrunk model does not run), or no small model could be made: not a verdict on the integration;
  * "MISMATCH" / "ERROR": served but wrong, or served but failing: a defect.

    python tests/hf_families.py                      # every family, a summary on stdout
    python tests/hf_families.py bert bloom t5        # some families
    python tests/hf_families.py --write docs/huggingface_families.md
    python tests/hf_families.py --convert             # also through transformer_fast.convert
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import os
import re
import sys
import time
import warnings

import torch

TOL = dict(atol=1e-5, rtol=1e-4)
BATCH, LENGTH, DECODER_LENGTH = 3, 11, 7
VALID_IDS = (4, 128)  # random token ids; 0-3 are the special tokens (see _FIXED_TOKEN_IDS)

# Config attributes shrunk (never grown) to these values, where the config has them as ints.
_SIZES = {
    32: ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "word_embed_proj_dim",
         "embedding_size", "projection_dim", "hidden_dim", "n_embed"),
    4: ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
        "decoder_attention_heads", "num_experts", "num_local_experts", "n_routed_experts"),
    2: ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_hidden_layers",
        "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
        "num_experts_per_tok", "moe_topk", "num_shared_experts", "n_shared_experts"),
    1: ("n_group", "topk_group", "first_k_dense_replace"),
    8: ("head_dim", "kv_channels", "attention_head_dim", "d_kv", "qk_rope_head_dim", "qk_nope_head_dim",
        "v_head_dim", "rotary_dim"),
    16: ("q_lora_rank", "kv_lora_rank"),
    64: ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
         "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size"),
    128: ("vocab_size",),
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                 "num_decoder_layers")
SIZES = {name: value for value, names in _SIZES.items() for name in names}
PROFILES = (((), False), (_SIZES[8] + _SIZES[1], False), ((), True))  # (sizes kept, rotary sections set)
_DROPOUT = re.compile(r"dropout|_pdrop$|drop_rate|layerdrop|drop_path")
_FIXED_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}  # others 3


@dataclasses.dataclass
class Result:
    family: str
    model_class: str
    status: str  # "refused", "matches sdpa", "matches eager", "not built", "not run", "MISMATCH", "ERROR"
    detail: str = ""

    @property
    def served_correctly(self):
        return self.status in ("matches sdpa", "matches eager")


def _overrides(values: dict, keep=()) -> dict:
    """The small-model overrides for a config whose current attributes are ``values``, leaving the
    sizes named in ``keep`` as they are."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or key in keep:
            continue
        if key in SIZES and isinstance(value, int) and value > SIZES[key]:
            out[key] = SIZES[key]
        elif _DROPOUT.search(key) and isinstance(value, float):
            out[key] = 0.0
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
            out[key] = _FIXED_TOKEN_IDS.get(key, 3)
        elif key.endswith("_token_id") and isinstance(value, list) and value:
            out[key] = [_FIXED_TOKEN_IDS.get(key, 3)]
    return out


def _small(config, keep=(), mrope=False):
    """A copy of ``config`` shrunk (sub-configs too), rebuilt through its class so that attributes
    derived in ``__init__`` follow."""
    values = config.to_dict()
    overrides = _overrides(values, keep)
    for key in _LAYER_COUNTS:  # per-layer lists follow the layer count: keep the first and last layers
        old, new = values.get(key), overrides.get(key)
        if new is None:
            continue
        for name, value in values.items():
            if isinstance(value, list) and len(value) == old and name not in overrides:
                overrides[name] = value[:new - 1] + value[-1:]
    values.update(overrides)
    if "kv_lora_rank" in values:  # multi-head latent attention: as many key/value heads as query heads
        values["num_key_value_heads"] = values.get("num_attention_heads")
        if "qk_head_dim" in values:
            values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    if mrope and isinstance(values.get("rope_parameters"), dict):  # rotary sections over head size 8
        values["rope_parameters"] = dict(values["rope_parameters"], mrope_section=[2, 1, 1])
    for key in getattr(type(config), "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            values[key] = _small(sub, keep, mrope)
    for key in ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"):
        values.pop(key, None)
    return type(config)(**values)


def small_config(family: str, profile: int = 0):
    """``family``'s default config shrunk; ``profile`` 1 keeps the head sizes (which rotary
    sections or state-space heads may have to divide) and expert groups as they are, 2 sets
    multimodal rotary sections to fit head size 8."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    keep, mrope = PROFILES[profile]
    return _small(CONFIG_MAPPING[family](), keep, mrope)


def base_model_class(family: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    name = MODEL_MAPPING_NAMES.get(family)
    if isinstance(name, (tuple, list)):
        name = name[0]
    return getattr(transformers, name, None) if name else None


def families():
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return sorted(MODEL_MAPPING_NAMES)


def padded_batch(vocab, batch=BATCH, length=LENGTH, pad_id=0):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(VALID_IDS[0], min(vocab, VALID_IDS[1]), (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 4:] = 0  # right padding
    mask[2, length - 1:] = 0
    ids[mask == 0] = pad_id
    return ids, mask


def _inputs(model, config):
    """Keyword arguments for ``model.forward``, or a string saying why there are none."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return "forward takes no input_ids"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VALID_IDS[1]
    if not isinstance(vocab, int) or vocab <= VALID_IDS[0]:
        return f"no usable vocab_size ({vocab!r})"
    ids, mask = padded_batch(vocab)
    kwargs = dict(input_ids=ids)
    if "attention_mask" in params:
        kwargs["attention_mask"] = mask
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        generator = torch.Generator().manual_seed(2)
        kwargs["decoder_input_ids"] = torch.randint(VALID_IDS[0], min(vocab, VALID_IDS[1]),
                                                    (BATCH, DECODER_LENGTH), generator=generator)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "return_dict" in params:
        kwargs["return_dict"] = True
    missing = [name for name, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in kwargs]
    if missing:
        return f"forward needs {', '.join(missing)}"
    if "attention_mask" not in kwargs:
        return "forward takes no attention_mask"
    return kwargs


def _compared_outputs(output, mask):
    """The float tensors of ``output`` to compare: at the unpadded positions where a dimension 1
    runs over the padded input."""
    if not hasattr(output, "items"):
        output = dict(enumerate(output if isinstance(output, tuple) else (output,)))
    items = output.items()
    tensors = []
    for name, t in items:
        if not (torch.is_tensor(t) and t.is_floating_point() and t.dim() >= 1 and t.shape[0] == mask.shape[0]):
            continue
        if t.dim() >= 2 and t.shape[1] == mask.shape[1]:
            t = t[mask.bool()]
        tensors.append((str(name), t))
    return tensors


def _run(model, inputs):
    output = model(**inputs)
    mask = inputs.get("attention_mask")
    tensors = _compared_outputs(output, mask)
    generator = torch.Generator().manual_seed(3)
    loss = sum((t * torch.randn(t.shape, generator=generator).to(t.dtype)).sum() for _, t in tensors)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(loss, params, allow_unused=True) if torch.is_tensor(loss) and loss.requires_grad \
        else (None,) * len(params)
    return tensors, dict(zip(names, grads))


def _error(a, exact):
    return (a.double() - exact).abs().max().item() if a.numel() else 0.0


def _check_close(what, ours, ref, exact, other=None):
    """None if ``ours`` is within TOL of ``ref`` (the reference implementation in float32), or at
    most 2x as far as ``ref`` (or ``other``, eager in float32 where the reference is sdpa) from
    ``exact`` (the same in float64; where large sums round, as in embedding gradients), plus float32
    rounding of the largest value; else the difference."""
    if ours.shape != ref.shape:
        return f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    try:
        torch.testing.assert_close(ours, ref, **TOL)
        return None
    except AssertionError as exc:
        if exact is None:
            return f"{what}: {_first_line(exc, 2)}"
    scale = exact.abs().max().item() if exact.numel() else 0.0
    reference_error = max(_error(ref, exact), _error(other, exact) if other is not None else 0.0)
    allowed = 2 * reference_error + torch.finfo(torch.float32).eps * scale
    error = _error(ours, exact)
    if not error <= allowed:  # also catches NaN
        return (f"{what}: max error {error:.3g} vs the float64 run, allowed {allowed:.3g} (max |value| {scale:.3g}), "
                f"and {_error(ref, ours.double()):.3g} from the float32 reference")
    return None


def _mismatch(ours, ref, exact=None, other=None):
    """A description of the first output or gradient of run ``ours`` that is further from ``exact``
    (the reference implementation in float64) than run ``ref`` (the same in float32) or ``other``
    (eager in float32) allow, or None."""
    (out_o, grads_o), (out_r, grads_r) = ours, ref
    out_e, grads_e = exact if exact is not None else (None, None)
    out_x, grads_x = other if other is not None else (None, None)
    if [n for n, _ in out_o] != [n for n, _ in out_r]:
        return f"outputs {[n for n, _ in out_o]} vs {[n for n, _ in out_r]}"
    if not out_r:
        return "no output to compare"
    for i, ((name, a), (_, b)) in enumerate(zip(out_o, out_r)):
        difference = _check_close(f"output {name}", a, b, out_e[i][1] if out_e else None,
                                  out_x[i][1] if out_x else None)
        if difference:
            return difference
    for name, b in grads_r.items():
        a = grads_o.get(name)
        if (a is None) != (b is None):
            return f"grad of {name}: {'missing' if a is None else 'unexpected'}"
        if b is not None:
            difference = _check_close(f"grad of {name}", a, b, grads_e[name] if grads_e else None,
                                      grads_x.get(name) if grads_x else None)
            if difference:
                return difference
    return None


def _eager_run(model_cls, config, ref, inputs, train):
    """The run of the same weights on eager in float32, or None where it cannot be made."""
    try:
        eager = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager")
        eager.load_state_dict(ref.state_dict(), strict=True)
        eager.train(train)
        return _run(eager, inputs)
    except Exception:  # noqa: BLE001 - then the float32 reference alone sets the allowance
        return None


def _first_line(exc, lines=1):
    text = " ".join(str(exc).strip().splitlines()[:lines])
    return (text[:160] + "...") if len(text) > 160 else text


def _is_clear_refusal(exc):
    text = str(exc)
    return (isinstance(exc, ValueError) and "transformer_fast" in text and ("'sdpa'" in text or "'eager'" in text)
            and re.search(r"\b[A-Za-z]\w*(: | does not support )attn_implementation=", text) is not None)


def _reference(family, model_cls, train, profile):
    """The small config, the reference model (sdpa, else eager), its implementation's name, the
    inputs and the reference run, or (status, reason) where one of them could not be made."""
    try:
        config = small_config(family, profile)
    except Exception as exc:  # noqa: BLE001 - any failure is reported in the table
        return "not built", f"small config: {type(exc).__name__}: {_first_line(exc)}"
    for implementation in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            ref = model_cls._from_config(copy.deepcopy(config), attn_implementation=implementation)
            break
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001
            return "not built", f"{type(exc).__name__}: {_first_line(exc)}"
    else:
        return "not built", "neither sdpa nor eager accepted"
    ref.train(train)
    inputs = _inputs(ref, config)
    if isinstance(inputs, str):
        return config, ref, implementation, inputs, None
    try:
        return config, ref, implementation, inputs, _run(ref, inputs)
    except Exception as exc:  # noqa: BLE001
        return config, ref, implementation, f"{implementation} forward: {type(exc).__name__}: {_first_line(exc)}", None


def check_family(family: str, train: bool = False, convert: bool = False) -> Result:
    """Builds ``family`` small and compares transformer_fast with sdpa (or eager), in eval mode or
    (``train``) in training mode, with every dropout probability 0; with ``convert``, our model also
    goes through ``transformer_fast.convert`` (its torch.nn and transformers norm modules swapped;
    the classes converted are listed after the outputs compared)."""
    import transformer_fast.integrations.huggingface as tf_hf
    tf_hf.register()
    model_cls = base_model_class(family)
    if model_cls is None:
        return Result(family, "-", "not built", "no base model class in this transformers")
    name = model_cls.__name__
    attempts = []
    for profile in range(len(PROFILES)):  # a smaller model first, a less shrunk one where that fails
        attempts.append(_reference(family, model_cls, train, profile))
        built = [a for a in attempts if len(a) == 5]
        if built and (built[-1][4] is not None or built[-1][3].startswith(("forward takes", "forward needs"))):
            break
    if not built:
        return Result(family, name, *attempts[0])
    reference = next((a for a in built if a[4] is not None), built[0])
    config, ref, implementation, inputs, ref_run = reference
    try:
        ours = model_cls._from_config(copy.deepcopy(config), attn_implementation=tf_hf.NAME)
    except ValueError as exc:
        if _is_clear_refusal(exc):
            return Result(family, name, "refused", _refusal(exc))
        return Result(family, name, "ERROR", f"construction: ValueError: {_first_line(exc)}")
    except Exception as exc:  # noqa: BLE001
        return Result(family, name, "ERROR", f"construction: {type(exc).__name__}: {_first_line(exc)}")
    if ref_run is None:  # built and served, but no run to compare with
        return Result(family, name, "not run", inputs)
    try:
        ours.load_state_dict(ref.state_dict(), strict=True)
    except Exception as exc:  # noqa: BLE001
        return Result(family, name, "not run", f"weights do not transfer: {_first_line(exc)}")
    ours.train(train)
    converted = ""
    if convert:
        import transformer_fast
        _, report = transformer_fast.convert(ours, return_report=True)
        converted = "; converted: " + (", ".join(sorted({r.old.__name__ for r in report})) or "nothing")
    try:
        our_run = _run(ours, inputs)
    except ValueError as exc:
        if _is_clear_refusal(exc):
            return Result(family, name, "refused", f"at the first forward: {_first_line(exc)}")
        return Result(family, name, "ERROR", f"forward: ValueError: {_first_line(exc)}")
    except Exception as exc:  # noqa: BLE001
        return Result(family, name, "ERROR", f"forward: {type(exc).__name__}: {_first_line(exc)}")
    try:
        exact = copy.deepcopy(ref).double()
        if convert:  # transformers' RMSNorm forwards compute float64 in float32; converted, in float64
            import transformer_fast
            transformer_fast.convert(exact)
        if hasattr(exact, "set_experts_implementation"):  # grouped_mm has no float64
            exact.set_experts_implementation("eager")
        exact_run = _run(exact, inputs)
    except Exception:  # noqa: BLE001 - a model that cannot run in float64 is compared within TOL
        exact_run = None
    difference = _mismatch(our_run, ref_run, exact_run)
    if difference and implementation == "sdpa" and exact_run is not None:
        # sdpa's float32 rounding can be well below eager's: allow that of either
        eager_run = _eager_run(model_cls, config, ref, inputs, train)
        if eager_run is not None:
            difference = _mismatch(our_run, ref_run, exact_run, eager_run)
    if difference:
        return Result(family, name, "MISMATCH", f"vs {implementation}: {difference}")
    if implementation == "eager":  # served through flex-attention support: also the masks left out without padding
        unpadded = dict(inputs, attention_mask=torch.ones_like(inputs["attention_mask"]))
        try:
            our_run, ref_run = _run(ours, unpadded), _run(ref, unpadded)
            exact_run = _run(exact, unpadded) if exact_run is not None else None
        except Exception as exc:  # noqa: BLE001
            return Result(family, name, "ERROR", f"forward without padding: {type(exc).__name__}: {_first_line(exc)}")
        difference = _mismatch(our_run, ref_run, exact_run)
        if difference:
            return Result(family, name, "MISMATCH", f"vs {implementation} without padding: {difference}")
    return Result(family, name, f"matches {implementation}", ", ".join(n for n, _ in ref_run[0]) + converted)


# What a status in the table cannot say: measured explanations, printed under it.
NOTES = {
    "muse_spark_text": "On an Intel Xeon with AVX-512 and AMX (where MKL and at::vec take their AVX-512 code "
                       "paths, which round differently from their AVX2 ones), at one thread, one gradient element "
                       "was further from the "
                       "float64 run than the policy allows: unconverted, layer 1's k_proj weight, 2.6x sdpa's "
                       "error (0.00335 against 0.00129, max |value| 763); converted (its MuseSparkRMSNorm fused, "
                       "the float64 run's norms in float64), layer 1's experts.gate_up_proj, 6.58e-5 against an "
                       "allowance of 6.33e-5. Both matched there at two threads, and match on an AMD EPYC (AVX2) "
                       "at one. Its attention calls alone are within the policy: over 20 upstream gradients, dK's "
                       "max error is 1.07e-6 (median; torch's 7.0e-7) and 8.6e-7 (6.1e-7).",
}


def _cpu() -> str:
    from benchmarks.measure import device_info  # run from the repository root (see __main__)
    return f"{device_info(torch.device('cpu'))['cpu']} ({torch.backends.cpu.get_cpu_capability()})"


def table(results, convert=False) -> str:
    import transformers
    counts = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        '# Hugging Face model families and `attn_implementation="transformer_fast"`',
        "",
        "Every model family transformers ships with a base model class (`MODEL_MAPPING`), built from its "
        "default config shrunk (hidden size 32, 2 layers, 4 heads, 2 key/value heads where it counts them "
        "separately, head size 8, vocabulary 128, dropout 0; head sizes kept where the shrunk config fails; "
        "nothing downloaded), in "
        "fp32, on a batch of 3 token sequences of length 11, two of them right-padded (encoder-decoders also "
        "get 7 decoder tokens).",
        "",
        "* **matches sdpa** / **matches eager**: served; `transformer_fast` gives the outputs (at the unpadded "
        "positions) and the parameter gradients of the same weights on transformers' `sdpa` (`eager` where "
        f"the model refuses sdpa) within atol={TOL['atol']}, rtol={TOL['rtol']}, or at most 2x as far as "
        "`sdpa` (or `eager`) in fp32 from the same model in float64 (sums of many terms, as in embedding "
        "gradients; peaked attention); "
        "compared with `eager`, also on the same tokens without padding.",
        "* **refused**: building the model with `transformer_fast` raises a ValueError naming the model class "
        "(or the sub-model that cannot be served) and the implementation to use instead. Served are exactly "
        "the models that support `sdpa` or `flex_attention` through transformers' `AttentionInterface` "
        "(`transformer_fast.integrations.huggingface.supports_model`): the others would run their own "
        "attention code on masks built for `transformer_fast` and misread them (BLOOM, XGLM lost the causal "
        "mask; ConvBERT, MPNet ignored padding), or rely on masks or options neither has; models that fold "
        "their indexer's selection into the mask only for `eager` and `sdpa` (DeepSeek V3.2) are refused too. "
        "A served model that passes the attention function an option it does not implement (sparse "
        "`indices`, per-token `sinks`) gets a ValueError at its first forward (**refused** with \"at the "
        "first forward\").",
        "* **not run**: served, but no comparison could be made here (the model takes no token ids, needs "
        "other inputs, or its shrunk config does not run); **not built**: no small model could be made.",
        "",
        *(["Our model also went through `transformer_fast.convert` (`--convert`): the detail ends with the "
           "classes it converted (transformers' norm modules of the forms `convert` recognises; `torch.nn` "
           "LayerNorm, RMSNorm and MultiheadAttention where a model uses them).", ""] if convert else []),
        f"transformers {transformers.__version__}, torch {torch.__version__}"
        + (f", TRANSFORMER_FAST_BACKEND={os.environ['TRANSFORMER_FAST_BACKEND']}"
           if os.environ.get("TRANSFORMER_FAST_BACKEND") else "")
        + f", one thread of {_cpu()}. The float32 products, and so the last bits of a model's gradients, "
        "depend on the CPU's instructions. Regenerate with "
        f"`python tests/hf_families.py{' --convert' if convert else ''} --write docs/huggingface_families.md` "
        "from the repository root (about 10 minutes on 2 CPU cores); `pytest -m slow "
        "tests/test_huggingface_families.py` checks that no family is served wrong (at two threads).",
        "",
        "Totals: " + ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())) + ".",
        "",
        "| family | model class | status | detail |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.family} | {r.model_class} | {r.status} | {detail} |")
    notes = [f"- {r.family}: {NOTES[r.family]}" for r in results if r.family in NOTES]
    return "\n".join(lines + (["", "Notes:", ""] + notes if notes else [])) + "\n"


def _refusal(exc):
    """The refused class and why, from the integration's message."""
    text = str(exc)
    match = re.match(r"(\w+) does not support attn_implementation='[^']*': (.*)\. "
                     r"Use attn_implementation='(\w+)'", text)
    if match is None:
        return _first_line(exc)
    cls, why, instead = match.groups()
    if "neither 'sdpa' nor 'flex_attention'" in why:
        why = "no sdpa or flex_attention support"
    elif "only for 'eager' and 'sdpa'" in why:
        why = "indexer masks only for eager and sdpa"
    else:
        why = why.split(" (")[0]
    return f"{cls}: {why}; use {instead}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: all)")
    parser.add_argument("--write", metavar="PATH", help="write the Markdown table to PATH")
    parser.add_argument("--convert", action="store_true",
                        help="also pass our model through transformer_fast.convert (its norm modules swapped)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    results = []
    for family in args.families or families():
        start = time.time()
        result = check_family(family, convert=args.convert)
        results.append(result)
        print(f"{family:32s} {result.status:14s} {time.time() - start:5.1f}s  {result.model_class}  {result.detail}",
              flush=True)
    if args.write:
        with open(args.write, "w") as f:
            f.write(table(results, args.convert))
    bad = [r for r in results if r.status in ("MISMATCH", "ERROR")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
