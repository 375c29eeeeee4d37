"""``context_parallel``: the public attention functions on sequence shards.

    ids_local = shard_sequence(ids, group, dim=1)              # each rank: its shard of every sequence
    with context_parallel(group, mode="ring"):
        logits_local = model(ids_local, position_ids=shard_positions(n, group)[None])

Inside the block, in the thread that entered it, the public functions take the local shards and
run their context-parallel forms, so that whatever calls them - ``MultiheadAttention``, the
encoder and decoder layers, the Hugging Face ``attn_implementation="transformer_fast"`` - attends
over the whole sequence:

* ``scaled_dot_product_attention``: shards as ``shard_sequence(x, group, dim=2, layout)`` makes
  them -> ``context_parallel_attention`` in the block's ``mode``;
* ``varlen_attn``: rows as ``shard_packed`` makes them, with the whole batch's ``cu_seq_q``/
  ``cu_seq_k``/``max_q``/``max_k`` -> ``context_parallel_varlen_attn`` (keys all-gathered; the
  window (left, 0) is causal);
* ``linear_attention``: shards as for softmax attention -> ``context_parallel_linear_attention``
  (state passing; a ``key_padding_mask`` shard is served there).

What the context-parallel forms cannot serve raises ValueError instead of a shard-local answer:
softmax attention's ``attn_mask`` and ``key_padding_mask`` (masks are built for the local lengths;
the causal structure and windows are global and are passed as ``is_causal``/``window_size``),
fewer queries than keys (decoding against a cache, cross-attention), ``varlen_attn``'s key cache
(``seqused_k``, ``block_table``), ``linear_attention_step``, and a ``backend`` other than "auto".

Why the routing costs nothing outside a block: each public function reads one module-level
variable (``_context_parallel`` in ``transformer_fast.attention`` and
``transformer_fast.linear_attention``), None unless some thread is inside a block; it is then this
module, whose functions look up the calling thread's setting (a ``threading.local`` stack, so
blocks nest, one object may be entered again, and other threads - the autograd engine's device
threads included - are not routed) and answer NotImplemented where the thread has none. While a
context-parallel form runs, routing is off in its thread.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from typing import NamedTuple

import torch

MODES = ("ring", "all_gather", "ulysses")

_local = threading.local()  # .stack: [Setting or None (routing off), ...], innermost last
_lock = threading.Lock()
_open_blocks = 0  # blocks open in all threads together


class Setting(NamedTuple):
    """What a ``context_parallel`` block routes to: the process group (None: the default one),
    the softmax attention mode and the shard layout."""
    group: object
    mode: str
    layout: str


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def active():
    """The calling thread's innermost ``context_parallel`` setting, or None outside every block
    (and while a context-parallel form runs)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _set_routing(on):
    # By module name: the package's attribute `linear_attention` is the function, not the module.
    router = sys.modules[__name__] if on else None
    for name in ("transformer_fast.attention", "transformer_fast.linear_attention"):
        importlib.import_module(name)._context_parallel = router


@contextlib.contextmanager
def _routing_off():
    stack = _stack()
    stack.append(None)
    try:
        yield
    finally:
        stack.pop()


def _layouts():
    from . import sequence
    return getattr(sequence, "LAYOUTS", ("head_tail", "contiguous"))


class context_parallel(contextlib.ContextDecorator):  # noqa: N801 - used like a function, as torch's context managers
    """Routes the public attention functions to their context-parallel forms over ``group`` (None:
    the default process group) while the block runs, in the thread that entered it.

    ``mode`` chooses how softmax attention sees every key: "ring" (key/value shards passed around
    the ring, the partial results merged by their log-sum-exp), "all_gather" (every rank gathers
    the whole key/value sequence), "ulysses" (all-to-all from sequence shards to head shards and
    back). ``layout`` must be the one ``shard_sequence`` sharded with ("head_tail" balances causal
    work). Re-entrant: blocks nest (the innermost setting counts) and one object may be entered
    again; the previous routing is restored on exit, exceptions included. Usable as a decorator.
    """

    def __init__(self, group=None, *, mode="ring", layout="head_tail"):
        if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (the default group), got "
                            f"{type(group).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        layouts = _layouts()
        if layout not in layouts:
            raise ValueError(f"layout must be one of {', '.join(map(repr, layouts))}, got {layout!r}")
        self.setting = Setting(group, mode, layout)

    def __enter__(self):
        global _open_blocks
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("context_parallel needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        _stack().append(self.setting)
        with _lock:
            _open_blocks += 1
            if _open_blocks == 1:
                _set_routing(True)
        return self

    def __exit__(self, *exc):
        global _open_blocks
        _stack().pop()
        with _lock:
            _open_blocks -= 1
            if _open_blocks == 0:
                _set_routing(False)
        return False

    def __repr__(self):
        group, mode, layout = self.setting
        return f"context_parallel(group={group!r}, mode={mode!r}, layout={layout!r})"


# ------------------------------------------------------------------------------------------------
# The routed calls (the public functions call these while a block is open in some thread)
# ------------------------------------------------------------------------------------------------
def _refuse(function, what, why):
    raise ValueError(f"{function} under context_parallel does not take {what}: {why}")


def _check_lengths(function, query, key):
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2 and key.dim() >= 2 \
            and query.shape[-2] != key.shape[-2]:
        _refuse(function, f"{query.shape[-2]} local queries against {key.shape[-2]} local keys",
                "the context-parallel forms attend one sequence sharded alike in query, key and value "
                "(decoding against a cache, or cross-attention, runs outside the block)")


def scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 key_padding_mask, window_size, softcap, alibi_slopes, sinks, backend):
    setting = active()
    if setting is None:
        return NotImplemented
    name = "scaled_dot_product_attention"
    if attn_mask is not None:
        _refuse(name, "an attn_mask", "a mask is built for the local lengths, but each rank's queries attend keys "
                "of the whole sequence; pass is_causal=True or window_size for causal or local attention")
    if key_padding_mask is not None:
        _refuse(name, "a key_padding_mask", "padding is not served on sequence shards; pack the sequences "
                "without padding")
    _check_lengths(name, query, key)
    if backend != "auto":
        _refuse(name, f"backend={backend!r}", "the context-parallel forms choose the local kernels themselves")
    from .attention import context_parallel_attention
    unbatched = isinstance(query, torch.Tensor) and query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    with _routing_off():
        out = context_parallel_attention(query, key, value, setting.group, mode=setting.mode, layout=setting.layout,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         sinks=sinks, dropout_p=dropout_p)
    return out[0] if unbatched else out


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale, window_size, enable_gqa,
                seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, dropout_p, backend):
    setting = active()
    if setting is None:
        return NotImplemented
    name = "varlen_attn"
    if seqused_k is not None or block_table is not None:
        _refuse(name, "seqused_k or block_table", "a key cache is a decoding path; it runs outside the block")
    if backend != "auto":
        _refuse(name, f"backend={backend!r}", "the context-parallel forms choose the local kernels themselves")
    # varlen_attn's window (left, right) is bottom-right aligned: right == 0 is causal (within left keys).
    left, right = window_size if isinstance(window_size, (tuple, list)) and len(window_size) == 2 else (None, None)
    is_causal = right == 0
    window = None if (left, right) in ((-1, -1), (-1, 0)) else window_size
    from .varlen import context_parallel_varlen_attn
    return_lse = return_aux is not None and bool(getattr(return_aux, "lse", False))
    with _routing_off():
        result = context_parallel_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, setting.group,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                              window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                              sinks=sinks, dropout_p=dropout_p, return_lse=return_lse)
    return result


def linear_attention(query, key, value, is_causal, key_padding_mask, eps, initial_state, output_final_state,
                     backend):
    setting = active()
    if setting is None:
        return NotImplemented
    name = "linear_attention"
    if backend != "auto":
        _refuse(name, f"backend={backend!r}", "the context-parallel form chooses the local kernels itself")
    _check_lengths(name, query, key)
    from .linear_attention import context_parallel_linear_attention
    with _routing_off():
        return context_parallel_linear_attention(query, key, value, setting.group, layout=setting.layout,
                                                 is_causal=is_causal, eps=eps, initial_state=initial_state,
                                                 output_final_state=output_final_state,
                                                 key_padding_mask=key_padding_mask)


def linear_attention_step():
    """Raises where the calling thread is inside a block: a decoding step has one token, not a shard."""
    if active() is not None:
        raise ValueError("linear_attention_step under context_parallel: a decoding step advances one token's "
                         "state, which is not sharded over a sequence; run it outside the block (the final "
                         "state of a context-parallel prefill, output_final_state=True, is the whole sequence's)")


def refuse_unrouted(what, why):
    """Raises where the calling thread is inside a block: for callers whose computation does not go
    through the routed functions and would attend over the shard alone."""
    if active() is not None:
        raise ValueError(f"{what} under context_parallel: {why}")
