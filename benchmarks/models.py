"""The `models` suite: whole models, ours against the same model on PyTorch's attention.

  bert     a BERT encoder (Hugging Face `BertModel` / `BertForSequenceClassification`, random
           weights from a config): forward without grad, and one AdamW training step with
           cross-entropy on random labels; right padding (the rows have different lengths)
  llama    a Llama-like decoder (`LlamaForCausalLM`: grouped-query attention, RoPE, causal): one
           training step (next-token loss, right padding, padded labels ignored), and greedy
           `generate` with the KV cache, in generated tokens per second
  encdec   the encoder-decoder training step of the sweep (`train_step`): our
           `models.Seq2SeqTransformer` against `nn.Transformer` of the same size

Ours is the same model (same weights) built with `attn_implementation="transformer_fast"` and
passed through `transformer_fast.convert` (which swaps `nn.LayerNorm`/`nn.RMSNorm` and
transformers' Llama-form RMSNorm modules: BERT's norms are `nn.LayerNorm`, Llama's `LlamaRMSNorm`); the
baseline uses `attn_implementation="sdpa"`. CPU: float32 and bfloat16 weights; CUDA: float32
weights under bfloat16 autocast. Dropout is 0 in both, so that both do the same work.

Checked first: the output (BERT's last hidden state, the models' logits) of ours and of the sdpa
model on the first rows against the same model in float64; ours may be off by at most 2x the sdpa
model's error plus a floor of `cases.CHECK_RTOL` x max(1, |float64|), on the unpadded positions.
Generation also records how many greedy tokens ours shares with the sdpa model's.

Where the time goes: one step of the baseline under `torch.profiler`; the share of the step in
attention (`aten::scaled_dot_product_attention` and its backward) and in normalisation modules
(every module whose class is named ...LayerNorm or ...RMSNorm, forward and the backward of the
operations it ran, matched by autograd sequence number).
"""
from __future__ import annotations

import copy
import importlib.util
import math
import statistics
import time

import torch

from . import cases, measure

# Sizes: "full" is the size the performance targets name; "quick" (the CPU default) keeps the
# widths and sequence lengths but fewer layers and rows, so that the suite takes minutes on 2 cores.
PRESETS = {
    "full": {"bert": {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "vocab": 30522,
                      "shapes": [(32, 128), (8, 512)]},
             "llama": {"hidden": 1024, "layers": 4, "heads": 8, "kv_heads": 2, "ffn": 2816, "vocab": 32000,
                       "train_shapes": [(8, 512), (2, 2048)], "gen_batches": [1, 8], "prompt": 32,
                       "new_tokens": 256},
             "encdec": {"d_model": 256, "heads": 4, "layers": 2, "vocab": 1000, "shape": (8, 512)}},
    "quick": {"bert": {"hidden": 768, "layers": 2, "heads": 12, "ffn": 3072, "vocab": 30522,
                       "shapes": [(4, 128), (1, 512)]},
              "llama": {"hidden": 512, "layers": 2, "heads": 8, "kv_heads": 2, "ffn": 1408, "vocab": 8192,
                        "train_shapes": [(2, 512), (1, 2048)], "gen_batches": [1, 8], "prompt": 32,
                        "new_tokens": 256},
              "encdec": {"d_model": 256, "heads": 4, "layers": 2, "vocab": 1000, "shape": (1, 256)}},
    "smoke": {"bert": {"hidden": 32, "layers": 1, "heads": 2, "ffn": 64, "vocab": 100, "shapes": [(2, 16)]},
              "llama": {"hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 100,
                        "train_shapes": [(2, 16)], "gen_batches": [1, 2], "prompt": 4, "new_tokens": 4},
              "encdec": {"d_model": 16, "heads": 2, "layers": 1, "vocab": 11, "shape": (1, 8)}},
}
CHECK_ROWS = 2
# the attention call of each model as the profiler names it: torch's, and our kernel op (the public
# functions reach it through the C++ binding, which the profiler does not record)
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "transformer_fast::attention_forward")
NORM_SCOPE = "models::norm"


class Skip(Exception):
    """A case that cannot run here, with the reason."""


# --------------------------------------------------------------------------------------------
# Hugging Face models
# --------------------------------------------------------------------------------------------
def _transformers():
    try:
        import transformers
    except ImportError as exc:
        if importlib.util.find_spec("transformers") is not None:
            raise  # installed, but its import fails: an error to report, not a model to skip
        raise Skip(f"transformers is not installed ({exc}); pip install transformers") from exc
    from transformer_fast.integrations import huggingface

    huggingface.register()
    return transformers


def _pair(cls, config, dtype, device):
    """(sdpa model, ours, float64 oracle): the same weights; ours converted."""
    from transformer_fast import convert

    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="transformer_fast")
    ours.load_state_dict(ref.state_dict())
    _, replaced = convert(ours, return_report=True)
    ours.converted = sorted({r.old.__name__ for r in replaced})
    exact = copy.deepcopy(ref).double()
    weights = dtype if device.type == "cpu" else torch.float32  # CUDA: autocast
    return ref.to(device=device, dtype=weights), ours.to(device=device, dtype=weights), exact


def _padded_batch(batch, length, vocab, g, device):
    """Random tokens 1 .. vocab-1 and a right-padding mask: row 0 is full, the others have random
    lengths from length/2 up."""
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def _compare(ours, ref, exact, valid, dtype):
    """(ok, our error, bound): on the valid positions, ours against float64 within 2x the sdpa
    model's error + the floor."""
    exact = exact.double()[valid]
    err = (ours.double()[valid] - exact).abs().max().item()
    ref_err = (ref.double()[valid] - exact).abs().max().item()
    bound = 2 * ref_err + cases.CHECK_RTOL[dtype] * max(1.0, exact.abs().max().item())
    return bool(torch.isfinite(ours).all()) and err <= bound, err, bound


def _autocast(device, dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return torch.autocast("cpu", enabled=False)


def _check_outputs(run_model, models, inputs, mask, dtype, device):
    """Runs `run_model(model, inputs, mask)` (eval, no grad) on the first rows of each model."""
    ref, ours, exact = models
    rows = slice(0, CHECK_ROWS)
    small = [t[rows] for t in inputs]
    outs = []
    for model in (ours, ref):
        was_training = model.training
        model.eval()
        with torch.no_grad(), _autocast(device, dtype):
            outs.append(run_model(model, small, mask[rows]).float().cpu())
        model.train(was_training)
    exact.eval()
    with torch.no_grad():
        oracle = run_model(exact, [t.cpu() for t in small], mask[rows].cpu())
    return _compare(outs[0], outs[1], oracle, mask[rows].cpu().bool(), dtype)


def _train_step(model, inputs, device, dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def bert_cases(p, dtype, device, g):
    tr = _transformers()
    config = tr.BertConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
                           num_attention_heads=p["heads"], intermediate_size=p["ffn"],
                           max_position_embeddings=max(512, max(n for _, n in p["shapes"])),
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
    size = f"hidden {p['hidden']}, {p['layers']} layers, {p['heads']} heads, ffn {p['ffn']}"
    for batch, length in p["shapes"]:
        ids, mask = _padded_batch(batch, length, p["vocab"], g, device)
        models = _pair(tr.BertModel, config, dtype, device)
        hidden = lambda m, inp, msk: m(input_ids=inp[0], attention_mask=msk).last_hidden_state  # noqa: E731
        check = (lambda models=models, ids=ids, mask=mask:
                 _check_outputs(hidden, models, [ids], mask, dtype, device))

        def forward(model, ids=ids, mask=mask):
            model.eval()

            def call():
                with torch.no_grad(), _autocast(device, dtype):
                    model(input_ids=ids, attention_mask=mask)
            return call
        yield {"model": "bert", "case": "forward", "size": size, "batch": batch, "length": length,
               "tokens": batch * length, "models": models[:2], "make": forward, "check": check}
        del models
        labels = torch.randint(0, 2, (batch,), generator=g).to(device)
        models = _pair(tr.BertForSequenceClassification, config, dtype, device)
        logits = lambda m, inp, msk: m(input_ids=inp[0], attention_mask=msk).logits[:, None, :]  # noqa: E731
        check = (lambda models=models, ids=ids, mask=mask:
                 _check_outputs(logits, models, [ids], mask[:, :1], dtype, device))
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        yield {"model": "bert", "case": "train step", "size": size, "batch": batch, "length": length,
               "tokens": batch * length, "models": models[:2], "check": check,
               "make": lambda model, inputs=inputs: _train_step(model, inputs, device, dtype)}


def _llama_config(tr, p):
    return tr.LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                          num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                          num_key_value_heads=p["kv_heads"], max_position_embeddings=4096, pad_token_id=0,
                          bos_token_id=1, eos_token_id=None, tie_word_embeddings=False, attention_dropout=0.0)


def llama_cases(p, dtype, device, g):
    tr = _transformers()
    config = _llama_config(tr, p)
    size = (f"hidden {p['hidden']}, {p['layers']} layers, {p['heads']} heads / {p['kv_heads']} kv heads, "
            f"ffn {p['ffn']}, vocab {p['vocab']}")
    logits = lambda m, inp, msk: m(input_ids=inp[0], attention_mask=msk).logits  # noqa: E731
    for batch, length in p["train_shapes"]:
        ids, mask = _padded_batch(batch, length, p["vocab"], g, device)
        models = _pair(tr.LlamaForCausalLM, config, dtype, device)
        check = (lambda models=models, ids=ids, mask=mask:
                 _check_outputs(logits, models, [ids], mask, dtype, device))
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        yield {"model": "llama", "case": "train step", "size": size, "batch": batch, "length": length,
               "tokens": batch * length, "models": models[:2], "check": check,
               "make": lambda model, inputs=inputs: _train_step(model, inputs, device, dtype)}
        del models
    models = _pair(tr.LlamaForCausalLM, config, dtype, device)
    new = p["new_tokens"]
    for batch in p["gen_batches"]:
        ids = torch.randint(1, p["vocab"], (batch, p["prompt"]), generator=g).to(device)
        mask = torch.ones_like(ids)
        check = (lambda ids=ids, mask=mask: _check_outputs(logits, models, [ids], mask, dtype, device))

        def generate(model, ids=ids, mask=mask):
            model.eval()

            def call():
                with torch.no_grad(), _autocast(device, dtype):
                    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                                          eos_token_id=None)
            return call
        def same_tokens(generate=generate):
            new_ref, new_ours = (generate(m)()[:, p["prompt"]:] for m in models[:2])
            return (new_ref == new_ours).float().mean().item()
        yield {"model": "llama", "case": f"generate {new} tokens", "size": size, "batch": batch,
               "length": p["prompt"], "tokens": batch * new, "models": models[:2], "check": check,
               "make": generate, "same_greedy_tokens": same_tokens}


def encdec_cases(p, dtype, device, g):
    batch, length = p["shape"]
    group = cases.TrainStepGroup(length, {"pass": "train"}, ["torch", "ours_softmax"], dtype, device, batch=batch,
                                 d_model=p["d_model"], nhead=p["heads"], num_layers=p["layers"],
                                 dim_feedforward=4 * p["d_model"], vocab=p["vocab"])
    group.setup()
    models = (group.model("torch")[0], group.model("ours_softmax")[0])
    steps = {id(models[0]): group.function("torch"), id(models[1]): group.function("ours_softmax")}
    yield {"model": "encdec", "case": "train step", "size": group.describe() + " (nn.Transformer vs ours)",
           "batch": batch, "length": length, "tokens": 2 * batch * length, "models": models,
           "check": lambda: group.check("ours_softmax")[:3], "make": lambda model: steps[id(model)], "twin": False,
           "check_note": "logits vs the same model on the reference backend (the sweep's check)"}


# --------------------------------------------------------------------------------------------
# Where the time goes
# --------------------------------------------------------------------------------------------
def profiled_pieces(model, fn):
    """{attention, norms, total}: milliseconds of one profiled call of `fn`. Attention by operator,
    a norm module by its forward scope, and for both the backward of what they ran (autograd nodes
    matched by sequence number)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def enter(module, args):
        module._models_scope = record_function(NORM_SCOPE)
        module._models_scope.__enter__()

    def leave(module, args, output):
        module._models_scope.__exit__(None, None, None)
        del module._models_scope  # the model stays copyable (the suite deep-copies it for its control)

    handles = []
    for m in model.modules():
        if type(m).__name__.endswith(("LayerNorm", "RMSNorm")):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with measure._quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("models::call"):
                fn()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    total = sum(e.cpu_time_total for e in events if e.name == "models::call")
    kinds = {"attention": set(), "norms": set()}
    forward = {"attention": 0.0, "norms": 0.0}

    def scope_of(e):
        while e is not None:
            if e.name == NORM_SCOPE:
                return "norms"
            if e.name in ATTENTION_OPS:
                return "attention"
            e = e.cpu_parent
        return None

    for e in events:
        kind = scope_of(e)
        if kind is None:
            continue
        if e.sequence_nr >= 0:
            kinds[kind].add(e.sequence_nr)
        if e.name in (NORM_SCOPE, *ATTENTION_OPS) and scope_of(e.cpu_parent) is None:
            forward[kind] += e.cpu_time_total
    backward = {k: sum(e.cpu_time_total for e in events if e.name.startswith("autograd::engine::evaluate_function")
                       and e.sequence_nr in seqs) for k, seqs in kinds.items()}
    return {k: (forward[k] + backward[k]) / 1e3 for k in forward} | {"total": total / 1e3}


def interleaved_pieces(models_fns, rounds):
    """{name: {attention_norms, share_attention, share_norms}}: medians over `rounds` rounds, each
    profiling one call of every (model, fn) in turn, so that a busy spell of the shared machine
    falls on all of them alike: the milliseconds in attention + norms, and each one's fraction of
    the call."""
    samples = {k: [] for k in models_fns}
    for _ in range(rounds):
        for k, (model, fn) in models_fns.items():
            samples[k].append(profiled_pieces(model, fn))
    return {k: {"attention_norms": statistics.median(r["attention"] + r["norms"] for r in runs),
                "share_attention": statistics.median(r["attention"] / r["total"] for r in runs),
                "share_norms": statistics.median(r["norms"] / r["total"] for r in runs)}
            for k, runs in samples.items()}


# --------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------
def _linear_rates(device, rows=512, width=768):
    """GFLOP/s per dtype of an nn.Linear-shaped product (rows x width by width x width), forward alone
    and forward + backward. A CPU without bfloat16 instructions runs bfloat16 products much more
    slowly than float32, and unevenly by layout: on the 2-core AVX2 VM the forward's layout about
    6x, the backward's grad-input product (grad_out @ weight) about 60x, so a training step about
    25x. The skip predictor scales a case's float32 time by the slowdown of its kind."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(width, width, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(rows, width, device=device, dtype=dtype)

        def forward():
            with torch.no_grad():
                torch.nn.functional.linear(x, w)

        def train():
            torch.nn.functional.linear(x, w).backward(grad)

        times = measure.time_interleaved({"forward": forward, "train": train}, device, max_repeats=5, min_repeats=3,
                                         budget_s=0.5, min_sample_s=0.02)
        flops = {"forward": 2 * rows * width * width, "train": 3 * 2 * rows * width * width}
        rates[str(dtype).replace("torch.", "")] = {k: flops[k] / (times[k]["median_ms"] / 1e3) / 1e9 for k in flops}
    return rates


def _kind(case):
    return "train" if "train" in case["case"] else "forward"


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = "smoke" if args.smoke else ("full" if args.full or device.type == "cuda" else "quick")
    sizes = PRESETS[preset]
    if args.dtype:
        dtypes = [args.dtype]
    else:
        dtypes = ["bfloat16"] if device.type == "cuda" else ["float32", "bfloat16"]
    rates = _linear_rates(device, *((64, 128) if args.smoke else ()))
    slowdown = {d: {k: rates["float32"][k] / r[k] for k in r} for d, r in rates.items()}
    print(f"  sizes: {preset}; linear-layer GFLOP/s (forward, forward + backward): "
          + ", ".join(f"{d} {r['forward']:.1f}, {r['train']:.1f}" for d, r in rates.items()), flush=True)
    rows, fp32_seconds = [], {}
    families = [(name, make) for name, make in (("bert", bert_cases), ("llama", llama_cases),
                                                ("encdec", encdec_cases)) if name in args.model_families]
    for name in dtypes:
        dtype = getattr(torch, name)
        precision = name + (" autocast" if device.type == "cuda" and dtype != torch.float32 else "")
        for family, make_cases in families:
            g = torch.Generator().manual_seed(args.seed)
            try:
                for case in make_cases(sizes[family], dtype, device, g):
                    factor = slowdown[name][_kind(case)] if name in slowdown else 1.0
                    rows.append(_run_case(case, precision, args, device, fp32_seconds, factor))
            except Skip as exc:
                rows.append({"model": family, "precision": precision, "status": "skipped", "note": str(exc)})
                print(f"  {family}: skipped: {exc}", flush=True)
    return {"preset": preset, "sizes": sizes, "dtypes": dtypes, "linear_gflops": rates, "rows": rows,
            "targets": {"never_slower": 1.0, "attention_norm_share": 0.4, "ratio_where_share": 1.15}}


def _run_case(case, precision, args, device, fp32_seconds, slowdown):
    key = (case["model"], case["case"], case["batch"], case["length"])
    row = {k: case[k] for k in ("model", "case", "size", "batch", "length", "tokens")}
    row.update(precision=precision, check=case.get("check_note", "output vs float64 (first rows, unpadded)"))
    label = f"  {case['model']:<6} {case['case']:<19} B={case['batch']:<2} N={case['length']:<5} {precision:<16}"
    predicted = fp32_seconds.get(key, 0.0) * slowdown
    if predicted > (args.max_call_seconds or 30.0):
        print(f"{label} skipped: ~{predicted:.0f} s per call predicted", flush=True)
        return {**row, "status": "skipped", "max_error": None, "error_bound": None,
                "note": f"~{predicted:.0f} s per call predicted (float32 time x the measured linear-layer "
                        f"slowdown {slowdown:.0f}x) > --max-call-seconds"}
    started = time.perf_counter()
    ok, err, bound = case["check"]()
    row.update(max_error=err, error_bound=bound)
    if "same_greedy_tokens" in case:
        row["same_greedy_tokens"] = case["same_greedy_tokens"]()
    row["check_s"] = time.perf_counter() - started  # on a GPU, mostly the kernels' compilation and tuning
    if not ok:
        print(f"{label} WRONG: error {err:.3g} > bound {bound:.3g}", flush=True)
        return {**row, "status": "wrong"}
    ref, ours = case["models"]
    row["converted"] = getattr(ours, "converted", None)
    fns = {"sdpa": case["make"](ref), "ours": case["make"](ours)}
    if case.get("twin", True):
        # The control: a deep copy of the sdpa model, timed in the same rounds. Its ratio to the
        # sdpa model is what the same code gets from where a model's tensors happen to lie in memory.
        fns["sdpa twin"] = case["make"](copy.deepcopy(ref))
    started = time.perf_counter()
    first = {k: measure.time_once(fn, device) for k, fn in fns.items()}  # warm-up, and the sample size
    row["first_calls_s"] = time.perf_counter() - started
    if precision == "float32":
        fp32_seconds[key] = first["sdpa"]
    times = measure.time_interleaved(fns, device, first_call_s=first, max_repeats=args.repeats,
                                     min_repeats=args.min_repeats, budget_s=args.budget,
                                     min_sample_s=args.min_sample_ms / 1e3, keep_samples=True)
    ratio = measure.paired_ratio(times, "sdpa", "ours")
    ratio_low, ratio_high = measure.paired_ratio_interval(times, "sdpa", "ours")
    if "sdpa twin" in times:
        row.update(twin_ratio=measure.paired_ratio(times, "sdpa", "sdpa twin"),
                   twin_interval=measure.paired_ratio_interval(times, "sdpa", "sdpa twin"))
    shares = {"attention": None, "norms": None}
    pieces_ms = {"sdpa": None, "ours": None}
    if device.type == "cpu":  # the profiler's CPU view would not see the CUDA kernels' time
        # The attention + norms time of each model: what the swap changes, free of the rest of the
        # model's time, which moves with the machine's load as much as the ratio.
        pieces = interleaved_pieces({"sdpa": (ref, fns["sdpa"]), "ours": (ours, fns["ours"])},
                                    rounds=1 if args.smoke else (5 if first["sdpa"] < 1.0 else 3))
        shares = {k: pieces["sdpa"]["share_" + k] for k in shares}
        pieces_ms = {k: pieces[k]["attention_norms"] for k in pieces_ms}
    share = (shares["attention"] + shares["norms"]) if shares["attention"] is not None else None
    target = 1.15 if share is not None and share >= 0.4 else 1.0
    row.update(status="ok", sdpa_ms=times["sdpa"]["median_ms"], ours_ms=times["ours"]["median_ms"], ratio=ratio,
               ratio_low=ratio_low, ratio_high=ratio_high, rounds=times["ours"]["samples"], tokens_per_s_sdpa=case["tokens"] / times["sdpa"]["median_ms"] * 1e3,
               tokens_per_s_ours=case["tokens"] / times["ours"]["median_ms"] * 1e3, share_attention=shares["attention"],
               share_norms=shares["norms"], attention_norms_ms_sdpa=pieces_ms["sdpa"],
               attention_norms_ms_ours=pieces_ms["ours"], target_ratio=target, met=ratio >= target,
               below_target_at_95=ratio_high < target)
    pieces = (f", {pieces_ms['sdpa']:.1f} ms sdpa / {pieces_ms['ours']:.1f} ms ours"
              if pieces_ms["sdpa"] is not None else "")
    twin = f"  twin {row['twin_ratio']:.2f}" if "twin_ratio" in row else ""
    print(f"{label} sdpa {row['sdpa_ms']:9.1f} ms  ours {row['ours_ms']:9.1f} ms  ratio {ratio:5.2f} [{ratio_low:.2f}, "
          f"{ratio_high:.2f}]{twin}  "
          f"attention+norms {_pct(share)} of the sdpa model{pieces}  (check {row['check_s']:.1f} s, first calls "
          f"{row['first_calls_s']:.1f} s)", flush=True)
    return row


def _pieces(row):
    sdpa, ours = row.get("attention_norms_ms_sdpa"), row.get("attention_norms_ms_ours")
    return "-" if sdpa is None or ours is None else f"{sdpa:.1f} / {ours:.1f}"


def _ratio(row):
    if row.get("ratio_low") is None:
        return f"{row['ratio']:.2f}"
    return f"{row['ratio']:.2f} [{row['ratio_low']:.2f}, {row['ratio_high']:.2f}]"


def _twin(row):
    if row.get("twin_ratio") is None:
        return "-"
    low, high = row["twin_interval"]
    return f"{row['twin_ratio']:.2f} [{low:.2f}, {high:.2f}]"


def _verdict(row):
    if row["met"]:
        return "met"
    return "**missed**: slower" if row.get("below_target_at_95") else "**missed** (within noise)"


def _pct(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    lines += [f"Threads: {result.get('threads')}. Sizes: `{body['preset']}` preset; measured linear-layer rate "
              "(forward, forward + backward): " + ", ".join(f"{d} {r['forward']:.1f}, {r['train']:.1f} GFLOP/s"
                                                          for d, r in body["linear_gflops"].items()) + ".", ""]
    for family, p in body["sizes"].items():
        lines.append(f"- {family}: " + ", ".join(f"{k} {v}" for k, v in p.items()))
    lines += ["", "Ratio: the sdpa model's time over ours (> 1: ours is faster), median over interleaved rounds, with "
              "its 95% confidence interval (order statistics of the per-round ratios). A missed target is "
              "'slower' where the whole interval lies below it, else 'within noise'. Twin: the control, a deep "
              "copy of the sdpa model timed in the same rounds (sdpa over twin): how far the same code moves "
              "with where its tensors lie in memory. "
              "Share: the fraction of the sdpa model's call spent in attention / in normalisation. Pieces: the "
              "time attention + norms took in each model's call (forward and backward; the part the swap "
              "changes). Both are medians over 5 profiled calls of each model in turn (3 for calls over a second). Target: >= 1.0, and >= 1.15 where attention + norms take >= 40%.", "",
              "| model | case | B | N | precision | sdpa ms | ours ms | ours tokens/s | ratio [95% interval] | twin [95% interval] | rounds | attention / norms "
              "share | pieces ms, sdpa / ours | target | check error / bound |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    notes = []
    for r in body["rows"]:
        if r["status"] == "skipped" and "case" not in r:
            notes.append(f"- {r['model']} ({r['precision']}): skipped: {r['note']}")
            continue
        head = f"| {r['model']} | {r['case']} | {r['batch']} | {r['length']} | {r['precision']} |"
        check = f"{r['max_error']:.1e} / {r['error_bound']:.1e}" if r.get("max_error") is not None else "-"
        if r["status"] == "ok":
            lines.append(f"{head} {r['sdpa_ms']:.1f} | {r['ours_ms']:.1f} | {r['tokens_per_s_ours']:.0f} | "
                         f"{_ratio(r)} | {_twin(r)} | {r['rounds']} | {_pct(r['share_attention'])} / {_pct(r['share_norms'])} | "
                         f"{_pieces(r)} | >= {r['target_ratio']:.2f}: {_verdict(r)} | {check} |")
        else:
            lines.append(f"{head} | | | {r['status'].upper()} | | | | | {r.get('note', '')} | {check} |")
        if "same_greedy_tokens" in r:
            notes.append(f"- llama {r['case']}, B={r['batch']}, {r['precision']}: "
                         f"{100 * r['same_greedy_tokens']:.0f}% of the greedy tokens equal the sdpa model's")
    sizes = sorted({(r["model"], r["size"]) for r in body["rows"] if "size" in r})
    converted = sorted({(r["model"], ", ".join(r["converted"]) or "nothing") for r in body["rows"]
                        if r.get("converted") is not None})
    lines += ["", "Models:", ""] + [f"- {m}: {s}" for m, s in sizes]
    lines += [""] + [f"- {m}: `convert` replaced {what}" for m, what in converted] + ([""] + notes if notes else [])
    return "\n".join(lines) + "\n"
