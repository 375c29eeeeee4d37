"""Hugging Face ``transformers`` integration: ``attn_implementation="transformer_fast"``.

    import transformer_fast.integrations.huggingface as tf_hf
    tf_hf.register()
    model = AutoModel.from_config(config, attn_implementation="transformer_fast")

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and, where the
installed transformers has one (>= 4.53), ``build_attention_mask`` to its ``AttentionMaskInterface``
under the same name. transformers is imported only by this module, never by ``import transformer_fast``.

Supported: everything the ``sdpa`` implementation does with plain masks (padding, causal,
bidirectional, grouped-query attention, a float ``position_bias`` as in T5), dropout in training;
sliding windows (Mistral, Qwen2, Gemma 2/3, Cohere 2, gpt-oss), logit soft-capping (``softcap``:
Gemma 2, T5Gemma), attention sinks (``s_aux``, one logit per head: gpt-oss), and packed
("padding-free") sequences, as transformers' ``DataCollatorWithFlattening`` produces them:
``position_ids`` that restart inside a row, which transformers turns into a block-diagonal mask
only without a cache (``use_cache=False``) and without an ``attention_mask`` (else the attention
spans the sequences, as on "sdpa" and "eager", and a warning says so); or ``cu_seq_lens_q``/
``cu_seq_lens_k`` with ``max_length_q``/``max_length_k`` (``return_flash_attn_kwargs=True``),
honoured as transformers' flash-attention path honours them, provided the mask is their
block-diagonal mask or plain causal (ValueError otherwise).
Not supported: ``output_attentions=True`` (there are no weights; None is returned with a warning,
as ``sdpa`` does), paged caches, and any keyword argument whose meaning the kernels do not implement (sparse
attention ``indices``/``block_indices``, per-token ``sinks``): ``attention_forward`` raises
ValueError for those rather than ignoring them.

How masks are built. ``build_attention_mask`` returns what transformers' ``sdpa_mask`` returns
(4-D bool, True = attend, or None where ``is_causal`` alone describes the mask), so the masks are
exact whatever the model does with them, except that:
  * a bidirectional mask with padding and no other pattern is the padding row as a stride-0 view
    of shape (B, 1, Nq, Nk) (O(N) memory; ``attention_forward`` passes it to the kernels as their
    ``key_padding_mask``, which also skips the padded key tiles);
  * a causal or sliding-window mask (causal, or bidirectional within a window) whose last query is at
    its last key (``q_offset + q_length == kv_offset + kv_length``: dynamic caches; not static ones)
    is sdpa's mask tagged with the matching ``window_size`` of the kernels (bottom-right aligned),
    which ``attention_forward`` passes in addition to the mask so that the kernels skip the key
    tiles outside the window (O(N * window) work). The mask alone stays exact: a model that
    slices or copies it only loses the tag;
  * a causal mask that is block-diagonal over packed sequences (verified element by element
    against the sequences read off the mask) is tagged with their cumulative lengths, and
    ``attention_forward`` runs ``varlen_attn`` on the packed tokens;
  * for a family whose models do not support ``sdpa`` (they are served because they support
    ``flex_attention``, whose masks come from the same mask functions) a mask is never left out:
    flex attention never reads a module's ``is_causal``, so it is not trusted to tell a causal
    mask from a bidirectional one (PEGASUS-X's decoder declares ``is_causal=False``). A causal mask
    is materialised, a bidirectional one without padding is an all-True stride-0 view;
  * a causal mask is never left out when there are more keys than queries (static-cache prefill),
    so that a None mask with fewer queries than keys always means causal aligned to the bottom
    right (a model that keeps only its last queries, as Gemma 4's KV-shared layers do).

Served are the models that support ``sdpa`` or ``flex_attention`` through ``AttentionInterface``
(``supports_model``): any other model would run its own attention code on the masks built for this
implementation (bool masks, or None for "causal"), which it misreads (BLOOM, XGLM lose the causal
mask; ConvBERT, MPNet ignore padding), or rely on masks or options neither has. Models that fold
extra masks in only for "eager" and "sdpa" and pass sparse indices to any other implementation
(DeepSeek V3.2's indexer) are refused too. ``register()`` makes building a refused model with this
implementation (``from_config``, ``from_pretrained``, the constructor, ``set_attn_implementation``)
raise a ValueError that names the model class and the implementation to use instead.
docs/huggingface_families.md lists every family transformers ships and its status.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
import warnings

import torch

from .. import attention as _attention_module  # its _context_parallel: set while a context_parallel block is open
from ..attention import scaled_dot_product_attention, varlen_attn
from .huggingface_masks import (_PACKED_TAG, _WINDOW_TAG, _matches_packed, _supports, _tracing,  # noqa: F401
                                build_attention_mask)

NAME = "transformer_fast"

# Keyword arguments transformers' models pass to attention functions whose meaning is either
# implemented by attention_forward's own parameters or carried by the mask, or that do not concern
# attention (flags and values meant for other layers or other implementations).
_HARMLESS_KWARGS = frozenset({
    "position_ids",  # packing is read from the mask, which transformers builds from them
    "seq_idx",  # the same for state-space layers
    "output_attentions", "output_hidden_states", "output_router_logits", "use_cache", "return_dict",
    "num_items_in_batch", "cache_position", "layer_idx", "past_key_values", "past_key_value", "cache",
    "deterministic", "kernel_options", "use_top_left_mask", "target_dtype", "implementation",
    "attn_implementation",
})
# Keyword arguments with a meaning the kernels do not implement (a value other than None raises).
_UNSUPPORTED_KWARGS = {
    "indices": "sparse attention over indexer-selected keys",
    "block_indices": "block-sparse attention over indexer-selected key blocks",
    "sinks": "attention sinks given per token",
    "head_mask": "a per-head mask of the attention weights",
    "block_table": "paged key/value caches",
    "k_cache": "paged key/value caches",
    "v_cache": "paged key/value caches",
}


# ------------------------------------------------------------------------------------------------
# Which models are served
# ------------------------------------------------------------------------------------------------
def supports_model(model) -> bool:
    """Whether ``model`` (a transformers ``PreTrainedModel`` or its class) can run on this
    implementation, as transformers tells: the model supports ``sdpa`` (``_supports_sdpa``), whose
    masks (``sdpa_mask``: bool, or None where ``is_causal`` alone describes them) and reading of
    ``is_causal`` this implementation shares, or ``flex_attention`` (``_supports_flex_attn``), whose
    masks come from the same mask functions and whose soft-capping and sinks it implements; and its
    attention goes through ``AttentionInterface`` (its module dispatches through
    ``ALL_ATTENTION_FUNCTIONS``, the check behind transformers' ``set_attn_implementation``, picks no
    attention classes by implementation name, and does not build its masks differently for
    implementations other than "eager" and "sdpa")."""
    cls = model if isinstance(model, type) else type(model)
    if not (_supports(cls, "sdpa") or _supports(cls, "flex_attn")):
        return False
    if _picks_attention_classes_by_name(cls) or _masks_only_for_eager_and_sdpa(cls):
        return False
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    return bool(can_set()) if can_set is not None else getattr(cls, "_supports_attention_backend", False) is True


@functools.lru_cache(maxsize=None)
def _module_source(module_name):
    try:
        return inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return ""


def _picks_attention_classes_by_name(cls) -> bool:
    """Whether the module defining ``cls`` picks attention classes from a table keyed by the
    implementation name (``SAM_VISION_ATTENTION_CLASSES[config._attn_implementation]``), which
    knows only transformers' own implementations, though the module may also use the interface."""
    return re.search(r"_ATTENTION_CLASSES\s*\[", _module_source(cls.__module__)) is not None


_EAGER_AND_SDPA_ONLY = re.compile(
    r"_attn_implementation\s+in\s+[(\[]\s*(['\"])(eager|sdpa)\1\s*,\s*(['\"])(eager|sdpa)\3\s*[)\]]")


def _masks_only_for_eager_and_sdpa(cls) -> bool:
    """Whether ``cls`` uses, directly or through the classes of its module it names (its layers,
    their attention), a class that folds a mask into the attention mask only for "eager" and
    "sdpa" (``if self.config._attn_implementation in ("eager", "sdpa"):``) and hands any other
    implementation something else (DeepSeek V3.2, GLM-MoE-DSA, MiniMax-M3: the indexer's top-k
    selection as ``indices``/``block_indices``, which the kernels do not implement)."""
    return cls.__name__ in _classes_reaching_eager_and_sdpa_only(cls.__module__)


@functools.lru_cache(maxsize=None)
def _classes_reaching_eager_and_sdpa_only(module_name):
    """The names of the classes of ``module_name`` whose bodies (not their bases) contain that
    branch or name, transitively, a class of the module that does."""
    source = _module_source(module_name)
    if not _EAGER_AND_SDPA_ONLY.search(source):
        return frozenset()
    import ast
    try:
        tree = ast.parse(source)
    except SyntaxError:  # pragma: no cover - a module that imported parses
        return frozenset()
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    uses, reaching = {}, set()
    for name, node in classes.items():
        body = [ast.get_source_segment(source, statement) or "" for statement in node.body]
        if any(_EAGER_AND_SDPA_ONLY.search(text) for text in body):
            reaching.add(name)
        uses[name] = {n.id for statement in node.body for n in ast.walk(statement)
                      if isinstance(n, ast.Name) and n.id in classes and n.id != name}
    changed = True
    while changed:
        changed = False
        for name, used in uses.items():
            if name not in reaching and used & reaching:
                reaching.add(name)
                changed = True
    return frozenset(reaching)


def unsupported_model_message(model, name: str = NAME) -> str:
    cls = model if isinstance(model, type) else type(model)
    if not (_supports(cls, "sdpa") or _supports(cls, "flex_attn")):
        why = (f"the model supports neither 'sdpa' nor 'flex_attention', and {name!r} builds its masks from the same "
               f"mask functions and reads them as those do")
        instead = "eager"
    elif _masks_only_for_eager_and_sdpa(cls):
        why = (f"its attention folds the indexer's selection into the mask only for 'eager' and 'sdpa' and passes "
               f"{name!r} sparse indices instead, which it does not implement")
        instead = "sdpa" if _supports(cls, "sdpa") else "eager"
    else:
        why = (f"its attention does not go through transformers' AttentionInterface (it would run its own attention "
               f"code on masks built for {name!r} and misread them)")
        instead = "sdpa" if _supports(cls, "sdpa") else "eager"
    return f"{cls.__name__} does not support attn_implementation={name!r}: {why}. Use attn_implementation={instead!r}."


def _refusing_unsupported_models(choose, names):
    """Wraps transformers' method that settles a model's attention implementation (called by
    ``PreTrainedModel.__init__`` and ``set_attn_implementation``) so that it raises for a model
    ``supports_model`` rejects when the implementation settled on is one of ``names``."""
    @functools.wraps(choose)
    def checked(self, *args, **kwargs):
        implementation = choose(self, *args, **kwargs)
        if implementation in names and not supports_model(self):
            raise ValueError(unsupported_model_message(self, implementation))
        return implementation

    checked._transformer_fast_names = names
    return checked


def _install_construction_check(name):
    from transformers import PreTrainedModel
    # Recent transformers settle the implementation in get_correct_attn_implementation (also called
    # for each sub-model by set_attn_implementation); older ones in _check_and_adjust_attn_implementation.
    for method in ("get_correct_attn_implementation", "_check_and_adjust_attn_implementation"):
        choose = PreTrainedModel.__dict__.get(method)
        if not inspect.isfunction(choose):  # absent, or not a plain method in this version
            continue
        names = getattr(choose, "_transformer_fast_names", None)
        if names is None:
            names = set()
            setattr(PreTrainedModel, method, _refusing_unsupported_models(choose, names))
        names.add(name)
        return True
    return False


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
def _position_bias_mask(position_bias, attention_mask, is_causal, q_len, k_len):
    """The float mask ``position_bias`` combined with ``attention_mask`` or the causal mask (what
    transformers' sdpa path does for T5-style biases)."""
    if attention_mask is None:
        if not is_causal:
            return position_bias
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=position_bias.device).tril()
        return position_bias.masked_fill(~causal, torch.finfo(position_bias.dtype).min)
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, torch.finfo(position_bias.dtype).min)
    return position_bias + attention_mask


def _refuse(module, what, why):
    raise ValueError(f"{type(module).__name__}: attn_implementation={NAME!r} does not support {what} ({why}); "
                     f"use attn_implementation='eager'")


def _check_kwargs(module, kwargs):
    for name, value in kwargs.items():
        if value is None or name in _HARMLESS_KWARGS:
            continue
        if name in _UNSUPPORTED_KWARGS:
            _refuse(module, name, _UNSUPPORTED_KWARGS[name])
        _refuse(module, f"the keyword argument {name!r}", "a meaning this implementation does not know")


def _sinks(module, s_aux, heads):
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.dim() != 1 or s_aux.shape[0] != heads:
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        _refuse(module, f"s_aux of shape {shape}", f"attention sinks are one logit per query head, ({heads},)")
    return s_aux


def _softcap(module, softcap):
    if softcap is None:
        return None
    softcap = float(softcap)
    if not softcap > 0:
        _refuse(module, f"softcap={softcap}", "soft-capping needs a positive cap")
    return softcap


def _varlen(query, key, value, cu_q, cu_k, max_q, max_k, window, scaling, dropout, softcap, sinks):
    """varlen_attn on the packed tokens of (B, H, N, D) inputs (the batch rows one after another);
    returns (B, Nq, H, Dv), transformers' layout."""
    b, h, nq, d = query.shape
    nk, hk = key.shape[2], key.shape[1]
    q = query.transpose(1, 2).reshape(b * nq, h, d)
    k = key.transpose(1, 2).reshape(b * nk, hk, key.shape[-1])
    v = value.transpose(1, 2).reshape(b * nk, hk, value.shape[-1])
    out = varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale=scaling, window_size=window,
                      enable_gqa=hk != h, softcap=softcap, sinks=sinks, dropout_p=float(dropout))
    return out.view(b, nq, h, value.shape[-1])


def _kwargs_packing(module, query, key, attention_mask, is_causal, sliding_window, cu_q, cu_k, max_q, max_k):
    """(cu_q, cu_k, max_q, max_k, window) for ``cu_seq_lens_q``/``cu_seq_lens_k`` given as keyword
    arguments (transformers' padding-free training, as its flash-attention path reads them), after
    checking them against the inputs and the mask; ValueError where they disagree."""
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        _refuse(module, "cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k given in part",
                "packed sequences need all four")
    b, _, nq, _ = query.shape
    nk = key.shape[2]
    cu_q = cu_q.to(device=query.device, dtype=torch.int32)
    cu_k = cu_k.to(device=query.device, dtype=torch.int32)
    if cu_q.dim() != 1 or cu_k.shape != cu_q.shape or int(cu_q[-1]) != b * nq or int(cu_k[-1]) != b * nk:
        _refuse(module, f"cu_seq_lens_q/cu_seq_lens_k ending at {int(cu_q[-1])}/{int(cu_k[-1])}",
                f"they must cover the {b * nq} query and {b * nk} key tokens of the batch")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if is_causal:
        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    elif sliding_window:
        _refuse(module, "a sliding window in bidirectional attention over cu_seq_lens_q/cu_seq_lens_k",
                "transformers' masks and its flash-attention path disagree on its width")
    else:
        window = (-1, -1)
    if attention_mask is not None:
        packed = getattr(attention_mask, _PACKED_TAG, None)
        same = packed is not None and packed[2] == window and torch.equal(packed[0], cu_q) and torch.equal(cu_q, cu_k)
        if not same and not _mask_agrees_with_packing(attention_mask, cu_q, cu_k, window, b, nq, nk):
            _refuse(module, "cu_seq_lens_q/cu_seq_lens_k together with an attention mask that is neither their "
                    "block-diagonal mask nor plain causal", "one of the two would be ignored; pass no "
                    "attention_mask, or no cu_seq_lens")
    return cu_q, cu_k, max_q, max_k, window


def _mask_agrees_with_packing(mask, cu_q, cu_k, window, b, nq, nk):
    """Whether the bool mask (B, 1, N, N) is the causal pattern (within ``window``) of the packed
    sequences of ``cu_q``, or of whole rows (what transformers builds from position ids with a cache:
    it then adds nothing to the sequences); remembered on the mask for the other layers."""
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[-2:] == (nq, nk) and nq == nk and torch.equal(cu_q, cu_k) and window[1] == 0):
        return False
    key = (tuple(cu_q.tolist()), window)
    checked = getattr(mask, "_transformer_fast_checked", None)
    if checked is not None and checked[0] == key:
        return checked[1]
    mask = mask.expand(b, 1, nq, nk)
    token = torch.arange(b * nq, device=mask.device)
    seq = (torch.searchsorted(cu_q.long(), token, right=True) - 1).view(b, nq)
    agrees = _matches_packed(mask, seq, window) or _matches_packed(mask, torch.zeros_like(seq), window)
    if not _tracing(mask):
        setattr(mask, "_transformer_fast_checked", (key, agrees))
    return agrees


def _warn_if_unmasked_packing(position_ids):
    """Warns where position ids restart inside the row but transformers built no mask for packed
    sequences (it reads packing from position ids only without a cache and without an
    ``attention_mask``): the attention then spans the sequences, as on "sdpa" and "eager" (its
    flash-attention path would separate them)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1 \
            or _tracing(position_ids):
        return
    if bool((position_ids[0, 1:] <= position_ids[0, :-1]).any()):
        warnings.warn("position_ids restart inside the row, but transformers built no mask for packed sequences "
                      "(it reads packing from position_ids only without a cache and without an attention_mask): "
                      "the attention spans the sequences, as on 'sdpa' and 'eager'. Pass use_cache=False, or "
                      "cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k "
                      "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)), to keep them apart.", stacklevel=3)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, softcap=None, s_aux=None, sliding_window=None, cu_seq_lens_q=None,
                      cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention-function signature: query (B, H, Lq, D), key/value (B, Hkv, Lk, D),
    attention_mask None, or broadcasting to (B, H, Lq, Lk), bool (True = attend) or float (added).
    ``softcap`` and ``s_aux`` (one sink logit per query head) go to the kernels; ``sliding_window``
    is read only with ``cu_seq_lens_*`` (elsewhere the mask carries the window). Returns
    (output (B, Lq, H, Dv), None)."""
    _check_kwargs(module, kwargs)
    if _attention_module._context_parallel is not None and _attention_module._context_parallel.active() is not None:
        return _context_parallel_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                         position_bias, softcap, s_aux, cu_seq_lens_q, kwargs.get("position_ids"))
    if kwargs.get("output_attentions"):
        warnings.warn(f"attn_implementation={NAME!r} returns no attention weights (output_attentions=True gives "
                      f"None, as 'sdpa' does); use attn_implementation='eager' for them", stacklevel=2)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2 and \
            not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
        # 0/1 integers would be added to the scores, masking nothing (eager does that; sdpa refuses them)
        raise TypeError(f"{type(module).__name__}: attention_mask must be bool (True = attend) or float (added "
                        f"to the scores), got {attention_mask.dtype}")
    b, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    softcap = _softcap(module, softcap)
    sinks = _sinks(module, s_aux, heads)
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if position_bias is not None:
            _refuse(module, "position_bias with cu_seq_lens_q/cu_seq_lens_k", "packed sequences take no bias")
        cu_q, cu_k, max_q, max_k, window = _kwargs_packing(module, query, key, attention_mask, is_causal,
                                                           sliding_window, cu_seq_lens_q, cu_seq_lens_k,
                                                           max_length_q, max_length_k)
        return _varlen(query, key, value, cu_q, cu_k, max_q, max_k, window, scaling, dropout, softcap, sinks), None

    window = None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool and attention_mask.dim() == 4 \
            and attention_mask.shape[-2:] == (q_len, k_len):
        packed = getattr(attention_mask, _PACKED_TAG, None)
        if packed is not None and position_bias is None and attention_mask.shape[0] == b and q_len == k_len:
            # The mask is exactly causal within each packed sequence (build_attention_mask compared it
            # element by element with the sequences' block-diagonal pattern): varlen_attn computes the same.
            cu, max_len, window = packed
            return _varlen(query, key, value, cu, cu, max_len, max_len, window, scaling, dropout, softcap, sinks), None
        window = getattr(attention_mask, _WINDOW_TAG, None)

    # As transformers' sdpa: the module's causality counts only when no mask says otherwise.
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is None and is_causal and b == 1 and q_len == k_len > 1:
        _warn_if_unmasked_packing(kwargs.get("position_ids"))
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and q_len < k_len:
        # build_attention_mask leaves no causal mask out with more keys than queries: the model kept
        # only its last queries (the last query is at the last key).
        is_causal, window = False, (-1, 0)
    if position_bias is not None:
        attention_mask = _position_bias_mask(position_bias, attention_mask, is_causal, q_len, k_len)
        is_causal = False
    if attention_mask is not None and attention_mask.dim() == 2:  # a (B, Lk) padding mask, 1 = attend
        attention_mask = attention_mask.bool()[:, None, None, :]
    elif attention_mask is not None and attention_mask.dtype not in (torch.bool, torch.float32):
        attention_mask = attention_mask.to(query.dtype)  # float32 stays: added in float32, as by sdpa
    key_padding_mask = None
    if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4 \
            and all(attention_mask.shape[d] == 1 or attention_mask.stride(d) == 0 for d in (1, 2)):
        # The same keys for every query and head: the kernels' key padding mask (True = padded).
        key_padding_mask = ~attention_mask[:, 0, 0, :].expand(b, k_len)
        attention_mask = None
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=float(dropout),
                                       is_causal=is_causal, scale=scaling, enable_gqa=key.shape[1] != heads,
                                       key_padding_mask=key_padding_mask, window_size=window, softcap=softcap,
                                       sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _transformers_import_error(exc):
    """The ImportError for a failed ``import transformers``: "not installed" only when it is not."""
    if importlib.util.find_spec("transformers") is None:
        return ImportError("transformer_fast.integrations.huggingface needs the `transformers` package "
                           "(pip install transformers)")
    return ImportError(f"transformer_fast.integrations.huggingface: transformers is installed, but importing it "
                       f"failed: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------------
# Context parallelism (transformer_fast.distributed.context_parallel): each rank runs the model on
# its shard of every sequence, with the global position_ids (shard_positions). The masks
# transformers builds are for the local lengths; the causal structure is global, so inside a block
# the mask builder returns None for a causal mask (attention_forward passes is_causal), a tagged
# all-True view for a bidirectional one, and refuses everything else on every rank together.
# ------------------------------------------------------------------------------------------------
_CP_BIDIRECTIONAL_TAG = "_transformer_fast_cp_bidirectional"
_CP_REFUSALS = (  # (what, why), indexed by the code the ranks agree on
    ("a key/value cache holding earlier tokens, or a static cache", "a context-parallel forward takes whole "
     "sequences; decode outside the block, and pass use_cache=False or a fresh DynamicCache"),
    ("sliding-window or chunked attention", "its masks are built for the local lengths"),
    ("a model-specific mask pattern", "only transformers' causal and bidirectional masks have a global form here"),
    ("padding (an attention_mask with zeros)", "pack the sequences without padding"),
    ("position_ids that are not this rank's shard of one sequence per row (packed sequences?)",
     "transformers separates packed sequences with a mask built for the local lengths; pass "
     "position_ids=shard_positions(seq_len, group, layout)"),
)


def _attention_mask(*args, **kwargs):
    """The mask function registered with transformers: ``build_attention_mask``, or inside a
    ``context_parallel`` block ``_context_parallel_mask``."""
    router = _attention_module._context_parallel
    setting = router.active() if router is not None else None
    if setting is None:
        return build_attention_mask(*args, **kwargs)
    return _context_parallel_mask(setting, *args, **kwargs)


def _closure_vars(fn):
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def _causal_and_positions(mask_function):
    """(causal, position_ids) for transformers' causal or bidirectional mask function, as it is or
    restricted to the sequences transformers read off ``position_ids`` (``and_masks`` of the
    remapped mask and the packed-sequence mask: then also those position_ids); causal None for
    any other function."""
    from transformers import masking_utils as mu
    if mask_function is None or mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    parts = _closure_vars(mask_function).get("mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2 and "packed_sequence_mask" in _closure_vars(parts[1]):
        remapped = _closure_vars(parts[0])
        base, positions = remapped.get("mask_function"), remapped.get("position_ids")
        if isinstance(positions, torch.Tensor) and base in (mu.causal_mask_function, mu.bidirectional_mask_function):
            return base is mu.causal_mask_function, positions
    return None, None


def _context_parallel_mask(setting, batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                           attention_mask=None, local_size=None, allow_is_causal_skip=True,
                           allow_is_bidirectional_skip=False, config=None, **kwargs):
    """The mask inside a ``context_parallel`` block: None (causal), an all-True view tagged
    bidirectional, or ValueError on every rank of the group (the ranks agree on the first problem
    any of them sees: a rank whose shard holds the padding must not leave the others waiting in a
    collective)."""
    import torch.distributed as dist

    from ..distributed.sequence import shard_positions
    from .huggingface_masks import _is_int
    device = kwargs.get("device", "cpu")
    causal, positions = _causal_and_positions(mask_function)
    code = 0
    if not (_is_int(q_offset) and _is_int(kv_offset)) or q_offset or kv_offset or q_length != kv_length:
        code = 1
    elif local_size is not None:
        code = 2
    elif kwargs.get("use_vmap") or causal is None:
        code = 3
    elif not _tracing(attention_mask) and not _tracing(positions):
        if attention_mask is not None and not bool(attention_mask.all()):
            code = 4
        elif positions is not None:
            expected = shard_positions(q_length * dist.get_world_size(setting.group), setting.group, setting.layout,
                                       device=positions.device)
            code = 0 if torch.equal(positions, expected.expand_as(positions)) else 5
        agreed = torch.tensor([code], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=setting.group)
        code = int(agreed)
    if code:
        what, why = _CP_REFUSALS[code - 1]
        raise ValueError(f"attn_implementation={NAME!r} under context_parallel does not support {what}: {why}")
    if causal:
        return None
    mask = torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
    setattr(mask, _CP_BIDIRECTIONAL_TAG, True)
    return mask


_cp_positions_checked = None  # a weak reference to the last position_ids found to be a shard's


def _check_context_parallel_positions(module, position_ids, setting, n_local):
    """Refuses position_ids 0..n_local-1 (what a model makes when given none) under the head-tail
    layout over several ranks, where no rank's shard has those positions (so every rank refuses)."""
    global _cp_positions_checked
    if not isinstance(position_ids, torch.Tensor) or setting.layout != "head_tail" or _tracing(position_ids):
        return
    if _cp_positions_checked is not None and _cp_positions_checked() is position_ids:
        return
    import weakref

    import torch.distributed as dist
    if dist.get_world_size(setting.group) > 1 and position_ids.shape[-1] == n_local and \
            bool((position_ids == torch.arange(n_local, device=position_ids.device)).all()):
        raise ValueError(f"{type(module).__name__}: position_ids are 0..{n_local - 1}, the local positions of a "
                         f"sequence shard (the model's default without position_ids); under context_parallel the "
                         f"positions are global: pass position_ids=shard_positions(seq_len, group, layout)")
    _cp_positions_checked = weakref.ref(position_ids)


def _context_parallel_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                              softcap, s_aux, cu_seq_lens_q, position_ids):
    """attention_forward inside a ``context_parallel`` block: query/key/value are the local shards;
    the routed ``scaled_dot_product_attention`` attends over the whole sequence."""
    def refuse(what, why):
        raise ValueError(f"{type(module).__name__}: attn_implementation={NAME!r} under context_parallel does not "
                         f"support {what} ({why})")
    if cu_seq_lens_q is not None:
        refuse("cu_seq_lens_q/cu_seq_lens_k", "packed batches: shard them with shard_packed and call varlen_attn")
    if position_bias is not None:
        refuse("a position_bias", "a bias is built for the local lengths")
    if attention_mask is None:  # as sdpa reads a left-out mask
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    elif getattr(attention_mask, _CP_BIDIRECTIONAL_TAG, False):
        is_causal = False
    else:
        refuse("an attention mask other than transformers' causal or bidirectional one",
               "a mask is built for the local lengths")
    setting = _attention_module._context_parallel.active()
    _check_context_parallel_positions(module, position_ids, setting, query.shape[2])
    heads = query.shape[1]
    out = scaled_dot_product_attention(query, key, value, dropout_p=float(dropout), is_causal=is_causal, scale=scaling,
                                       enable_gqa=key.shape[1] != heads, softcap=_softcap(module, softcap),
                                       sinks=_sinks(module, s_aux, heads))
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME):
    """Registers ``attention_forward`` (and ``build_attention_mask``) with transformers under
    ``name``, so that ``attn_implementation=name`` selects it, and makes building a model that
    ``supports_model`` rejects with it raise ValueError. Safe to call more than once."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise _transformers_import_error(exc) from exc
    AttentionInterface.register(name, attention_forward)
    if not _install_construction_check(name):
        warnings.warn(f"this transformers version offers no place to check models when they are built: {name!r} "
                      f"does not refuse the models it cannot serve; check them with "
                      f"transformer_fast.integrations.huggingface.supports_model", stacklevel=2)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 builds masks itself for any registered attention
        return name
    AttentionMaskInterface.register(name, _attention_mask)
    return name
