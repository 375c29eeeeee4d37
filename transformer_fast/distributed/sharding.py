"""DTensor sharding rules for the kernel ops, so that DTensor inputs run the kernels on their local
shards.

Which ops DTensor meets. The public ops (``scaled_dot_product_attention``, ``varlen_attn``,
``layer_norm``, ``linear_attention``) are CompositeImplicitAutograd: a DTensor decomposes them at
the autograd key into the kernel ops, whose autograd kernels record the node and redispatch, so
DTensor's ``__torch_dispatch__`` sees ``attention_forward``, ``layer_norm_forward`` and
``linear_attention_forward``, and the node's backward calls ``attention_backward``,
``layer_norm_backward`` and ``linear_attention_backward`` on DTensors. Those six get rules here
(``torch.distributed.tensor.experimental.register_sharding``). The ``*_backward_composite`` ops
(second derivatives, torch.func) are CompositeImplicitAutograd too and decompose into aten ops
that DTensor has rules for.

The rules (each also offers every tensor replicated, which is what DTensor falls back to when no
sharded form matches without communication):

* softmax attention, dense (q (B, H, Nq, D)): sharded on the batch (dim 0) or on the heads (dim 1)
  of q, k, v, out, lse and their gradients. The optional tensors follow: ``attn_mask`` (the public
  op hands the kernel a (B, H, Nq, Nk) view, stride 0 on broadcast dims) and ``alibi_slopes``
  ((B, H) view) on the same dim, ``key_padding_mask`` (B, Nk) on the batch or replicated,
  ``sinks`` (H,) on the heads or replicated, the dropout seed replicated; dS (when computed) and
  delta as the scores and lse. Heads are sharded only where every rank's query heads use its own
  key/value heads: Hk == H, or both divisible by the mesh's size (grouped-query attention).
  Packed sequences (``varlen_attn``: q (Tq, H, D), lse (H, Tq)) on the heads only, the index
  tensors replicated. A replicated input that a rule wants sharded is split locally (no
  communication; DTensor copies the local piece, so a broadcast mask's piece is materialised).
  With dropout the rules offer replication only: the kernels draw dropout from the seed and a
  row's local index, so shards would repeat one another's pattern (replicated, the result is the
  one-process result, given the same torch seed on every rank).
* LayerNorm / RMSNorm (with the fused residual): sharded on any dim but the normalised last one
  (batch, sequence), ``weight``/``bias`` replicated. mean and rstd, (M,) over the rows, are
  sharded on dim 0: each rank's piece is its local rows' statistics, in the local order, which
  only the backward op reads. In the backward the weight and bias gradients are ``Partial`` (a
  sum over the ranks' rows) where the rows are sharded.
* linear attention: sharded on the batch or the heads, the initial and final states (B, H, D, Dv)
  and (B, H, D) and their gradients on the same dim, ``key_padding_mask`` on the batch or
  replicated.

Results a call does not produce are empty (0,) tensors (an op cannot return None); they are
replicated, as torch's rules do for its attention's empty outputs.

Registration needs ``torch.distributed.tensor``, whose import took 0.9-5 s on the loaded 2-core
CPU, 10-30x what ``import transformer_fast`` adds to ``import torch`` (30-100 ms), so importing
this module registers the rules at once only where DTensor is already imported, and otherwise
when it is (a one-shot import hook: no DTensor can exist before). The hook costs the import
0.2-0.3 ms, registering 0.8 ms. ``register()`` does it explicitly.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"
_lock = threading.Lock()
_registered = False


# --------------------------------------------------------------------------------------------
# Placements of one call. A rule returns [(output placements, {argument name: placement})]: the
# outputs in the op's return order, the inputs by schema name; arguments it does not name are
# refused if they hold a tensor (a rule must say where each tensor goes).
# --------------------------------------------------------------------------------------------
def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard
    return Replicate(), Shard, Partial


def _heads_align(q_heads, kv_heads, spec):
    """Grouped-query heads sharded evenly keep each rank's query heads with their key/value heads;
    unequal chunks (torch.chunk's) would not. The mesh's whole size bounds every sub-mesh used."""
    n = spec.mesh.size()
    return q_heads == kv_heads or (q_heads % n == 0 and kv_heads % n == 0)


def _attention_forward(a):
    R, Shard, _ = _placements()
    q, k = a["q"], a["k"]
    every = ("q", "k", "v", "attn_mask", "key_padding_mask", "seed", "alibi_slopes", "sinks", "cu_seq_q",
             "cu_seq_k", "seqused_k", "block_table")
    rules = [((R, R), dict.fromkeys(every, R))]
    if a["dropout_p"] != 0.0:
        return rules
    if a["cu_seq_q"] is None:  # dense (B, H, N, D)
        s0, s1 = Shard(0), Shard(1)
        rules.append(((s0, s0), dict(q=s0, k=s0, v=s0, attn_mask=s0, key_padding_mask=s0, seed=R,
                                     alibi_slopes=s0, sinks=R)))
        if _heads_align(q.shape[1], k.shape[1], q):
            rules.append(((s1, s1), dict(q=s1, k=s1, v=s1, attn_mask=s1, key_padding_mask=R, seed=R,
                                         alibi_slopes=s1, sinks=Shard(0))))
    else:  # packed (T, H, D); paged k/v (pages, page_size, Hk, D)
        kv_heads_dim = 2 if a["block_table"] is not None else 1
        if _heads_align(q.shape[1], k.shape[kv_heads_dim], q):
            kv = Shard(kv_heads_dim)
            rules.append(((Shard(1), Shard(0)), dict(q=Shard(1), k=kv, v=kv, seed=R, alibi_slopes=Shard(1),
                                                      sinks=Shard(0), cu_seq_q=R, cu_seq_k=R, seqused_k=R,
                                                      block_table=R)))
    return rules


def _attention_backward(a):
    R, Shard, _ = _placements()
    q, k = a["q"], a["k"]
    every = ("dout", "q", "k", "v", "out", "lse", "attn_mask", "key_padding_mask", "seed", "alibi_slopes",
             "cu_seq_q", "cu_seq_k", "sinks")
    rules = [((R,) * 5, dict.fromkeys(every, R))]
    if a["dropout_p"] != 0.0:
        return rules
    dmask, delta = a["compute_dmask"], a["compute_delta"]
    if a["cu_seq_q"] is None:
        for dim, kpm, sinks in ((0, Shard(0), R), (1, R, Shard(0))):
            if dim == 1 and not _heads_align(q.shape[1], k.shape[1], q):
                continue
            s = Shard(dim)
            rules.append(((s, s, s, s if dmask else R, s if delta else R),
                          dict(dout=s, q=s, k=s, v=s, out=s, lse=s, attn_mask=s, key_padding_mask=kpm, seed=R,
                               alibi_slopes=s, sinks=sinks)))
    elif _heads_align(q.shape[1], k.shape[1], q):
        s = Shard(1)
        rules.append(((s, s, s, R, Shard(0) if delta else R),
                      dict(dout=s, q=s, k=s, v=s, out=s, lse=Shard(0), seed=R, alibi_slopes=s, sinks=Shard(0),
                           cu_seq_q=R, cu_seq_k=R)))
    return rules


def _norm_row_dims(x):
    return range(len(x.shape) - 1)  # every dim but the normalised last one


def _layer_norm_forward(a):
    R, Shard, _ = _placements()
    x, residual, is_rms = a["x"], a["residual"], a["is_rms"]
    rules = [((R,) * 4, dict(x=R, residual=R, weight=R, bias=R))]
    for d in _norm_row_dims(x):
        s = Shard(d)
        rules.append(((s, s if residual is not None else R, R if is_rms else Shard(0), Shard(0)),
                      dict(x=s, residual=s, weight=R, bias=R)))
    return rules


def _layer_norm_backward(a):
    R, Shard, Partial = _placements()
    h, weight, bias, is_rms = a["h"], a["weight"], a["bias"], a["is_rms"]
    every = ("dy", "dh", "h", "weight", "bias", "mean", "rstd")
    rules = [((R,) * 3, dict.fromkeys(every, R))]
    for d in _norm_row_dims(h):
        s = Shard(d)
        rules.append(((s, Partial() if weight is not None else R, Partial() if bias is not None else R),
                      dict(dy=s, dh=s, h=s, weight=R, bias=R, mean=R if is_rms else Shard(0), rstd=Shard(0))))
    return rules


def _linear_attention_forward(a):
    R, Shard, _ = _placements()
    final = a["output_final_state"]
    rules = [((R,) * 3, dict(q=R, k=R, v=R, key_padding_mask=R, initial_S=R, initial_z=R))]
    for dim, kpm in ((0, Shard(0)), (1, R)):
        s = Shard(dim)
        rules.append(((s, s if final else R, s if final else R),
                      dict(q=s, k=s, v=s, key_padding_mask=kpm, initial_S=s, initial_z=s)))
    return rules


def _linear_attention_backward(a):
    R, Shard, _ = _placements()
    initial = a["initial_S"] is not None
    every = ("dout", "q", "k", "v", "key_padding_mask", "initial_S", "initial_z", "grad_final_S", "grad_final_z")
    rules = [((R,) * 5, dict.fromkeys(every, R))]
    for dim, kpm in ((0, Shard(0)), (1, R)):
        s = Shard(dim)
        rules.append(((s, s, s, s if initial else R, s if initial else R),
                      dict(dout=s, q=s, k=s, v=s, key_padding_mask=kpm, initial_S=s, initial_z=s, grad_final_S=s,
                           grad_final_z=s)))
    return rules


RULES = {
    "attention_forward": _attention_forward,
    "attention_backward": _attention_backward,
    "layer_norm_forward": _layer_norm_forward,
    "layer_norm_backward": _layer_norm_backward,
    "linear_attention_forward": _linear_attention_forward,
    "linear_attention_backward": _linear_attention_backward,
}


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------
def _as_register_sharding_fn(op, rule):
    """register_sharding calls its function with the op's arguments as passed (tensors as
    DTensorSpecs, trailing defaults possibly left out) and wants, per strategy, the outputs'
    placements followed by one placement per tensor argument, in order. This binds the
    arguments to the schema's names, so a rule reads them by name and names its placements."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    arguments = op._schema.arguments
    names = [arg.name for arg in arguments]
    defaults = {arg.name: arg.default_value for arg in arguments if arg.has_default_value()}

    def sharding(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        for name in names:
            bound.setdefault(name, defaults.get(name))
        strategies = []
        for outputs, inputs in rule(bound):
            placed = []
            for name in names:
                if isinstance(bound[name], DTensorSpec):
                    if name not in inputs:
                        raise NotImplementedError(f"{op}: the sharding rule places no tensor argument '{name}'")
                    placed.append(inputs[name])
            strategies.append((list(outputs), placed))
        return strategies

    return sharding


def _static_argnum(op):
    """The index of the op's first argument that is not a tensor. register_sharding keys DTensor's
    propagation cache (the strategy and the outputs' shapes) on the non-tensor arguments only
    from the first int argument on, which would leave out flags that change the outputs
    (is_rms, compute_dmask, output_final_state) and dropout_p: every one of them must be in the key."""
    for i, arg in enumerate(op._schema.arguments):
        t = arg.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if not isinstance(t, torch.TensorType):
            return i
    return len(op._schema.arguments)


def register():
    """Registers the rules with DTensor (imports torch.distributed.tensor). Idempotent."""
    global _registered
    with _lock:
        if _registered:
            return
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        from torch.distributed.tensor.experimental import register_sharding

        propagator = DTensor._op_dispatcher.sharding_propagator
        for name, rule in RULES.items():
            op = getattr(torch.ops.transformer_fast, name).default
            register_sharding(op)(_as_register_sharding_fn(op, rule))
            propagator.op_to_schema_info[op] = RuntimeSchemaInfo(_static_argnum(op), needs_pytree=True)
        _registered = True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch.distributed.tensor is about to be imported, it takes that
    module's spec from the finders after it and has its loader call register() once the module
    has executed; then it leaves sys.meta_path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR_MODULE:
            return None
        _remove_hook()
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a class-level loader is shared: left alone (register() can still be called)
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            try:
                register()
            except Exception as exc:  # noqa: BLE001 - DTensor itself must still import
                warnings.warn(f"transformer_fast: DTensor sharding rules not registered ({type(exc).__name__}: "
                              f"{exc}); DTensor inputs to the ops will raise NotImplementedError", stacklevel=2)

        loader.exec_module = exec_module
        return spec


_hook = _RegisterAfterImport()


def _remove_hook():
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def _register_when_dtensor_loads():
    if not torch.distributed.is_available():
        return
    if _DTENSOR_MODULE in sys.modules:
        register()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


_register_when_dtensor_loads()
