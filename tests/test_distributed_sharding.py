"""DTensor inputs to every op (transformer_fast/distributed/sharding.py), tensor parallelism on a
Hugging Face Llama block, FSDP2 and DDP, on gloo processes (world sizes 2 and 4).

Each world size is one spawn (a rank's imports cost seconds): its ranks run every check of
CHECKS[world size] and return, per check, None or the traceback; each test reads its own. The
checks assert on what every rank holds alike (full tensors, collective counts) after the
collectives they compare, so an assertion fails on every rank at once and leaves none waiting in a
collective (and the launcher bounds every wait).

An op check runs the function three ways from the same float32 inputs: on DTensors placed as the
check says, in one process on plain tensors, and as the float64 reference (transformer_fast.reference).
The DTensor results (full_tensor() of outputs and input gradients) must equal the one-process call's
and be within the project's rule of the float64 reference (twice the float32 reference's error);
the forward and backward on DTensors must run without a collective where the rules shard (and the
outputs keep the expected placements), and with one where they replicate.

No test here needs more than one GPU: the launcher runs gloo on the CPU.
"""
import importlib.util
import subprocess
import sys
import traceback

import pytest
import torch

from distributed_launch import run_ranks
from helpers import assert_close_to_reference

import transformer_fast as tf
from transformer_fast import reference

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


# --------------------------------------------------------------------------------------------
# One op, three ways
# --------------------------------------------------------------------------------------------
def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _as(inputs, dtype):
    """The inputs with floating tensors in ``dtype``, fresh leaves keeping requires_grad."""
    return {k: (v.detach().to(dtype).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                and v.is_floating_point() else v) for k, v in inputs.items()}


def _on_mesh(placement):
    return tuple(placement) if isinstance(placement, (tuple, list)) else (placement,)


def _op_check(mesh, ours, ref, inputs, placements, *, out_placements=None, collectives=0):
    """ours(**inputs) on DTensors (inputs named in ``placements``, placed so: a placement, or one per
    dim of a 2-D mesh; the rest as they are)
    against the one-process call and the float64 reference ref(**inputs). ``out_placements``: the
    outputs' expected placements; ``collectives``: the collectives expected in forward+backward
    (0, or None for "at least one")."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    diff = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    plain = _as(inputs, torch.float32)
    outs = _leaves(ours(**plain))
    upstream = [torch.randn_like(o) for o in outs]  # the same on every rank: one seed
    pairs = [(o, g) for o, g in zip(outs, upstream) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    placed = {k: (distribute_tensor(v.detach(), mesh, _on_mesh(placements[k]), src_data_rank=None)
                  .requires_grad_(v.requires_grad) if k in placements else v) for k, v in inputs.items()}
    with CommDebugMode() as comm:
        douts = _leaves(ours(**placed))
        dgrads = [(o, distribute_tensor(g, mesh, o.placements, src_data_rank=None))
                  for o, g in zip(douts, upstream) if o.requires_grad]
        if dgrads:
            torch.autograd.backward([o for o, _ in dgrads], [g for _, g in dgrads])
    counts = dict(comm.get_comm_counts())
    got_placements = [tuple(o.placements) for o in douts]
    full_outs = [o.full_tensor() for o in douts]
    full_grads = [placed[k].grad.full_tensor() if isinstance(placed[k].grad, DTensor) else placed[k].grad
                  for k in diff]

    refs = {dtype: _as(inputs, dtype) for dtype in (torch.float64, torch.float32)}
    ref_outs = {dtype: _leaves(ref(**args)) for dtype, args in refs.items()}
    ref_grads = {}
    for dtype, args in refs.items():
        ups = [g.to(dtype) for g in upstream]
        routs = [(o, g) for o, g in zip(ref_outs[dtype], ups) if o.requires_grad]
        ref_grads[dtype] = torch.autograd.grad([o for o, _ in routs], [args[k] for k in diff],
                                               [g for _, g in routs]) if diff else ()

    if out_placements is not None:
        assert got_placements == [tuple(p) for p in out_placements], got_placements
    total = sum(counts.values())
    assert (total > 0) if collectives is None else (total == collectives), f"collectives: {counts}"
    for i, (full, one, r64, r32) in enumerate(zip(full_outs, outs, ref_outs[torch.float64],
                                                  ref_outs[torch.float32])):
        torch.testing.assert_close(full, one.detach(), msg=lambda m: f"output {i} vs one process: {m}")
        assert_close_to_reference(full, r64, r32, what=f"output {i}")
    for k, full, r64, r32 in zip(diff, full_grads, ref_grads[torch.float64], ref_grads[torch.float32]):
        torch.testing.assert_close(full, plain[k].grad, msg=lambda m: f"grad of {k} vs one process: {m}")
        assert_close_to_reference(full, r64, r32, what=f"grad of {k}")


def _attention_inputs(B, H, Hk, Nq, Nk, D, Dv=None, **extra):
    q = torch.randn(B, H, Nq, D, requires_grad=True)
    k = torch.randn(B, Hk, Nk, D, requires_grad=True)
    v = torch.randn(B, Hk, Nk, Dv or D, requires_grad=True)
    return dict(query=q, key=k, value=v, **extra)


def _sdpa(**kw):
    return tf.scaled_dot_product_attention(**kw)


def _sdpa_reference(query, key, value, enable_gqa=False, **kw):
    return reference.scaled_dot_product_attention(query, key, value, **kw)


# --------------------------------------------------------------------------------------------
# Op checks (world size 2 and 4)
# --------------------------------------------------------------------------------------------
def check_attention_batch(mesh, rank, ws):
    """Batch-sharded (unevenly: B = ws + 1) with a broadcast bool mask, key padding with a fully
    padded row, ALiBi, soft-capping, a window and sinks replicated: no collective."""
    from torch.distributed.tensor import Replicate, Shard
    B, N = ws + 1, 7
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[0] = True  # batch 0: every key padded, rows of zeros
    padding[-1, 5:] = True
    mask = torch.rand(1, 1, N, N) > 0.2
    inputs = _attention_inputs(B, 2, 2, N, N, 8, attn_mask=mask, key_padding_mask=padding,
                               alibi_slopes=torch.tensor([0.5, 0.25]), softcap=5.0, window_size=(4, 1),
                               sinks=torch.tensor([0.3, -0.2], requires_grad=True))
    s0, r = Shard(0), Replicate()
    _op_check(mesh, _sdpa, _sdpa_reference, inputs,
              dict(query=s0, key=s0, value=s0, attn_mask=r, key_padding_mask=s0, alibi_slopes=r, sinks=r),
              out_placements=[(s0,)])


def check_attention_heads_gqa(mesh, rank, ws):
    """Head-sharded grouped-query attention (2 query heads per key head) with a float mask of full
    shape that gets its gradient, per-batch ALiBi, sinks that get theirs, unequal lengths, a value
    width other than the head dim: no collective."""
    from torch.distributed.tensor import Shard
    B, H, Hk, Nq, Nk = 2, 2 * ws, ws, 5, 9
    inputs = _attention_inputs(B, H, Hk, Nq, Nk, 8, Dv=5, enable_gqa=True,
                               attn_mask=torch.randn(B, H, Nq, Nk, requires_grad=True),
                               alibi_slopes=torch.rand(B, H), sinks=torch.randn(H, requires_grad=True))
    s1 = Shard(1)
    _op_check(mesh, _sdpa, _sdpa_reference, inputs,
              dict(query=s1, key=s1, value=s1, attn_mask=s1, alibi_slopes=s1, sinks=Shard(0)),
              out_placements=[(s1,)])


def check_attention_heads_uneven(mesh, rank, ws):
    """As many query as key heads, not a multiple of the world size (uneven shards), causal, on
    batch 1 with D = 17, with a float mask broadcast over batch and heads that gets its gradient
    (a Partial sum over the heads' shards): no collective."""
    from torch.distributed.tensor import Replicate, Shard
    inputs = _attention_inputs(1, ws + 1, ws + 1, 6, 6, 17, is_causal=True,
                               attn_mask=torch.randn(1, 1, 6, 6, requires_grad=True))
    s1 = Shard(1)
    _op_check(mesh, _sdpa, _sdpa_reference, inputs, dict(query=s1, key=s1, value=s1, attn_mask=Replicate()),
              out_placements=[(s1,)])


def check_attention_heads_that_cannot_align(mesh, rank, ws):
    """Grouped-query heads sharded where key heads are not a multiple of the world size: the
    uneven shards would pair query heads with the wrong key heads, so the rules do not shard them
    and DTensor redistributes: right, with collectives."""
    from torch.distributed.tensor import Shard
    Hk = ws + 1 if ws > 2 else 3  # 3 key heads on 2 ranks, 5 on 4
    inputs = _attention_inputs(2, 2 * Hk, Hk, 4, 4, 8, enable_gqa=True)
    s1 = Shard(1)
    _op_check(mesh, _sdpa, _sdpa_reference, inputs, dict(query=s1, key=s1, value=s1), collectives=None)


def check_attention_dropout_replicates(mesh, rank, ws):
    """With dropout the rules replicate: given one torch seed on every rank, the DTensor call is the
    one-process call (same dropout pattern); the float64 reference is not drawn, so the result is
    checked against the one-process call only."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    s0 = Shard(0)
    inputs = _attention_inputs(2, 2, 2, 5, 5, 8)
    torch.manual_seed(7)
    out = tf.scaled_dot_product_attention(**inputs, dropout_p=0.4)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(inputs.values()), dout)
    placed = {k: distribute_tensor(v.detach(), mesh, [s0], src_data_rank=None).requires_grad_()
              for k, v in inputs.items()}
    torch.manual_seed(7)
    dout_d = tf.scaled_dot_product_attention(**placed, dropout_p=0.4)
    dgrads = torch.autograd.grad(dout_d, list(placed.values()), distribute_tensor(dout, mesh, dout_d.placements,
                                                                                   src_data_rank=None))
    full = dout_d.full_tensor()
    full_grads = [g.full_tensor() if isinstance(g, DTensor) else g for g in dgrads]
    assert not torch.allclose(out, tf.scaled_dot_product_attention(**inputs))  # dropout did drop
    torch.testing.assert_close(full, out)
    for g, ref in zip(full_grads, grads):
        torch.testing.assert_close(g, ref)


def check_varlen_heads(mesh, rank, ws):
    """Packed sequences of unequal lengths, head-sharded with grouped-query heads, causal (bottom
    right), sinks sharded on heads; then a paged cache; the index tensors replicated: no collective."""
    from torch.distributed.tensor import Replicate, Shard
    H, Hk = 2 * ws, ws
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 11], dtype=torch.int32)
    inputs = dict(query=torch.randn(9, H, 8, requires_grad=True), key=torch.randn(11, Hk, 8, requires_grad=True),
                  value=torch.randn(11, Hk, 8, requires_grad=True), cu_seq_q=cu_q, cu_seq_k=cu_k,
                  sinks=torch.randn(H, requires_grad=True))

    def ours(query, key, value, cu_seq_q, cu_seq_k, sinks):
        return tf.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, 5, 6, enable_gqa=True, window_size=(-1, 0),
                              sinks=sinks)

    def ref(query, key, value, cu_seq_q, cu_seq_k, sinks):
        return reference.varlen_attention(query, key, value, cu_seq_q, cu_seq_k, window_size=(-1, 0), sinks=sinks)

    s1, r = Shard(1), Replicate()
    _op_check(mesh, ours, ref, inputs, dict(query=s1, key=s1, value=s1, cu_seq_q=r, cu_seq_k=r, sinks=Shard(0)),
              out_placements=[(s1,)])

    # A paged cache (inference only): key/value pools (pages, page_size, Hk, D) sharded on their heads.
    paged = dict(query=torch.randn(5, H, 8), key=torch.randn(4, 4, Hk, 8), value=torch.randn(4, 4, Hk, 8),
                 cu_seq_q=torch.tensor([0, 3, 5], dtype=torch.int32), seqused_k=torch.tensor([5, 7], dtype=torch.int32),
                 block_table=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))

    def ours_paged(query, key, value, cu_seq_q, seqused_k, block_table):
        return tf.varlen_attn(query, key, value, cu_seq_q, None, 3, 8, enable_gqa=True, seqused_k=seqused_k,
                              block_table=block_table)

    def ref_paged(query, key, value, cu_seq_q, seqused_k, block_table):
        return reference.varlen_attention(query, key, value, cu_seq_q, None, seqused_k=seqused_k,
                                          block_table=block_table)

    _op_check(mesh, ours_paged, ref_paged, paged, dict(query=s1, key=Shard(2), value=Shard(2), cu_seq_q=r,
                                                       seqused_k=r, block_table=r), out_placements=[(s1,)])


def check_norms(mesh, rank, ws):
    """LayerNorm with a residual sharded on the sequence (uneven: ws + 1 positions), RMSNorm on the
    batch over 17 features; weight and bias replicated, their gradients Partial: no collective in
    forward or backward."""
    from torch.distributed.tensor import Replicate, Shard
    s1, r = Shard(1), Replicate()
    x = dict(input=torch.randn(2, ws + 1, 8, requires_grad=True),
             residual=torch.randn(2, ws + 1, 8, requires_grad=True),
             weight=torch.randn(8, requires_grad=True), bias=torch.randn(8, requires_grad=True))
    _op_check(mesh, lambda input, residual, weight, bias: tf.layer_norm(input, (8,), weight, bias, residual=residual),
              lambda input, residual, weight, bias: reference.layer_norm(input, (8,), weight, bias, residual=residual),
              x, dict(input=s1, residual=s1, weight=r, bias=r), out_placements=[(s1,), (s1,)])
    s0 = Shard(0)
    x = dict(input=torch.randn(ws + 1, 3, 17, requires_grad=True), weight=torch.randn(17, requires_grad=True))
    _op_check(mesh, lambda input, weight: tf.rms_norm(input, (17,), weight, 1e-6),
              lambda input, weight: reference.rms_norm(input, (17,), weight, 1e-6),
              x, dict(input=s0, weight=r), out_placements=[(s0,)])


def check_linear_attention(mesh, rank, ws):
    """Causal with a carried initial state and the final state out, batch-sharded; non-causal with
    key padding and unequal lengths, head-sharded: no collective."""
    from torch.distributed.tensor import Replicate, Shard
    B, H, N, D = ws + 1, 2, 6, 8

    def ours(query, key, value, S0, z0, **kw):
        out, state = tf.linear_attention(query, key, value, initial_state=tf.LinearAttentionState(S0, z0),
                                         output_final_state=True, **kw)
        return out, state.S, state.z

    def ref(query, key, value, S0, z0, **kw):
        out, (S, z) = reference.linear_attention(query, key, value, initial_state=(S0, z0), output_final_state=True,
                                                 **kw)
        return out, S, z

    inputs = _attention_inputs(B, H, H, N, N, D, S0=torch.rand(B, H, D, D, requires_grad=True),
                               z0=torch.rand(B, H, D, requires_grad=True), is_causal=True)
    s0 = Shard(0)
    _op_check(mesh, ours, ref, inputs, dict(query=s0, key=s0, value=s0, S0=s0, z0=s0), out_placements=[(s0,)] * 3)

    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True
    inputs = _attention_inputs(2, ws + 1, ws + 1, 5, 9, D, key_padding_mask=padding)
    s1 = Shard(1)
    _op_check(mesh, lambda **kw: tf.linear_attention(**kw), lambda **kw: reference.linear_attention(**kw), inputs,
              dict(query=s1, key=s1, value=s1, key_padding_mask=Replicate()), out_placements=[(s1,)])


def check_flags_that_change_the_outputs(mesh, rank, ws):
    """Calls that differ only in a flag changing an op's outputs, on the same placements: RMSNorm
    after LayerNorm (is_rms: no mean), a float mask with a gradient after one without
    (compute_dmask), the final linear-attention state after none (output_final_state). DTensor
    caches a rule's result per call; each flag must be part of the key."""
    from torch.distributed.tensor import Replicate, Shard
    s0, r = Shard(0), Replicate()
    x = dict(input=torch.randn(ws, 3, 8, requires_grad=True), weight=torch.randn(8, requires_grad=True))
    for ours, ref in ((tf.layer_norm, reference.layer_norm), (tf.rms_norm, reference.rms_norm)):
        _op_check(mesh, lambda input, weight: ours(input, (8,), weight, eps=1e-5),
                  lambda input, weight: ref(input, (8,), weight, eps=1e-5), x, dict(input=s0, weight=r))
    for mask_grad in (False, True):
        inputs = _attention_inputs(ws, 2, 2, 3, 4, 8, attn_mask=torch.randn(ws, 2, 3, 4, requires_grad=mask_grad))
        _op_check(mesh, _sdpa, _sdpa_reference, inputs, dict(query=s0, key=s0, value=s0, attn_mask=s0))
    for final in (False, True):
        def ours(**kw):
            return tf.linear_attention(**kw, is_causal=True, output_final_state=final)

        def ref(**kw):
            return reference.linear_attention(**kw, is_causal=True, output_final_state=final)

        _op_check(mesh, ours, ref, _attention_inputs(ws, 2, 2, 4, 4, 8), dict(query=s0, key=s0, value=s0),
                  out_placements=[(s0,)] * (3 if final else 1))


def check_two_dim_mesh(mesh, rank, ws):
    """A (2, 2) mesh, batch on its first dim and heads (grouped-query, 8 over 4) or sequence on its
    second: attention and LayerNorm with no collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    mesh = init_device_mesh("cpu", (2, 2))
    batch_heads = (Shard(0), Shard(1))
    inputs = _attention_inputs(2, 8, 4, 5, 5, 8, enable_gqa=True, is_causal=True)
    _op_check(mesh, _sdpa, _sdpa_reference, inputs, dict(query=batch_heads, key=batch_heads, value=batch_heads),
              out_placements=[batch_heads])
    x = dict(input=torch.randn(2, 5, 8, requires_grad=True), weight=torch.randn(8, requires_grad=True))
    _op_check(mesh, lambda input, weight: tf.layer_norm(input, (8,), weight),
              lambda input, weight: reference.layer_norm(input, (8,), weight), x,
              dict(input=batch_heads, weight=(Replicate(), Replicate())), out_placements=[batch_heads])


OP_CHECKS = [check_flags_that_change_the_outputs, check_attention_batch, check_attention_heads_gqa,
             check_attention_heads_uneven, check_attention_heads_that_cannot_align,
             check_attention_dropout_replicates, check_varlen_heads, check_norms, check_linear_attention]


# --------------------------------------------------------------------------------------------
# Models (world size 2)
# --------------------------------------------------------------------------------------------
def _llama_config(**kw):
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      **kw)
    config._attn_implementation = "transformer_fast"
    return config


def _counting_attention_calls():
    """Records, per call of the Hugging Face integration's attention, whether it got DTensors."""
    from torch.distributed.tensor import DTensor
    import transformer_fast.integrations.huggingface as tf_hf
    tf_hf.register()
    calls, original = [], tf_hf.scaled_dot_product_attention

    def counting(query, *args, **kwargs):
        calls.append(isinstance(query, DTensor))
        return original(query, *args, **kwargs)

    tf_hf.scaled_dot_product_attention = counting
    return calls


def check_tensor_parallel_llama_block(mesh, rank, ws):
    """A Llama decoder layer (grouped-query attention, our RMSNorm through convert) parallelised
    with ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down and SequenceParallel norms equals
    the one-process layer: output and every parameter's gradient. q/k/v once keep DTensor outputs
    (the attention kernels run through the sharding rules on heads), once local ones (the kernels
    see each rank's heads as plain tensors). The forward's collectives are the plan's own: two
    all-gathers (sequence to replicated before attention and MLP) and two reduce-scatters (after
    o and down); the norms and attention add none."""
    import copy

    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    calls = _counting_attention_calls()
    config = _llama_config()
    x = torch.randn(2, 6, 32)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(6)[None].expand(2, -1))
    layer, report = tf.convert(LlamaDecoderLayer(config, 0), return_report=True)
    assert [r.name for r in report] == ["input_layernorm", "post_attention_layernorm"], report
    one = copy.deepcopy(layer)
    y_one = one(x, position_embeddings=(cos, sin))
    w = torch.randn_like(y_one)
    (y_one * w).sum().backward()
    results = []
    for local_output in (False, True):
        qkv = ColwiseParallel(use_local_output=local_output)
        plan = {"input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "self_attn.q_proj": qkv, "self_attn.k_proj": qkv, "self_attn.v_proj": qkv,
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
        tp = parallelize_module(copy.deepcopy(layer), mesh, plan)
        rope = (cos, sin) if local_output else tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                                                      for t in (cos, sin))
        del calls[:]
        with _collective_counter() as comm:
            y = tp(DTensor.from_local(x.chunk(ws, 1)[rank], mesh, [Shard(1)], run_check=False),
                   position_embeddings=rope)
        counts = dict(comm.counts)
        y_full = y.full_tensor()
        (y_full * w).sum().backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in tp.named_parameters()}
        results.append((local_output, list(calls), counts, y_full, grads))
    for local_output, attention_calls, counts, y_full, grads in results:
        assert attention_calls == [not local_output], attention_calls
        assert counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, counts
        torch.testing.assert_close(y_full, y_one)
        for name, p in one.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name} (local_output={local_output}): {m}")


def _collective_counter():
    """Counts the collectives dispatched while it is active (c10d functional ops, which DTensor's
    redistributions and the parallel styles issue). The TP check counts with this, not
    CommDebugMode: CommDebugMode's module tracker raises IndexError on the modules transformers
    wraps its rotary function in (kernels' hub layers)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (func.namespace in ("_c10d_functional", "c10d_functional", "c10d")
                    and func._opname != "wait_tensor" and not func._opname.startswith("_")):  # not helpers
                self.counts[func._opname] += 1
            return func(*args, **(kwargs or {}))

    return Collectives()


def _encoder():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True)
    return tf.convert(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


def _train(model, batches, loss_fn, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for batch in batches[:steps]:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


def _models():
    """(name, model built on seed 0, its blocks for fully_shard, the global batches, the loss): a
    converted nn.TransformerEncoder and a tiny Llama (our attention and RMSNorm)."""
    import transformers
    torch.manual_seed(0)
    encoder = _encoder()
    enc_batches = [torch.randn(4, 5, 16) for _ in range(3)]
    llama = tf.convert(transformers.LlamaForCausalLM(_llama_config()))
    ids = [torch.randint(0, 64, (4, 7)) for _ in range(3)]
    return [("encoder", encoder, list(encoder.layers), enc_batches, lambda m, x: m(x).square().mean()),
            ("llama", llama, list(llama.model.layers), ids, lambda m, x: m(input_ids=x, labels=x).loss)]


def check_ddp_and_fsdp2_training(mesh, rank, ws):
    """Three SGD steps on each model: DDP on each rank's half of the batch equals one process on the
    whole batch, and FSDP2 (fully_shard per block and at the root) equals DDP: the parameters
    after the steps."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    results = []
    for name, model, _, batches, loss_fn in _models():
        one = copy.deepcopy(model)
        _train(one, batches, loss_fn)
        local = [b.chunk(ws)[rank] for b in batches]
        ddp = DistributedDataParallel(copy.deepcopy(model))
        _train(ddp, local, loss_fn)
        fsdp = copy.deepcopy(model)
        blocks = fsdp.layers if name == "encoder" else fsdp.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)
        _train(fsdp, local, loss_fn)
        fsdp_params = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
        results.append((name, model, one, ddp.module, fsdp_params))
    for name, initial, one, ddp, fsdp_params in results:
        assert not all(torch.equal(p, p0) for p, p0 in zip(one.parameters(), initial.parameters())), name
        for (n, p_one), p_ddp in zip(one.named_parameters(), ddp.parameters()):
            torch.testing.assert_close(p_ddp, p_one, msg=lambda m: f"{name} {n}: DDP vs one process: {m}")
            torch.testing.assert_close(fsdp_params[n], p_ddp, msg=lambda m: f"{name} {n}: FSDP2 vs DDP: {m}")


MODEL_CHECKS = [check_tensor_parallel_llama_block, check_ddp_and_fsdp2_training]
_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CHECKS = {2: OP_CHECKS + (MODEL_CHECKS if _HAS_TRANSFORMERS else []), 4: OP_CHECKS + [check_two_dim_mesh]}


def _run_checks(rank, world_size, group, names):
    """A rank's part: every named check, each from the same seed; None or the traceback per check."""
    from torch.distributed.device_mesh import init_device_mesh

    import transformer_fast.distributed.sharding  # noqa: F401 - the rules (registered when DTensor loads)
    mesh = init_device_mesh("cpu", (world_size,))
    checks = {check.__name__: check for check in CHECKS[world_size]}
    results = {}
    for name in names:
        torch.manual_seed(0)
        try:
            checks[name](mesh, rank, world_size)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported by the check's test
            results[name] = traceback.format_exc()
    return results


_spawned = {}


def _check_result(world_size, check):
    """The check's outcome on every rank of the world size's one spawn (run at its first test)."""
    if world_size not in _spawned:
        names = [c.__name__ for c in CHECKS[world_size]]
        try:
            _spawned[world_size] = run_ranks(_run_checks, world_size, (names,), timeout=60.0)
        except AssertionError as exc:
            _spawned[world_size] = exc
    outcome = _spawned[world_size]
    if isinstance(outcome, AssertionError):
        raise AssertionError(f"the world-size-{world_size} spawn failed:\n{outcome}")
    failures = [f"rank {rank}:\n{results[check.__name__]}" for rank, results in enumerate(outcome)
                if results[check.__name__] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", OP_CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_op_on_dtensors(world_size, check):
    _check_result(world_size, check)


def test_two_dim_mesh_on_four_ranks():
    _check_result(4, check_two_dim_mesh)


@pytest.mark.parametrize("check", MODEL_CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_model_on_two_ranks(check):
    pytest.importorskip("transformers")
    _check_result(2, check)


def test_rules_register_when_dtensor_loads():
    """import transformer_fast leaves torch.distributed.tensor unimported (its import costs more
    than the package's own); importing it registers the rules."""
    code = ("import sys, torch, transformer_fast\n"
            "from transformer_fast.distributed import sharding\n"
            "assert 'torch.distributed.tensor' not in sys.modules and not sharding._registered\n"
            "from torch.distributed.tensor import DTensor\n"
            "assert sharding._registered\n"
            "op = torch.ops.transformer_fast.layer_norm_forward.default\n"
            "assert op in DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
