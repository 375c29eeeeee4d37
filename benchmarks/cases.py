"""What the benchmark measures: groups of implementations of one computation on one input.

A *group* holds the inputs of one case (family, configuration, sequence length) and the
implementations compared on it; the harness checks every implementation against a float64
oracle once, then times them interleaved. Everything of ours is called through the public API
(``transformer_fast.scaled_dot_product_attention``, ``linear_attention``, ``layer_norm``,
``transformer_fast.Seq2SeqTransformer``), so the same code times whichever backend the
dispatcher picks (C++ on CPU, Triton on CUDA).

Families and implementations:
  * ``attention``  - naive (``transformer_fast.reference``, materialises N x N), torch_sdpa
    (``torch.nn.functional.scaled_dot_product_attention``), ours_softmax, ours_linear, and
    torch_linear (linear attention in plain PyTorch, written below);
  * ``layer_norm`` - torch (``F.layer_norm``, residual added separately) and ours (fused);
  * ``train_step`` - one AdamW step of an encoder-decoder: ours_softmax / ours_linear
    (``Seq2SeqTransformer``) and torch (``torch.nn.Transformer`` of the same size).
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import transformer_fast as tf
from transformer_fast import reference


class NotAvailable(Exception):
    """An implementation that cannot run here (missing module, unsupported option)."""


# name -> (label, PyTorch baseline it is compared with, FLOP-count formula family)
IMPLS = {
    "attention": {
        "naive": ("naive reference", "torch_sdpa", "softmax"),
        "torch_sdpa": ("torch SDPA", None, "softmax"),
        "ours_softmax": ("ours softmax", "torch_sdpa", "softmax"),
        "ours_linear": ("ours linear", "torch_linear", "linear"),
        "torch_linear": ("PyTorch linear", None, "linear"),
    },
    "layer_norm": {
        "torch": ("torch layer_norm", None, None),
        "ours": ("ours layer_norm", "torch", None),
    },
    "train_step": {
        "torch": ("torch nn.Transformer", None, None),
        "ours_softmax": ("ours Seq2Seq softmax", "torch", None),
        "ours_linear": ("ours Seq2Seq linear", "torch", None),
    },
}
FAMILIES = tuple(IMPLS)
PASSES = ("fwd", "fwd+bwd")

# Floor of the correctness bound, relative to the oracle's magnitude. The check exists to catch
# wrong kernels (errors of order 1), not to grade precision (tests/ does that with the 2x policy).
CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def label(family, impl):
    return IMPLS[family][impl][0]


def baseline(family, impl):
    return IMPLS[family][impl][1]


# --------------------------------------------------------------------------------------------
# Plain PyTorch linear attention: the baseline a user would write without a kernel
# --------------------------------------------------------------------------------------------
def torch_linear_attention(q, k, v, is_causal=False, eps=1e-6):
    """phi(x) = elu(x) + 1 linear attention in plain PyTorch. Causal: the cumulative-sum form,
    which materialises the (B, H, N, D, Dv) prefix states (at least float32, as the kernels' state);
    non-causal: two einsums through the (D, Dv) state."""
    acc = torch.promote_types(q.dtype, torch.float32)
    phi_q = (F.elu(q) + 1).to(acc)
    phi_k = (F.elu(k) + 1).to(acc)
    v32 = v.to(acc)
    if is_causal:
        states = (phi_k[..., :, None] * v32[..., None, :]).cumsum(dim=2)  # (B, H, N, D, Dv)
        normalisers = phi_k.cumsum(dim=2)  # (B, H, N, D)
        numerator = torch.einsum("bhnd,bhnde->bhne", phi_q, states)
        denominator = (phi_q * normalisers).sum(-1, keepdim=True) + eps
    else:
        state = torch.einsum("bhnd,bhne->bhde", phi_k, v32)
        numerator = torch.einsum("bhnd,bhde->bhne", phi_q, state)
        denominator = torch.einsum("bhnd,bhd->bhn", phi_q, phi_k.sum(dim=2))[..., None] + eps
    return (numerator / denominator).to(q.dtype)


def attention_output(impl, q, k, v, causal):
    if impl == "naive":
        return reference.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "torch_sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "ours_softmax":
        return tf.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "ours_linear":
        return tf.linear_attention(q, k, v, is_causal=causal)
    if impl == "torch_linear":
        return torch_linear_attention(q, k, v, is_causal=causal)
    raise ValueError(f"unknown attention implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# Correctness: compare with a float64 oracle on a subset of query rows (an N x N float64
# reference would not fit at long lengths; a causal row i is the non-causal row over keys <= i)
# --------------------------------------------------------------------------------------------
def check_rows(n, count=12):
    return sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(min(n, count))})


def _row_oracle(ref_fn, q, k, v, causal, rows, dout_rows):
    """ref_fn evaluated at query rows `rows` in q's dtype; with dout_rows, also the gradients of
    sum(out * dout_rows) with respect to q, k, v (zero outside the rows' reach)."""
    grad = dout_rows is not None
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    n = k.shape[2]
    with torch.enable_grad() if grad else torch.no_grad():
        out = torch.cat([ref_fn(q[:, :, i:i + 1], k[:, :, :(i + 1 if causal else n)],
                                v[:, :, :(i + 1 if causal else n)]) for i in rows], dim=2)
        if not grad:
            return [out]
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout_rows.to(out.dtype))]


def compare(results, oracle64, oracle_lowp, dtype, names):
    """(ok, max error, its bound, note): every result must be finite and within
    2 x (the oracle's own error in `dtype`) + CHECK_RTOL[dtype] x max(1, |oracle|)."""
    worst = (0.0, 0.0, 1.0)  # (error / bound, error, bound)
    for name, got, ref64, reflp in zip(names, results, oracle64, oracle_lowp):
        got = got.detach()
        if got.shape != ref64.shape:
            return False, math.inf, 0.0, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref64.shape)}"
        if not torch.isfinite(got).all():
            return False, math.inf, 0.0, f"{name}: not finite"
        ref64 = ref64.double()
        err = (got.double() - ref64).abs().max().item() if got.numel() else 0.0
        ref_err = (reflp.detach().double() - ref64).abs().max().item() if got.numel() else 0.0
        scale = max(1.0, ref64.abs().max().item() if got.numel() else 1.0)
        bound = 2.0 * ref_err + CHECK_RTOL.get(dtype, 1e-2) * scale
        if err > bound:
            return False, err, bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"
        if err / bound >= worst[0]:
            worst = (err / bound, err, bound)
    return True, worst[1], worst[2], ""


def _randn(shape, dtype, device, generator):
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------
class Group:
    """One case: the inputs and the implementations compared on them."""

    family = ""

    def __init__(self, seq_len, config, impls, dtype, device, seed=0):
        self.seq_len = int(seq_len)
        self.config = dict(config)
        self.impls = [i for i in impls if i in IMPLS[self.family]]
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed
        self.backward = config.get("pass") == "fwd+bwd"

    @property
    def key(self):
        return f"{self.family}[{self.describe()}, N={self.seq_len}]"

    def describe(self):
        return ", ".join(str(v) for v in self.config.values())

    def setup(self):
        """Allocates the inputs (kept out of __init__ so that pending groups hold no memory)."""

    def teardown(self):
        for name in list(vars(self)):
            if isinstance(getattr(self, name), (torch.Tensor, nn.Module)) or name.startswith("_state"):
                setattr(self, name, None)

    def generator(self, offset=0):
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.seq_len * 7 + offset)

    # To implement:
    def function(self, impl):
        """A no-argument callable running `impl` once (raises NotAvailable)."""
        raise NotImplementedError

    def check(self, impl):
        """(ok, max error, bound, note): runs `impl` once and compares with the oracle."""
        raise NotImplementedError

    def work(self, impl):
        """{'tokens': ..., 'flops': ... or None, 'bytes': ... or None} per call."""
        raise NotImplementedError

    def memory_estimate(self, impl):
        """Rough peak bytes a call allocates (to skip what cannot fit)."""
        return 0

    def growth(self, impl):
        """Exponent of the call time's growth with N (to skip what would be too slow)."""
        return 1


class AttentionGroup(Group):
    family = "attention"

    def __init__(self, seq_len, config, impls, dtype, device, *, batch, heads, head_dim, seed=0):
        super().__init__(seq_len, config, impls, dtype, device, seed)
        self.causal = bool(config["causal"])
        self.shape = (batch, heads, self.seq_len, head_dim)

    def describe(self):
        return f"{'causal' if self.causal else 'non-causal'}, {self.config['pass']}"

    def setup(self):
        g = self.generator()
        self.q, self.k, self.v = (_randn(self.shape, self.dtype, self.device, g).requires_grad_(self.backward)
                                  for _ in range(3))
        self.dout = _randn(self.shape, self.dtype, self.device, g) if self.backward else None

    def function(self, impl):
        q, k, v, causal, dout = self.q, self.k, self.v, self.causal, self.dout
        if self.backward:
            return lambda: torch.autograd.grad(attention_output(impl, q, k, v, causal), (q, k, v), dout)
        return lambda: attention_output(impl, q, k, v, causal)

    def check(self, impl):
        rows = check_rows(self.seq_len)
        softmax = IMPLS["attention"][impl][2] == "softmax"
        ref_fn = reference.scaled_dot_product_attention if softmax else reference.linear_attention
        q, k, v = (t.detach().requires_grad_(self.backward) for t in (self.q, self.k, self.v))
        names = ["output"]
        with torch.enable_grad() if self.backward else torch.no_grad():
            out = attention_output(impl, q, k, v, self.causal)
            results = [out[:, :, rows]]
            dout_rows = None
            if self.backward:
                dout_rows = _randn(out[:, :, rows].shape, torch.float64, self.device, self.generator(1))
                dout = torch.zeros_like(out)
                dout[:, :, rows] = dout_rows.to(out.dtype)
                results += list(torch.autograd.grad(out, (q, k, v), dout))
                names += ["grad query", "grad key", "grad value"]
        if not torch.isfinite(out).all():
            return False, math.inf, 0.0, "output has non-finite values"
        key = "oracle_softmax" if softmax else "oracle_linear"  # shared by the implementations of a group
        if getattr(self, "_state_" + key, None) is None:
            setattr(self, "_state_" + key, (
                _row_oracle(ref_fn, *(t.double() for t in (q, k, v)), self.causal, rows, dout_rows),
                _row_oracle(ref_fn, q, k, v, self.causal, rows, dout_rows)))
        oracle64, oracle_lp = getattr(self, "_state_" + key)
        return compare(results, oracle64, oracle_lp, self.dtype, names)

    def work(self, impl):
        B, H, N, D = self.shape
        if IMPLS["attention"][impl][2] == "softmax":
            # 2 matmuls of N x N x D; causal does half; backward = 2.5 x forward (FlashAttention's count)
            flops = 4.0 * B * H * N * N * D * (0.5 if self.causal else 1.0)
        else:  # phi(K)^T V and phi(Q) S: 2 products of N x D x Dv
            flops = 4.0 * B * H * N * D * D
        if self.backward:
            flops *= 3.5 if IMPLS["attention"][impl][2] == "softmax" else 3.0
        return {"tokens": B * N, "flops": flops, "bytes": None}

    def memory_estimate(self, impl):
        B, H, N, D = self.shape
        elem = torch.empty((), dtype=self.dtype).element_size()
        if impl == "naive":  # scores, bias, probabilities, masks: a handful of N x N tensors
            return (12 if self.backward else 6) * B * H * N * N * elem
        if impl == "torch_linear" and self.causal:  # float32 prefix states (B, H, N, D, D)
            return (6 if self.backward else 3) * B * H * N * D * D * 4
        return 16 * B * H * N * D * 4

    def growth(self, impl):
        return 2 if IMPLS["attention"][impl][2] == "softmax" else 1


class LayerNormGroup(Group):
    family = "layer_norm"

    def __init__(self, seq_len, config, impls, dtype, device, *, batch, width, seed=0):
        super().__init__(seq_len, config, impls, dtype, device, seed)
        self.residual = bool(config["residual"])
        self.rows, self.width = batch * self.seq_len, width

    def describe(self):
        return f"{'+ residual' if self.residual else 'no residual'}, {self.config['pass']}"

    def setup(self):
        g = self.generator()
        shape = (self.rows, self.width)
        self.x = _randn(shape, self.dtype, self.device, g).requires_grad_(self.backward)
        self.r = _randn(shape, self.dtype, self.device, g).requires_grad_(self.backward) if self.residual else None
        self.w = (1 + 0.1 * _randn((self.width,), self.dtype, self.device, g)).requires_grad_(self.backward)
        self.b = (0.1 * _randn((self.width,), self.dtype, self.device, g)).requires_grad_(self.backward)
        self.dy = _randn(shape, self.dtype, self.device, g) if self.backward else None
        self.dh = _randn(shape, self.dtype, self.device, g) if self.backward and self.residual else None

    def _inputs(self):
        return [t for t in (self.x, self.r, self.w, self.b) if t is not None]

    @staticmethod
    def _forward(impl, x, r, w, b):
        shape = (x.shape[-1],)
        if impl == "torch":
            if r is None:
                return F.layer_norm(x, shape, w, b)
            h = x + r
            return F.layer_norm(h, shape, w, b), h
        if impl == "ours":
            return tf.layer_norm(x, shape, w, b, residual=r)
        if impl == "reference":
            return reference.layer_norm(x, shape, w, b, residual=r)
        raise ValueError(f"unknown layer_norm implementation {impl!r}")

    def function(self, impl):
        x, r, w, b, inputs = self.x, self.r, self.w, self.b, self._inputs()
        if not self.backward:
            return lambda: self._forward(impl, x, r, w, b)
        grads = (self.dy, self.dh) if self.residual else (self.dy,)

        def step():
            out = self._forward(impl, x, r, w, b)
            return torch.autograd.grad(out if self.residual else (out,), inputs, grads)
        return step

    def _run(self, impl, dtype):
        inputs = [t.detach().to(dtype).requires_grad_(self.backward) for t in self._inputs()]
        x, r, w, b = (inputs if self.residual else [inputs[0], None, *inputs[1:]])
        with torch.enable_grad() if self.backward else torch.no_grad():
            out = self._forward(impl, x, r, w, b)
            outs = list(out) if self.residual else [out]
            if self.backward:
                upstream = [g.to(dtype) for g in ((self.dy, self.dh) if self.residual else (self.dy,))]
                outs = [o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, upstream))
        return outs

    def check(self, impl):
        names = ["y", "h"][:1 + self.residual]
        if self.backward:
            names += ["grad x", "grad residual", "grad weight", "grad bias"] if self.residual else \
                ["grad x", "grad weight", "grad bias"]
        results = self._run(impl, self.dtype)
        return compare(results, self._run("reference", torch.float64), self._run("reference", self.dtype),
                       self.dtype, names)

    def work(self, impl):
        elem = torch.empty((), dtype=self.dtype).element_size()
        tensors = 4 if self.residual else 2  # forward: read x (, residual); write y (, h)
        if self.backward:  # backward: read dy (, dh), the input; write dx
            tensors += 4 if self.residual else 3
        return {"tokens": self.rows, "flops": None, "bytes": tensors * self.rows * self.width * elem}

    def memory_estimate(self, impl):
        return 8 * self.rows * self.width * 4


# --------------------------------------------------------------------------------------------
# The training step of a full encoder-decoder
# --------------------------------------------------------------------------------------------
def sinusoidal_positions(n, d):
    position = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: d // 2])
    return table


class TorchSeq2Seq(nn.Module):
    """torch.nn.Transformer with token embeddings, sinusoidal positions and an output projection:
    the PyTorch model of the same size as ours."""

    def __init__(self, vocab, d_model, nhead, num_layers, dim_feedforward, max_len):
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = nn.Embedding(vocab, d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.transformer = nn.Transformer(d_model, nhead, num_layers, num_layers, dim_feedforward,
                                          dropout=0.0, batch_first=True)
        self.generator = nn.Linear(d_model, vocab)

    def forward(self, src, tgt, pad_id=0):
        # the same work as ours: padding masks (src == pad, tgt == pad) and a causal target mask
        src_padding, tgt_padding = src == pad_id, tgt == pad_id
        m = tgt.shape[1]
        src = self.src_embed(src) * self.scale + self.positions[: src.shape[1]].to(self.src_embed.weight.dtype)
        tgt = self.tgt_embed(tgt) * self.scale + self.positions[:m].to(self.tgt_embed.weight.dtype)
        causal = torch.ones(m, m, dtype=torch.bool, device=tgt.device).triu(1)  # True = may not attend
        return self.generator(self.transformer(src, tgt, tgt_mask=causal, src_key_padding_mask=src_padding,
                                               tgt_key_padding_mask=tgt_padding,
                                               memory_key_padding_mask=src_padding, tgt_is_causal=True))


def build_ours_model(attention, vocab, d_model, nhead, num_layers, dim_feedforward, max_len):
    from transformer_fast import Seq2SeqTransformer
    return Seq2SeqTransformer(vocab, vocab, d_model=d_model, nhead=nhead, num_encoder_layers=num_layers,
                              num_decoder_layers=num_layers, dim_feedforward=dim_feedforward, dropout=0.0,
                              attention=attention, max_len=max_len)


@contextlib.contextmanager
def backend_env(name):
    """Forces transformer_fast's backend through its environment variable (read on every call)."""
    old = os.environ.get("TRANSFORMER_FAST_BACKEND")
    os.environ["TRANSFORMER_FAST_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRANSFORMER_FAST_BACKEND", None)
        else:
            os.environ["TRANSFORMER_FAST_BACKEND"] = old


class TrainStepGroup(Group):
    family = "train_step"

    def __init__(self, seq_len, config, impls, dtype, device, *, batch, d_model, nhead, num_layers,
                 dim_feedforward, vocab, seed=0):
        super().__init__(seq_len, config, impls, dtype, device, seed)
        self.batch, self.d_model, self.nhead, self.num_layers = batch, d_model, nhead, num_layers
        self.dim_feedforward, self.vocab = dim_feedforward, vocab
        self._state = {}

    def describe(self):
        return (f"d_model={self.d_model}, heads={self.nhead}, {self.num_layers}+{self.num_layers} layers, "
                f"ff={self.dim_feedforward}, vocab={self.vocab}")

    def setup(self):
        g = self.generator()
        # token 0 is padding (for both models): draw 1 .. vocab - 1, so nothing is padded
        tokens = torch.randint(1, self.vocab, (self.batch, self.seq_len + 1), generator=g).to(self.device)
        self.src = torch.randint(1, self.vocab, (self.batch, self.seq_len), generator=g).to(self.device)
        self.tgt_in, self.tgt_out = tokens[:, :-1], tokens[:, 1:]
        self._state = {}

    def teardown(self):
        self._state = {}
        super().teardown()

    def model(self, impl):
        if impl not in self._state:
            torch.manual_seed(self.seed)
            if impl == "torch":
                model = TorchSeq2Seq(self.vocab, self.d_model, self.nhead, self.num_layers, self.dim_feedforward,
                                     self.seq_len + 1)
            else:
                model = build_ours_model(impl.split("_", 1)[1], self.vocab, self.d_model, self.nhead,
                                         self.num_layers, self.dim_feedforward, self.seq_len + 1)
            model = model.to(device=self.device, dtype=self.dtype).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self._state[impl] = (model, optimizer)
        return self._state[impl]

    def _logits(self, model):
        logits = model(self.src, self.tgt_in)
        if logits.dim() == 3 and logits.shape[:2] != self.tgt_in.shape and logits.shape[:2] == self.tgt_in.shape[::-1]:
            logits = logits.transpose(0, 1)  # a sequence-first model
        return logits

    def function(self, impl):
        model, optimizer = self.model(impl)

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self._logits(model).reshape(-1, self.vocab).float(), self.tgt_out.reshape(-1))
            loss.backward()
            optimizer.step()
            return loss.detach()
        return step

    def parameters(self, impl):
        return sum(p.numel() for p in self.model(impl)[0].parameters())

    def check(self, impl):
        """Ours: the model's logits with the selected backend against the same model on the
        reference backend (eval mode); both: the training loss is finite."""
        model, _ = self.model(impl)
        ok, err, bound, note = True, 0.0, 0.0, ""
        if impl != "torch":
            model.eval()
            with torch.no_grad():
                got = self._logits(model)
                with backend_env("reference"):
                    ref = self._logits(model)
            model.train()
            scale = max(1.0, ref.abs().max().item())
            err = (got.double() - ref.double()).abs().max().item()
            bound = 10 * CHECK_RTOL.get(self.dtype, 1e-2) * scale
            if not torch.isfinite(got).all() or not err <= bound:
                return False, err, bound, f"logits differ from the reference backend's by {err:.3g} > {bound:.3g}"
            note = "logits vs the reference backend"
        loss = self.function(impl)()
        if not torch.isfinite(loss):
            return False, math.inf, 0.0, "training loss is not finite"
        return ok, err, bound, note or "finite loss"

    def work(self, impl):
        return {"tokens": 2 * self.batch * self.seq_len, "flops": None, "bytes": None}

    def memory_estimate(self, impl):
        # activations of (2 + 3) attention blocks per layer, each up to B x H x N x N for torch
        # on CPU (the math path); ours is linear in N
        elem = torch.empty((), dtype=self.dtype).element_size()
        quadratic = 5 * self.num_layers * self.batch * self.nhead * self.seq_len ** 2 * elem if impl == "torch" else 0
        return quadratic + 64 * self.num_layers * self.batch * self.seq_len * self.dim_feedforward * elem

    def growth(self, impl):  # at these sizes the (N-linear) projections and feed-forward dominate
        return 1.5 if impl != "ours_linear" else 1


def make_groups(args, device, dtype):
    """The groups of a run, in the order they run (N ascending within each configuration)."""
    groups = []
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if "attention" in args.families:
        for c in causal:
            for p in args.passes:
                for n in args.seq_lens:
                    groups.append(AttentionGroup(n, {"causal": c, "pass": p}, args.impls["attention"], dtype, device,
                                                 batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                                                 seed=args.seed))
    if "layer_norm" in args.families:
        for residual in (False, True):
            for p in args.passes:
                for n in args.seq_lens:
                    groups.append(LayerNormGroup(n, {"residual": residual, "pass": p}, args.impls["layer_norm"],
                                                 dtype, device, batch=args.batch, width=args.ln_width,
                                                 seed=args.seed))
    if "train_step" in args.families:
        for n in args.train_seq_lens:
            groups.append(TrainStepGroup(n, {"pass": "train"}, args.impls["train_step"], dtype, device,
                                         batch=args.batch, d_model=args.train_d_model, nhead=args.train_heads,
                                         num_layers=args.train_layers, dim_feedforward=4 * args.train_d_model,
                                         vocab=args.train_vocab, seed=args.seed))
    return groups
